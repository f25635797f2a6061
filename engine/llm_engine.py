"""The engine loop: admit requests, schedule a step, run it, update the bookkeeping, make text."""

from __future__ import annotations

import itertools
import logging

import torch
from transformers import PretrainedConfig

from kvpilot.engine.contract.acceptance_window import AcceptancePolicy
from kvpilot.engine.contract.config import EMBEDDED_MODEL, EngineConfig
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from kvpilot.engine.lora.adapter import LoRAAdapter, load_adapter
from kvpilot.engine.lora.registry import AdapterRegistry
from kvpilot.engine.model.loader import load_config, load_tokenizer, resolve_model
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import ModelRunnerOutput, StepOutput
from kvpilot.engine.worker.grammar import Grammars
from kvpilot.engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Steps in a row whose every request failed, after which the engine itself is taken to be broken.
MAX_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        # Validated again so that overrides get the same checks as the config itself.
        self.config = EngineConfig(**((config.model_dump() if config else {}) | overrides))
        torch.manual_seed(self.config.seed)
        self.model_path = resolve_model(self.config.model)
        self.model_name = self.config.model or EMBEDDED_MODEL
        self.tokenizer = load_tokenizer(self.model_path)
        hf_config = load_config(self.model_path)
        eos_token_ids = self._eos_token_ids(hf_config)
        # Structured outputs end where the grammar allows one of these, as any request ends.
        self.grammars = Grammars(self.tokenizer, hf_config.vocab_size, eos_token_ids)
        self.runner = ModelRunner(self.config, self.model_path, hf_config, eos_token_ids, self.grammars)
        # A draft model writes KV this far past a sequence's tokens, in slots reserved for it.
        self.num_lookahead_tokens = self.config.num_speculative_tokens if self.config.speculative == "draft" else 0
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.runner.hf_config.vocab_size
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            num_lookahead_tokens=self.num_lookahead_tokens,
            acceptance_policy=AcceptancePolicy(
                self.config.speculative_acceptance_window,
                self.config.speculative_min_acceptance,
                self.config.speculative_backoff_steps,
            ),
            max_loras=self.config.max_loras if self.config.enable_lora else None,
        )
        self.loras = AdapterRegistry(self.config.cpu_loras, self.read_adapter)
        for name, path in self.config.lora_module_paths().items():
            self.add_lora(name, path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._failed_steps = 0  # consecutive steps in which every request failed

    def _max_model_len(self) -> int:
        # A sequence of max_model_len tokens must fit in the pool with its lookahead slots.
        capacity = self.runner.num_blocks * self.config.block_size - self.num_lookahead_tokens
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
                f"max_model_len {wanted} exceeds the KV pool of {capacity} tokens ({self.runner.num_blocks} blocks of "
                f"{self.config.block_size}, less {self.num_lookahead_tokens} lookahead slots); "
                "raise kv_cache_memory_bytes or lower max_model_len"
            )
        return wanted

    def _eos_token_ids(self, hf_config: PretrainedConfig) -> frozenset[int]:
        ids = set()
        eos = getattr(hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def read_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the PEFT adapter at `path` for this model (AdapterError if it cannot serve);
        touches no engine state, so a server calls it off the engine thread."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need enable_lora")
        if name == self.model_name:
            raise ValueError(f"an adapter cannot take the base model's name {name!r}")
        return load_adapter(name, path, self.runner.hf_config, self.config.max_lora_rank, self.runner.dtype)

    def add_lora(self, name: str, path: str, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Serve the adapter at `path` under `name` (`adapter`: read_adapter's result, if already read)."""
        adapter = self.loras.add(name, path, adapter or self.read_adapter(name, path))
        log.info("event=lora_loaded name=%s path=%s rank=%d bytes=%d", name, path, adapter.rank, adapter.nbytes)
        return adapter

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`; its requests in flight finish with it."""
        self.loras.remove(name)
        log.info("event=lora_unloaded name=%s", name)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids of a conversation, ending with the assistant's turn to speak."""
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Queue a request; `lora_name`: a registered adapter to run it with (None: the base model)."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a bad schema is refused here, not in a step
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora = self.loras.get(lora_name) if lora_name is not None else None
        request = Request(request_id, token_ids, params, arrival_time, cache_salt, lora)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.output_processor.add_request(request)
        return request

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its blocks; its last output, or None if it was unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return None
        self.scheduler.finish_requests([request], FinishReason.ABORT)
        return self.output_processor.abort(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        runner_output, failures = self._execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped, failed = self.output_processor.process(core_outputs)
        for request, stop in stopped:
            self.scheduler.finish_requests([request], FinishReason.STOP, stop)
        self.scheduler.finish_requests(failed, FinishReason.ABORT)
        for request, error in failures:
            self.scheduler.finish_requests([request], FinishReason.ABORT)
            outputs.append(self.output_processor.fail(request, error))
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[tuple[Request, str]]]:
        """Run the step; if it raises, run its requests one at a time (a step's KV writes are
        idempotent) so that only the requests that fail are dropped. When several requests all fail
        on their own, or steps keep failing, the error is the engine's."""
        try:
            out = self.runner.execute(scheduler_output)
            self._failed_steps = 0
            return out, []
        except Exception as batch_error:
            merged, failures = ModelRunnerOutput(), []
            for item in scheduler_output.scheduled:
                alone = SchedulerOutput(scheduled=[item], finished_request_ids=scheduler_output.finished_request_ids)
                try:
                    out = self.runner.execute(alone)
                except Exception as err:
                    log.exception("event=request_failed request=%s", item.request.request_id)
                    failures.append((item.request, f"the engine could not run this request: {err!r}"))
                    continue
                merged.update(out)
            self._failed_steps = self._failed_steps + 1 if len(failures) == len(scheduler_output.scheduled) else 0
            if self._failed_steps and (len(failures) > 1 or self._failed_steps >= MAX_FAILED_STEPS):
                raise batch_error
            return merged, failures

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
