"""Continuous batching: which requests run this step, how many of their tokens, and the bookkeeping
after the step ran.

Every step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
requests go first, in admission order, so decodes are never starved by new prompts; the rest of the
budget admits waiting prompts, chunked to fit. When the block pool runs dry, the most recently
admitted request is preempted: its blocks are freed and it is recomputed later (its prefix may
still be served by the prefix cache), so no request ever fails for lack of memory.

`schedule()` returns a SchedulerOutput; `update_from_output()` takes it back with the tokens the
model runner sampled and does all the bookkeeping: computed tokens (this class is their only
writer), new tokens, stop checks on token ids, freeing finished requests' blocks. Stop strings are
text: the output processor finds them and finishes the request through `finish_requests`.

Speculative decoding: a decoding request may carry draft tokens (proposed by the model runner after
its last step). They are scheduled with it, inside the token budget, and the step computes their KV
too; `update_from_output` keeps the KV of the accepted drafts and rolls back the rejected ones.
It also records each verification in the request's acceptance window (engine/contract/acceptance_window.py):
a request backing off gets no drafts, and its scheduled step tells the runner not to propose any.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvpilot.engine.contract.acceptance_window import AcceptancePolicy, AcceptanceWindow
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request, RequestStatus
from kvpilot.engine.outputs import ModelRunnerOutput, TokenLogprobs


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, from request.num_computed_tokens on
    block_ids: list[int]  # the request's whole block table
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify, after its last token
    # Whether the runner proposes drafts for it after this step (not while its acceptance window backs off).
    propose: bool = True


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that finished since the previous step: the model runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step did to one request: its new tokens and, when it ended, why."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None  # see ModelRunnerOutput

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative decoding since start: verification steps (one per request with drafts), draft
    tokens verified, drafts accepted, and accepted drafts by position in the draft (0 = first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def add(self, num_draft_tokens: int, num_accepted: int) -> SpecDecodingStats:
        per_position = list(self.accepted_per_position) + [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            per_position[position] += 1
        return SpecDecodingStats(
            self.num_drafts + 1,
            self.num_draft_tokens + num_draft_tokens,
            self.num_accepted_tokens + num_accepted,
            tuple(per_position),
        )


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state after a step, as a value (for metrics and logs)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # since start
    prefix_cache_queries: int  # prompt tokens looked up, since start
    prefix_cache_hits: int
    # Requests scheduled for the first time since the previous stats: (request id, seconds queued).
    first_scheduled: tuple[tuple[str, float], ...] = ()
    spec_decoding: SpecDecodingStats = SpecDecodingStats()
    # LoRA adapters of the running and of the waiting requests, by name (vllm:lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        max_model_len: int | None = None,
        eos_token_ids: Collection[int] = (),
        num_lookahead_tokens: int = 0,
        acceptance_policy: AcceptancePolicy | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.kv = kv
        # Distinct LoRA adapters in the running batch at most (None: LoRA is off).
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Slots reserved past each step's tokens, where a draft model writes KV for its drafts.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        self._first_scheduled: list[tuple[str, float]] = []
        self.spec_decoding = SpecDecodingStats()
        # Without a policy every request proposes whatever its drafts' fate.
        self.acceptance_policy = acceptance_policy
        self.acceptance: dict[str, AcceptanceWindow] = {}  # requests that verified drafts, until they finish

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, list[int]]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_pending = request.num_tokens - request.num_computed_tokens
            drafts = request.spec_token_ids[: max(0, min(budget - num_pending, self._max_drafts(request)))]
            num_new = min(num_pending + len(drafts), budget)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, drafts))
                budget -= num_new
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        if not out.preempted:
            self._admit(budget, scheduled)
        out.scheduled = [ScheduledRequest(r, n, self.kv.block_ids(r), d, self._proposes(r)) for r, n, d in scheduled]
        return out

    def _admit(self, budget: int, scheduled: list[tuple[Request, int, list[int]]]) -> None:
        """Admit waiting prompts in arrival order while the budget, the sequence cap and the blocks
        allow. A request whose LoRA adapter would be one more than max_loras in the running batch
        waits, and those behind it go on (as vLLM's scheduler skips it)."""
        now = time.monotonic()
        loras = {r.lora.lora_id for r in self.running if r.lora is not None}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            lora_id = request.lora.lora_id if request.lora is not None else None
            if lora_id is not None and lora_id not in loras and len(loras) >= (self.max_loras or 0):
                skipped.append(self.waiting.popleft())
                continue
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, cached, self.num_lookahead_tokens):
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(request, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                self._first_scheduled.append((request.request_id, now - request.arrival_time))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora_id is not None:
                loras.add(lora_id)
            scheduled.append((request, num_new, []))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _proposes(self, request: Request) -> bool:
        window = self.acceptance.get(request.request_id)
        return window is None or window.proposes

    def _max_drafts(self, request: Request) -> int:
        """Drafts worth verifying: a step emits up to one token more than it verifies, and no more
        than max_tokens or max_model_len allow."""
        room = request.params.max_tokens - request.num_output_tokens - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens)
        return room

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by the tokens it computed and append what was sampled for
        it (a list: a verification step yields several); finish requests that hit a stop."""
        now = time.monotonic()
        outputs = []
        for item in scheduler_output.scheduled:
            request = item.request
            if request.is_finished:  # finished while the step ran (an abort)
                continue
            request.num_computed_tokens += item.num_tokens
            new_tokens = runner_output.sampled.get(request.request_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            self._record_acceptance(item, new_tokens)
            # Drafts proposed as the window backed off (in this very step) are not verified.
            drafts = runner_output.spec_token_ids.get(request.request_id, [])
            request.spec_token_ids = drafts if self._proposes(request) else []
            if not new_tokens:
                self.kv.cache_full_blocks(request)
                # A prefill chunk short of the prompt's end samples nothing.
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(request, [], prompt_logprobs=prompt_logprobs))
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            appended, finish = self._append_until_stop(request, new_tokens)
            if item.spec_token_ids:
                # The step wrote KV for every draft; the sequence keeps those it appended (all its
                # new tokens but the last), which a stop among the accepted drafts cuts short.
                request.num_computed_tokens -= len(item.spec_token_ids) - (len(appended) - 1)
                # The newest token's slot stays: the next step computes it there, and a draft model
                # has already written its K/V there (and will not again).
                self.kv.rollback(request, request.num_tokens)
                self.spec_decoding = self.spec_decoding.add(len(item.spec_token_ids), len(new_tokens) - 1)
            # After the append: accepted drafts are computed tokens, and their blocks' keys hash them.
            self.kv.cache_full_blocks(request)
            if finish is not None:
                self._finish(request, *finish)
            logprobs = runner_output.logprobs.get(request.request_id)
            outputs.append(
                EngineCoreOutput(
                    request,
                    appended,
                    *(finish or (None, None)),
                    logprobs=logprobs[: len(appended)] if logprobs is not None else None,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return outputs

    def _record_acceptance(self, item: ScheduledRequest, new_tokens: list[int] | None) -> None:
        """A verification goes into the request's window; a step that sampled without drafts
        counts down its back-off."""
        request_id = item.request.request_id
        if item.spec_token_ids and new_tokens and self.acceptance_policy is not None:
            window = self.acceptance.setdefault(request_id, AcceptanceWindow(self.acceptance_policy))
            window.record(len(item.spec_token_ids), len(new_tokens) - 1)
        elif new_tokens and request_id in self.acceptance:
            self.acceptance[request_id].tick()

    def _append_until_stop(
        self, request: Request, new_tokens: list[int]
    ) -> tuple[list[int], tuple[FinishReason, str | int | None] | None]:
        """Append the step's tokens up to and including the first that stops the request: the
        tokens appended, and why it stops (None if it goes on)."""
        for i, token in enumerate(new_tokens):
            request.token_ids.append(token)
            finish = self._check_stop(request, token)
            if finish is not None:
                return new_tokens[: i + 1], finish
        return new_tokens, None

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason, str | int | None] | None:
        params = request.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP, token
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH, None
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish_requests(
        self, requests: Iterable[Request], reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        """Finish running or waiting requests (stopped by a stop string, or aborted) and free their blocks."""
        for request in requests:
            if not request.is_finished:
                self._finish(request, reason, stop_reason)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        self.acceptance.pop(request.request_id, None)
        request.finish(reason, stop_reason)
        self._finished_ids.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def make_stats(self) -> SchedulerStats:
        pool = self.kv.pool
        first, self._first_scheduled = tuple(self._first_scheduled), []
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=pool.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=pool.stats.queries,
            prefix_cache_hits=pool.stats.hits,
            first_scheduled=first,
            spec_decoding=self.spec_decoding,
            running_loras=_lora_names(self.running) if self.max_loras else (),
            waiting_loras=_lora_names(self.waiting) if self.max_loras else (),
        )
