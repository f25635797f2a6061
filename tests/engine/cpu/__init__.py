"""The CPU room (kvpilot.engine.cpu): threads, features, kernels, oneDNN's layout, the compiled decode step."""
