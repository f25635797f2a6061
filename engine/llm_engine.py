"""The engine loop: admit requests, schedule a step, run it, sample, detect stops, free."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.detokenizer import append_tokens
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.model.loader import EMBEDDED_MODEL, load_tokenizer, resolve_model
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.worker.sampler import sample
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class StepUpdate:
    request: Request
    new_token_ids: list[int]
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        # Validated again so that overrides get the same checks as the config itself.
        self.config = EngineConfig(**((config.model_dump() if config else {}) | overrides))
        torch.manual_seed(self.config.seed)
        self.model_path = resolve_model(self.config.model)
        self.model_name = self.config.model or EMBEDDED_MODEL
        self.tokenizer = load_tokenizer(self.model_path)
        self.runner = ModelRunner(self.config, self.model_path)
        self.max_model_len = self._max_model_len()
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, Request] = {}
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._ids = itertools.count()

    def _max_model_len(self) -> int:
        capacity = self.runner.num_blocks * self.config.block_size
        model_limit = self.runner.hf_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            if capacity < model_limit:
                log.warning("max_model_len capped from %d to %d tokens by the KV pool", model_limit, capacity)
            return min(model_limit, capacity)
        if wanted > model_limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {model_limit} tokens")
        if wanted > capacity:
            raise ValueError(
                f"max_model_len {wanted} exceeds the KV pool of {capacity} tokens "
                f"({self.runner.num_blocks} blocks of {self.config.block_size}); raise kv_cache_memory_bytes or lower max_model_len"
            )
        return wanted

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.runner.hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids of a conversation, ending with the assistant's turn to speak."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        vocab = self.runner.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepUpdate]:
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return []
        now = time.monotonic()
        for request, _ in batch.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        block_ids = {r.request_id: self.kv.block_ids(r) for r, _ in batch.scheduled}
        sampled, logits = self.runner.execute(batch.scheduled, block_ids)
        for request, n in batch.scheduled:
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
        updates = []
        now = time.monotonic()
        for request, token in zip(sampled, sample(logits, sampled, self._generator)):
            request.token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            self._check_stop(request, token)
            updates.append(StepUpdate(request, [token], request.is_finished))
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return updates

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        checked = len(request.output_text)
        text = request.output_text = append_tokens(self.tokenizer, request.detokenizer, request.output_token_ids)
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            self._finish(request, FinishReason.STOP, token)
            return
        for stop in params.stop:
            # Only the new text, and the end of the old text a stop string could straddle.
            at = text.find(stop, max(0, checked - len(stop) + 1))
            if at != -1:
                request.output_text = text[:at]
                self.scheduler.finish(request, FinishReason.STOP, stop)
                return
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, FinishReason.LENGTH)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        # Once, at the end: the exact text of every token, including a held-back partial character.
        request.output_text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        self.scheduler.finish(request, reason, stop_reason)
