"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
requests go first, in admission order, so decodes are never starved by new prompts; the rest of the
budget admits waiting prompts, chunked to fit. When the block pool runs dry, the most recently
admitted request is preempted: its blocks are freed and it is recomputed later (its prefix may
still be served by the prefix cache), so no request ever fails for lack of memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    # (request, number of new tokens to compute from request.num_computed_tokens on)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        return out

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish a running or waiting request (done, stopped or aborted) and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.finish(reason, stop_reason)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
