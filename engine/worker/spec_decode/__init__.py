"""Speculative decoding: proposers of draft tokens (the target model verifies them in the runner's
next step, through the sampler's rejection rule)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol


class DraftInput(NamedTuple):
    """A sequence to draft for: its tokens so far (the step's new ones included) and its block
    table (with the lookahead slots the scheduler reserved for drafting)."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]


class Proposer(Protocol):
    def propose(self, sequences: list[DraftInput]) -> dict[str, list[int]]:
        """Draft tokens to follow each sequence (an empty list where there are none)."""

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what is kept for these requests (finished, or preempted and to be recomputed)."""
