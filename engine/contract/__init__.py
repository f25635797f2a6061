"""The engine's contract with the operator, torch-free: the operator image ships this package (and
the CLI dispatcher) and no other engine code: the flags, the device profile's schema, the
acceptance window the planner runs to predict speculation."""
