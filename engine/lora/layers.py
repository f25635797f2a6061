"""The low-rank delta of each request's adapter, added to the base projections of one mixed batch.

Each target projection of the model is wrapped in a LoRALinear: the base layer runs as it does
without LoRA (its packed, quantized or plain weight untouched), then each adapter present in the
step adds x A^T B^T * scaling to the rows of its own requests, in the order and dtype PEFT computes
it. The rows of base-model requests get no delta (they index no adapter). The rows per adapter are
worked out once per step (LoRABatch), not per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.lora.adapter import LoRAAdapter
from kvpilot.engine.model.layers import Linear

# Our module in a decoder layer -> {its shard (None: not fused): the PEFT module that targets it}.
WRAPPED = {
    ("self_attn", "qkv_proj"): {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    ("self_attn", "o_proj"): {None: "o_proj"},
    ("mlp", "gate_up_proj"): {"gate": "gate_proj", "up": "up_proj"},
    ("mlp", "down_proj"): {None: "down_proj"},
}


class LoRABatch:
    """The step's adapters and the rows of each (set by the model runner around the forward)."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAAdapter, torch.Tensor]] = []


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, layer: int, shards: dict[str | None, str], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        # PEFT module -> the columns of the output it adds to.
        self.targets = {module: base.rows(shard) for shard, module in shards.items()}
        self.batch = batch

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """FusedLinear.split, for callers that split the fused output."""
        return self.base.split(y)  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter, rows in self.batch.groups:
            xs = x[rows]
            for module, columns in self.targets.items():
                w = adapter.weights.get((self.layer, module))
                if w is None:
                    continue
                # As PEFT's Linear: result + lora_B(lora_A(x)) * scaling.
                delta = nn.functional.linear(nn.functional.linear(xs, w.a), w.b) * adapter.scaling
                y[rows, columns] = y[rows, columns] + delta
        return y


def wrap(model: nn.Module, batch: LoRABatch) -> int:
    """Wrap every target projection of `model`'s decoder layers; how many were wrapped."""
    count = 0
    for index, layer in enumerate(model.model.layers):
        for (block, name), shards in WRAPPED.items():
            parent = getattr(layer, block)
            setattr(parent, name, LoRALinear(getattr(parent, name), index, shards, batch))
            count += 1
    return count
