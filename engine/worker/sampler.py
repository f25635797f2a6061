"""Next tokens from logits for a whole batch at once.

Per row: penalties, banned tokens (min_tokens) and a structured output's grammar (a token bitmask)
change the logits, then greedy takes the argmax,
and sampling applies temperature, top-k, top-p and min-p and draws with the exponential race
(argmax of p / E, E ~ Exp(1)), a categorical draw that vectorises over rows. Rows of seeded
requests draw their noise from the request's own generator, so a seeded request samples the same
tokens whatever else is in the batch; every other row shares the engine's generator.
Log-probabilities, when asked for, are the model's own (before any of the above), as OpenAI's are.

Rows that carry a draft token (speculative decoding) are verified by rejection sampling, which
keeps the output distribution exactly the target's: a draft proposed with probability q(d) is
kept with probability min(1, p(d) / q(d)), and a rejected row samples from the normalised
max(0, p - q). Prompt-lookup drafts are deterministic (q is one-hot on d), so a draft is kept
with probability p(d) and a rejection samples from p with d removed. p is the distribution plain
sampling draws from: after penalties and every filter, renormalised. Under greedy decoding a draft
is kept exactly when it is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xgrammar


@dataclass
class RowPenalty:
    row: int
    output_ids: torch.Tensor  # [n] long: the tokens generated so far
    seen_ids: torch.Tensor  # [m] long: distinct tokens of prompt and output
    presence: float
    frequency: float
    repetition: float


@dataclass
class SamplingMetadata:
    """Per-row settings of one step's logits; built by sampling_inputs.py."""

    temperature: torch.Tensor  # [rows] float
    top_k: torch.Tensor  # [rows] long; 0 means all tokens
    top_p: torch.Tensor  # [rows] float; 1.0 means all tokens
    greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    min_p: torch.Tensor | None = None  # [rows] float, when any row uses it
    penalties: list[RowPenalty] = field(default_factory=list)
    banned: dict[int, list[int]] = field(default_factory=dict)  # row -> tokens it may not sample now
    num_logprobs: dict[int, int] = field(default_factory=dict)  # row -> top alternatives wanted
    # [rows] long: the draft token each row verifies, -1 for rows that only sample; None: no drafts.
    draft_token_ids: torch.Tensor | None = None
    # Rows constrained by a grammar: a [rows, ceil(vocab / 32)] int32 bitmask of the allowed tokens,
    # and the rows it applies to.
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] long; in a row whose draft was rejected, the token sampled instead
    # row -> (the chosen token's logprob, top alternatives as (token ids, logprobs))
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    accepted: torch.Tensor | None = None  # [rows] bool: the row's draft is kept (with draft_token_ids)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] float32, modified in place."""
        raw = torch.log_softmax(logits, dim=-1) if meta.num_logprobs else None
        apply_penalties(logits, meta)
        tokens = logits.argmax(dim=-1)
        drafts = meta.draft_token_ids
        has_draft = drafts >= 0 if drafts is not None else None
        accepted = tokens == drafts if drafts is not None else None
        if not meta.all_greedy:
            probs = filtered_probs(logits, meta)
            if drafts is not None:
                kept, probs = verify_drafts(probs, drafts, has_draft, self.generator)
                accepted = torch.where(meta.greedy, accepted, kept)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for row, generator in meta.generators.items():
                noise[row].exponential_(generator=generator)
            tokens = torch.where(meta.greedy, tokens, (probs / noise).argmax(dim=-1))
        if accepted is not None:
            accepted &= has_draft
        return SamplerOutput(
            tokens, token_logprobs(raw, tokens, meta.num_logprobs) if raw is not None else {}, accepted
        )


def verify_drafts(
    probs: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of deterministic drafts against normalised target rows: which drafts are
    kept, and the rows that the rejected ones resample from.

    A draft d is kept with probability p(d); a rejected one resamples from max(0, p - onehot(d)),
    p with d removed. Where d held all of p's mass (the filters kept it alone) that residual is
    empty and, as in standard rejection sampling, the row samples from p itself: an all-zero row
    would make the exponential race pick token 0."""
    draft_ids = drafts.clamp(min=0).unsqueeze(1)
    kept = torch.rand(drafts.shape, device=probs.device, generator=generator) < probs.gather(1, draft_ids).squeeze(1)
    residual = probs.scatter(1, draft_ids, 0.0)
    resample = has_draft & (residual.sum(dim=-1) > 0)
    return kept, torch.where(resample.unsqueeze(1), residual, probs)


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, wanted: dict[int, int]
) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """For each row in `wanted`: the logprob of its token and its top `wanted[row]` alternatives."""
    k = max(wanted.values())
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    out = {}
    for row, n in wanted.items():
        top = list(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist())) if n else []
        out[row] = (chosen[row], top)
    return out


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    for p in meta.penalties:
        row = logits[p.row]
        if p.repetition != 1.0:
            seen = row[p.seen_ids]
            row[p.seen_ids] = torch.where(seen > 0, seen / p.repetition, seen * p.repetition)
        if (p.presence or p.frequency) and p.output_ids.numel():
            counts = torch.bincount(p.output_ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency * counts + p.presence * (counts > 0).to(row.dtype)
    for r, ids in meta.banned.items():
        logits[r, ids] = float("-inf")
    if meta.token_bitmask is not None:
        bitmask, rows = meta.token_bitmask
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p, renormalised over the
    tokens the filters keep (rejection sampling compares drafts with these probabilities); greedy
    rows are left unscaled."""
    temperature = torch.where(meta.greedy, torch.ones_like(meta.temperature), meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = torch.where((meta.top_k <= 0) | (meta.top_k > vocab), torch.full_like(meta.top_k, vocab), meta.top_k)
    filter_k = bool((top_k < vocab).any())
    filter_p = bool((meta.top_p < 1.0).any())
    if not (filter_k or filter_p):
        probs = torch.softmax(logits, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if filter_k:
            kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        if filter_p:
            # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p.
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= meta.top_p.unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    if meta.min_p is not None:
        threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    if filter_p or meta.min_p is not None:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
