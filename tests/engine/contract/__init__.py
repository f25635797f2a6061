"""The torch-free contract with the operator (kvpilot.engine.contract)."""
