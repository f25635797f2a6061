"""The offline quantization tools behind `kvpilot quantize`: AWQ's calibrated search, its calibration
text, and the compressed-tensors checkpoint writer. The engine never imports them: it reads what they
write through kvpilot.engine.model (the loader and its compressed-tensors reader)."""
