"""The InferenceService API: its spec and status (pydantic, the source the CRD is generated from by
crd.py, `kvpilot crd`) and the names every other room shares (group, kind, labels, ports, GPU resource
names). Depends on nothing."""
