"""The offline quantization tools (kvpilot.engine.quantize)."""
