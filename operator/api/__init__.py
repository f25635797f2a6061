"""The InferenceService API: its spec (pydantic, the source the CRD schema is checked against) and the
names every other room shares (group, kind, labels, ports, GPU resource names). Depends on nothing."""
