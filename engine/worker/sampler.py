"""Next tokens from logits for a whole batch at once: greedy, temperature, top-k and top-p per row.

Sampling draws from the filtered distribution with the exponential race (argmax of p / E, E ~
Exp(1)), which is a categorical draw that vectorises over rows. Rows of seeded requests draw their
noise from the request's own generator, so a seeded request samples the same tokens whatever else
is in the batch; every other row shares the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Per-row settings of one step's logits; built by the model runner."""

    temperature: torch.Tensor  # [rows] float; rows below GREEDY_TEMPERATURE are greedy
    top_k: torch.Tensor  # [rows] long; 0 means all tokens
    top_p: torch.Tensor  # [rows] float; 1.0 means all tokens
    greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [rows, vocab] float32; returns the sampled token id of every row, [rows] long."""
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        probs = filtered_probs(logits, meta)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(meta.greedy, greedy, sampled)


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Each row's distribution after temperature, top-k and top-p; greedy rows are left unscaled."""
    temperature = torch.where(meta.greedy, torch.ones_like(meta.temperature), meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = torch.where((meta.top_k <= 0) | (meta.top_k > vocab), torch.full_like(meta.top_k, vocab), meta.top_k)
    filter_k = bool((top_k < vocab).any())
    filter_p = bool((meta.top_p < 1.0).any())
    if not (filter_k or filter_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if filter_k:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    if filter_p:
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= meta.top_p.unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
