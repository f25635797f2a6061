"""The engine's bookkeeping (kvpilot.engine.core): blocks, the KV-cache manager, the scheduler."""
