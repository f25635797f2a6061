"""LoRA adapters (kvpilot.engine.lora)."""
