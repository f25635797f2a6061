"""`kvpilot profile` and the device profile it writes (kvpilot.engine.profiling)."""
