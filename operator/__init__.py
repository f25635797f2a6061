"""kvpilot operator: plans, renders and reconciles InferenceService objects."""
