"""What speculative decoding yields per step, in the engines' own unit of acceptance, and how often
a request verifies drafts at all under the engine's acceptance window.

Acceptance here is always the share of proposed drafts the target keeps (accepted / proposed), the
figure the engines export (ours and vLLM's) and status.latency shows: a verification of k drafts
then yields 1 + k x acceptance tokens on average. The literature quotes a per-token acceptance
instead, the chance that a draft is kept given the ones before it were; `accepted_share` converts.

The engine's acceptance window (engine/contract/acceptance_window.py) stops a request from proposing
for a back-off of plain steps once its recent verifications kept too few drafts, and probes with one
verification after each back-off. `verifying_share` predicts the share of a request's steps that
verify, so that a low acceptance costs what the engine makes it cost: a few verifications per
request, not one per step. It runs the engine's own window over simulated requests: the window
slides, and whether a request of a few dozen tokens backs off at all is a matter of chance that
mean counts get wrong (a closed form off by up to 0.3 at acceptance 0.4-0.5).
"""

from __future__ import annotations

import functools
import random

from kvpilot.engine.contract.acceptance_window import AcceptancePolicy, AcceptanceWindow
from kvpilot.engine.contract.config import (
    SPECULATIVE_ACCEPTANCE_WINDOW,
    SPECULATIVE_BACKOFF_STEPS,
    SPECULATIVE_MIN_ACCEPTANCE,
)

# ngram: measured as a share of 4 drafts (bench/RESULTS.md, "Speculative decoding"): the figure of
# open-ended chat answers, the conservative choice (answers that copy their prompt accept far more).
NGRAM_ACCEPTANCE = 0.29
# draft, eagle: NOT measured, per-token figures from the literature, converted to a share of the
# spec's k drafts. draft: a small draft of the target's own family (Leviathan et al. 2023, Medusa,
# vLLM's speculative-decoding posts); this project measured only drafts that tell nothing about it:
# the target's own early exit (0-2 %) and the target as its own draft (100 %). eagle: the EAGLE
# papers' chat figure at temperature 0 (~0.75-0.8); a head of one decoder layer drafts for a
# fraction of a draft model's cost.
# mtp: DeepSeek-V3's technical report (arXiv 2412.19437, section 5.4.3) gives 85-90 % for the token
# its one MTP module predicts; vLLM runs k > 1 drafts through the same module again, further from what
# it was trained for, hence 0.8.
PER_TOKEN_ACCEPTANCE = {"draft": 0.7, "eagle": 0.75, "mtp": 0.8}
ENGINE_WINDOW = AcceptancePolicy(SPECULATIVE_ACCEPTANCE_WINDOW, SPECULATIVE_MIN_ACCEPTANCE, SPECULATIVE_BACKOFF_STEPS)
# Simulated requests per prediction: the share comes out within ~0.01 of many more.
REQUESTS = 400


def accepted_share(per_token: float, k: int) -> float:
    """The share of k drafts kept when each is kept with probability `per_token` once the ones
    before it were: (α + α² + ... + α^k) / k (Leviathan et al., 2023)."""
    return sum(per_token**i for i in range(1, k + 1)) / k


def per_token(acceptance: float, k: int) -> float:
    """The per-token acceptance whose share of k drafts kept is `acceptance` (the inverse of
    `accepted_share`, which grows with it)."""
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if accepted_share(middle, k) < acceptance else (low, middle)
    return (low + high) / 2


def assumed_acceptance(mode: str, k: int) -> float:
    """The share of drafts a mode's verifications are assumed to keep where none was observed."""
    return NGRAM_ACCEPTANCE if mode == "ngram" else accepted_share(PER_TOKEN_ACCEPTANCE[mode], k)


def verifying_share(acceptance: float, k: int, output_tokens: float, policy: AcceptancePolicy = ENGINE_WINDOW) -> float:
    """The share of the steps of requests of `output_tokens` decoded tokens that verify drafts
    (k each, a share `acceptance` kept), under the engine's acceptance window `policy`."""
    return _simulated(round(acceptance, 2), k, max(1, round(output_tokens)), policy)


@functools.lru_cache(maxsize=256)
def _simulated(acceptance: float, k: int, output_tokens: int, policy: AcceptancePolicy) -> float:
    """Seeded, so that a plan is the same every time it is made."""
    keep = per_token(acceptance, k)
    rng = random.Random(0)
    verifications = steps = 0
    for _ in range(REQUESTS):
        window, tokens = AcceptanceWindow(policy), 0
        while tokens < output_tokens:
            steps += 1
            if not window.proposes:
                window.tick()
                tokens += 1
                continue
            kept = 0
            while kept < k and rng.random() < keep:
                kept += 1
            window.record(k, kept)
            verifications += 1
            tokens += 1 + kept
    return verifications / steps
