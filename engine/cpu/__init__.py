"""What only a CPU engine runs: its threads and feature detection, the C++ kernels and their build,
oneDNN's weight layout, and the compiled decode step with its cache."""
