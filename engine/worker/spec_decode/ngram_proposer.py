"""Prompt-lookup drafts: if the context's last n tokens occurred before, propose what followed them.

Outputs that copy from their input (code edits, extraction, summaries quoting the text) repeat long
runs of the prompt; this proposer finds them with no model at all. The longest suffix (from
`max_n` down to `min_n` tokens) that occurs earlier wins, and of its occurrences the latest, which
reflects the most recent copying.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvpilot.engine.worker.spec_decode import DraftInput


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, sequences: list[DraftInput]) -> dict[str, list[int]]:
        return {s.request_id: self.lookup(s.token_ids) for s in sequences}

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept between steps."""

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids`; [] if no suffix of at least
        `min_n` tokens occurred before."""
        k = self.num_tokens
        if len(token_ids) <= self.min_n:
            return []
        context = np.asarray(token_ids, dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start early enough to have at least one token after them.
            windows = sliding_window_view(context[: length - 1], n)
            hits = np.flatnonzero((windows == context[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return context[start : start + k].tolist()
        return []
