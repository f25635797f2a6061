"""LoRA adapters: PEFT's files read and checked, the low-rank layers, the registry of loaded adapters."""
