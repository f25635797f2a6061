"""Tiny random LoRA adapters made with PEFT on the embedded model, and PEFT's own model of each as
the oracle: greedy output of a request with an adapter equals HF + PEFT with that adapter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int


# Two adapters of different ranks, alphas and targets (one leaves the MLP alone).
SPECS = (
    AdapterSpec("alpha", 4, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 1),
    AdapterSpec("beta", 8, 32, ("q_proj", "v_proj", "o_proj"), 2),
)
# lora_B's spread: PEFT starts B at zero (a no-op adapter); this makes the delta change the tokens
# without swamping the base model's output.
B_STD = 0.05


def make_adapter(model_dir: Path, spec: AdapterSpec, folder: Path) -> PreTrainedModel:
    """Save a random PEFT adapter of `spec` in `folder`; the PEFT model (base + adapter) it came from."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * B_STD)
    model.save_pretrained(folder)
    return model.eval()
