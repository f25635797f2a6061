"""The model side (kvpilot.engine.model): quantized layers and checkpoints."""
