"""Turn last-position logits into next tokens: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from kvpilot.engine.core.request import Request


def sample(logits: torch.Tensor, requests: list[Request], default_generator: torch.Generator) -> list[int]:
    """logits: [len(requests), vocab] float32 on any device; one token per request."""
    if not requests:
        return []
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, request in enumerate(requests):
        params = request.params
        if params.greedy:
            tokens.append(greedy[row])
            continue
        probs = _filtered_probs(logits[row].cpu(), params.temperature, params.top_k, params.top_p)
        generator = request.generator or default_generator
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
