"""The commands beside serving (kvpilot.engine.tools)."""
