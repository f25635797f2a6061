"""Commands beside serving: `kvpilot eval`, `kvpilot download`, `kvpilot bench`."""
