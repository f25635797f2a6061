"""One step's sampling settings, row by row, from its requests (as step_inputs.py makes its forward's
inputs); and the settings under which the sampler allocates the most, for profiling."""

from __future__ import annotations

import torch

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import MAX_LOGPROBS
from kvpilot.engine.worker.grammar import GrammarMatchers
from kvpilot.engine.worker.sampler import RowPenalty, SamplingMetadata


def sampling_metadata(
    requests: list[Request],
    generators: dict[str, torch.Generator],
    eos_token_ids: frozenset[int],
    matchers: GrammarMatchers | None,
    device: torch.device,
) -> SamplingMetadata:
    """Per row; a request verifying drafts has a row per draft, and one more (speculable
    requests have no per-row state: no penalties, bans, logprobs or seeded generator). A seeded
    request's generator is kept in `generators` by request id, made on its first sampled row."""
    params = [r.params for r in requests]
    greedy = [p.greedy for p in params]
    row_generators = {}
    penalties = []
    banned = {}
    for row, request in enumerate(requests):
        p = request.params
        if p.seed is not None and not greedy[row]:
            generator = generators.get(request.request_id)
            if generator is None:
                generator = generators[request.request_id] = torch.Generator(device).manual_seed(p.seed)
            row_generators[row] = generator
        if p.penalized:
            output_ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
            seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=device)
            penalties.append(
                RowPenalty(row, output_ids, seen, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            )
        if request.num_output_tokens < p.min_tokens:
            banned[row] = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
    min_p = [p.min_p for p in params]
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all(greedy),
        generators=row_generators,
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None,
        penalties=penalties,
        banned={row: ids for row, ids in banned.items() if ids},
        num_logprobs={row: p.logprobs for row, p in enumerate(params) if p.logprobs is not None},
        token_bitmask=matchers.bitmask(requests, device) if matchers is not None else None,
    )


def worst_case_sampling(rows: int, drafts: bool, device: torch.device) -> SamplingMetadata:
    """Sampling settings under which the sampler allocates the most: every row sampled under
    top-k, top-p and min-p, asking for the most logprobs, and verifying a draft when speculating."""
    return SamplingMetadata(
        temperature=torch.ones(rows, device=device),
        top_k=torch.full((rows,), 50, dtype=torch.long, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        greedy=torch.zeros(rows, dtype=torch.bool, device=device),
        all_greedy=False,
        min_p=torch.full((rows,), 0.05, device=device),
        num_logprobs=dict.fromkeys(range(rows), MAX_LOGPROBS),
        draft_token_ids=torch.zeros(rows, dtype=torch.long, device=device) if drafts else None,
    )
