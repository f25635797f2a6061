"""Owns the model weights and the KV cache tensor; turns a scheduled step into one forward pass."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.cpu.compile_cache import resolve_root
from kvpilot.engine.cpu.compiled_decode import CompiledDecode, KernelState, compile_decode
from kvpilot.engine.cpu.features import choose_kernel_path, read_cpu_flags
from kvpilot.engine.cpu.threads import cpu_threads
from kvpilot.engine.lora.adapter import LoRAAdapter
from kvpilot.engine.lora.layers import LoRABatch, wrap
from kvpilot.engine.lora.registry import Resident
from kvpilot.engine.model.attention import AttentionMetadata, PrefillChunk, allocate_kv_caches
from kvpilot.engine.model.layers import Linear, pack_for_onednn
from kvpilot.engine.model.llama import LlamaForCausalLM, kv_shape
from kvpilot.engine.model.loader import cache_root, load_config, load_model
from kvpilot.engine.model.quantization import cpu_int4_layout
from kvpilot.engine.outputs import ModelRunnerOutput, TokenLogprobs
from kvpilot.engine.worker.grammar import GrammarMatchers, Grammars
from kvpilot.engine.worker.sampler import Sampler, token_logprobs
from kvpilot.engine.worker.sampling_inputs import sampling_metadata, worst_case_sampling
from kvpilot.engine.worker.spec_decode import DraftInput
from kvpilot.engine.worker.spec_decode.proposer import load_draft, make_proposer
from kvpilot.engine.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

# Without a device to profile, the pool is sized like vLLM's CPU backend: a fixed budget.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def kv_budget_after_profile(total_bytes: int, utilization: float, peak_bytes: int) -> int:
    """The KV pool gets what the utilization target leaves after the profiled peak (weights + activations)."""
    budget = int(total_bytes * utilization) - peak_bytes
    if budget <= 0:
        raise ValueError(
            f"weights and activations peak at {peak_bytes} bytes, leaving no KV cache within "
            f"gpu_memory_utilization={utilization} of {total_bytes} bytes"
        )
    return budget


class _Batch(NamedTuple):
    """One step's forward inputs, and which of their rows sample and score."""

    inputs: StepInputs
    sample_rows: list[int]  # rows whose logits sample: a request's last known token and each draft
    sampled: list[ScheduledRequest]  # requests that sample, with the drafts they verify
    scored: list[tuple[Request, int, int, int]]  # (request, first row, first position, tokens) to score
    adapters: list[tuple[LoRAAdapter, int, int]]  # (a request's LoRA adapter, its first row, its rows)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: PretrainedConfig | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        grammars: Grammars | None = None,
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids  # banned while a request is short of its min_tokens
        # Requests with a structured output sample under their grammar's mask (none without a tokenizer).
        self.matchers = GrammarMatchers(grammars) if grammars is not None else None
        self.device = config.torch_device()
        threads, why = cpu_threads()
        torch.set_num_threads(threads)
        self.cpu_kernels = choose_kernel_path(config.cpu_kernels)
        self.dtype = config.torch_dtype(self.device, self.cpu_kernels.bf16)
        self.block_size = config.block_size
        # The engine reads the model's config once and hands it over; read here when run alone.
        self.hf_config = hf_config if hf_config is not None else load_config(model_path)
        self.model, self.lora_batch = self._load_target(model_path)
        self.num_layers = self.hf_config.num_hidden_layers
        self.num_kv_heads, self.head_dim = kv_shape(self.model)
        self.draft_model, self.draft_layers = load_draft(config, self.model, self.hf_config, self.dtype, self.device)
        models = self._models()
        # A compiled graph reads plain weights: compile_decode keeps them beside the packed ones.
        self.onednn_layers = (
            sum(pack_for_onednn(m, keep_plain=config.compile_decode) for m in models) if self._packs_weights() else 0
        )
        # What the weights take in memory as served (quantized layers in their low-bit form).
        self.weight_bytes = sum(t.numel() * t.element_size() for m in models for t in (*m.parameters(), *m.buffers()))
        self.num_blocks = self._num_kv_blocks()
        self.proposer = make_proposer(
            config, self.draft_model, self.draft_layers, self.num_blocks * self.block_size, self.dtype, self.device
        )
        self._log_config(threads, why)
        # Unseeded sampling draws from one generator seeded by the engine's seed; seeded requests
        # get their own, kept until they finish (a preempted request continues its stream).
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self._generators: dict[str, torch.Generator] = {}
        self.kv_caches = allocate_kv_caches(
            self.num_layers,
            self.num_blocks * self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )
        # Whether single-query decodes attend through cpu_kernels' attention kernel, which weight-only
        # schemes multiply through its matmuls (use_cpu_kernels); the compiled step (calls them).
        self.decode_kernel, self.matmul_kernels, self._cpu_kernels_loaded = False, frozenset[str](), False
        cache_root = resolve_root(config.compile_cache_dir)
        self._load_cpu_kernels(cache_root)
        self.compiled_decode: CompiledDecode | None = (
            compile_decode(
                self.model, self.hf_config, self.kv_caches, self.block_size, self._kernel_state(), cache_root
            )
            if config.compile_decode
            else None
        )

    def _load_target(self, model_path: Path) -> tuple[LlamaForCausalLM, LoRABatch | None]:
        """The served model and, with LoRA, what its target projections read each step's adapters
        from: they add the deltas of up to max_loras adapters resident on the device
        (kvpilot.engine.lora). Without LoRA the model stays exactly the one that serves the base
        model alone."""
        config = self.config
        model = load_model(
            model_path,
            self.hf_config,
            self.dtype,
            self.device,
            config.quantization,
            config.quantization_group_size,
            self.cpu_kernels.integer_kernels,
        )
        self.resident = Resident(config.max_loras, self.device)
        if not config.enable_lora:
            return model, None
        batch = LoRABatch()
        wrap(model, batch)
        return model, batch

    def _models(self) -> list[torch.nn.Module]:
        """The target model and the draft, once each (a draft may be the target itself)."""
        return list({id(m): m for m in (self.model, self.draft_model) if m is not None}.values())

    def _packs_weights(self) -> bool:
        """Whether full-precision linear weights are served from oneDNN's layout (cpu/onednn_linear.py):
        where the CPU favours it for this dtype."""
        return onednn_linear.serves(self.device, self.dtype, self.cpu_kernels.onednn_dtypes)

    def _log_config(self, threads: int, threads_from: str) -> None:
        """The start-up line that says what runs: device, CPU kernel path, dtype, scheme, sizes."""
        log.info(
            "event=engine_config device=%s cpu_kernels=%s cpu_kernels_from=%r onednn_layers=%d dtype=%s "
            "quantization=%s speculative=%s draft_layers=%d weight_bytes=%d torch_threads=%d threads_from=%r "
            "kv_blocks=%d compile_decode=%s",
            self.device,
            self.cpu_kernels.name,
            self.cpu_kernels.reason,
            self.onednn_layers,
            str(self.dtype).removeprefix("torch."),
            self.model.quantization,
            self.config.speculative,
            self.draft_layers,
            self.weight_bytes,
            threads,
            threads_from,
            self.num_blocks,
            self.config.compile_decode,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, and of the draft model's layers when it keeps a cache beside."""
        per_token = self.num_layers * self.num_kv_heads * self.head_dim
        if self.draft_model is not None:
            heads, dim = kv_shape(self.draft_model)
            per_token += self.draft_layers * heads * dim
        return 2 * per_token * self.dtype.itemsize

    def _load_cpu_kernels(self, root: Path | None) -> None:
        """Serve with cpu_kernels' C++ library on every CPU engine: from the compile cache root
        (`compile_cache_dir`), else from an image's prebuilt ones ($KVPILOT_CACHE/kernels), or
        built into the root at the first start (~40 s on 2 cores) with the compiler torch.compile
        uses. A build that fails, or a CPU without a compiler or a cached library, leaves PyTorch's
        kernels and the portable attention, with a warning: the engine serves either way."""
        if self.device.type != "cpu":
            return
        flags = read_cpu_flags()
        try:
            cpu_kernels.load(root, flags, cache_root() / cpu_kernels.KERNELS)
        except (RuntimeError, OSError) as err:  # the build or its loading failed: the portable path serves
            log.warning("event=cpu_kernels_unavailable error=%r", err)
            return
        self._cpu_kernels_loaded = True
        self.use_cpu_kernels(True, cpu_kernels.matmul_schemes(flags))
        log.info(
            "event=cpu_kernels_used attention=single_query_decodes matmuls=%s int4_activations=%s",
            ",".join(sorted(self.matmul_kernels)),
            cpu_kernels.int4_activations(flags, cpu_int4_layout().rows),
        )

    def use_cpu_kernels(self, on: bool, schemes: frozenset[str] | None = None) -> None:
        """Whether single-query decodes attend through cpu_kernels' attention and the weight-only
        matmuls of `schemes` (default: the ones in use) run its kernels; never before the library
        loaded (profiling/measure.py times a step with and without them)."""
        on = on and self._cpu_kernels_loaded
        self.decode_kernel = on
        self.matmul_kernels = self.matmul_kernels if schemes is None else schemes
        for model in self._models():
            for layer in model.modules():
                if isinstance(layer, Linear) and layer.quantization is not None:
                    layer.quantization.cpu_kernel = on and layer.quantization.name in self.matmul_kernels

    def _kernel_state(self) -> KernelState:
        """What a traced graph bakes in of the C++ kernels: the attention kernel, the matmul schemes."""
        return self.decode_kernel, self.matmul_kernels

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The compiled forward for the steps it was traced for, the eager one otherwise."""
        compiled = self.compiled_decode
        if compiled is not None and compiled.traced_for(meta, self._kernel_state()):
            return compiled.forward(input_ids, positions, self.kv_caches, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        budget = budget or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // (self.kv_bytes_per_token * self.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {self.block_size} tokens "
                f"({self.kv_bytes_per_token} bytes per token)"
            )
        return int(num_blocks)

    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once, then give the KV pool what the utilization target leaves."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_profile_step()
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = kv_budget_after_profile(total, self.config.gpu_memory_utilization, peak)
        log.info("gpu memory: total=%d peak=%d kv_budget=%d", total, peak, budget)
        return budget

    @torch.inference_mode()
    def run_profile_step(self) -> None:
        """The largest step the engine can run, on dummy inputs, with everything a real step holds
        at once: the target's forward over max_num_batched_tokens tokens, the logits of every row
        that samples and the sampler's [rows, vocab] buffers under every filter at once (sorting,
        top-p's cumulative sums, logprobs, draft verification, the exponential race), then, with
        the target's hidden states still held as they are while drafting, the draft model's
        forward over a catch-up of max_num_batched_tokens tokens."""
        config = self.config
        n = config.max_num_batched_tokens
        hidden = self._dummy_forward(self.model, self.num_layers, n)
        # Every sequence samples a row, and a speculating one a row per draft too.
        rows_per_sequence = 1 + (config.num_speculative_tokens if config.speculative != "off" else 0)
        rows = min(config.max_num_seqs * rows_per_sequence, n)
        logits = self.model.logits(hidden[-rows:])
        # A sampler of its own: the engine's is not made yet, and profiling must not draw from its generator.
        Sampler(torch.Generator(self.device))(
            logits, worst_case_sampling(rows, config.speculative != "off", self.device)
        )
        del logits
        if self.draft_model is not None:
            draft_hidden = self._dummy_forward(self.draft_model, self.draft_layers, n)
            self.draft_model.logits(draft_hidden[-config.max_num_seqs :])

    def _dummy_forward(self, model: LlamaForCausalLM, num_layers: int, n: int) -> torch.Tensor:
        """A prefill of n tokens into a one-block cache (every token writes slot 0)."""
        heads, head_dim = kv_shape(model)
        cache = allocate_kv_caches(num_layers, self.block_size, heads, head_dim, self.dtype, self.device)
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=zeros, decodes=[], prefills=[PrefillChunk(start=0, num_tokens=n, num_cached=0, slots=zeros)]
        )
        return model(zeros, torch.arange(n, device=self.device), cache, meta)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: sample for each request that reached its last known token (verifying its
        draft tokens, if it has some), score the prompt tokens of requests that asked for prompt
        logprobs, and propose drafts for the next step. A step that raises leaves the seeded
        requests' generators as they were: the engine reruns it request by request, and a seeded
        request must draw the same tokens as if the step had not failed."""
        scheduled = {s.request.request_id for s in scheduler_output.scheduled}
        states = {rid: g.get_state() for rid, g in self._generators.items() if rid in scheduled}
        try:
            return self._run_step(scheduler_output)
        except Exception:
            # Generators the failed attempt created go; the others go back to where they stood.
            for rid in scheduled - states.keys():
                self._generators.pop(rid, None)
            for rid, state in states.items():
                self._generators[rid].set_state(state)
            raise

    @torch.inference_mode()
    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(scheduler_output)
        batch = self._batch(scheduler_output)
        if self.lora_batch is not None:
            self.lora_batch.groups = self._lora_groups(batch)
        try:
            hidden = self._forward(*batch.inputs.build())
        finally:
            if self.lora_batch is not None:
                self.lora_batch.groups = []
        out = ModelRunnerOutput(
            prompt_logprobs={
                r.request_id: self._prompt_logprobs(hidden, r, row, pos, n) for r, row, pos, n in batch.scored
            }
        )
        if not batch.sampled:
            return out
        speculate = (
            self.proposer is not None and len(scheduler_output.scheduled) <= self.config.speculative_max_batch_size
        )
        to_draft = self._sample(hidden, batch, out, speculate)
        if speculate:
            out.spec_token_ids = self.proposer.propose(to_draft)
        return out

    def _forget(self, scheduler_output: SchedulerOutput) -> None:
        """Drop what finished requests kept; a preempted request is recomputed from scratch, and so
        is its draft's KV."""
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        if self.matchers is not None:
            self.matchers.forget(scheduler_output.finished_request_ids)
        if self.proposer is not None:
            self.proposer.forget(
                [*scheduler_output.finished_request_ids, *(r.request_id for r in scheduler_output.preempted)]
            )

    def _batch(self, scheduler_output: SchedulerOutput) -> _Batch:
        """The step's tokens in one flattened batch, with the rows that sample and score."""
        # Decodes first, by query count (1 + drafts) and context length, so that each decode group
        # has one query count and pads to similar lengths.
        order = sorted(
            scheduler_output.scheduled, key=lambda s: (not _is_decode(s), s.num_tokens, s.request.num_computed_tokens)
        )
        batch = _Batch(StepInputs(self.block_size, self.device, self.decode_kernel), [], [], [], [])
        for item in order:
            request, n = item.request, item.num_tokens
            start = request.num_computed_tokens
            drafts = item.spec_token_ids
            row = batch.inputs.add(
                request.token_ids[start : start + n - len(drafts)] + drafts, start, item.block_ids, _is_decode(item)
            )
            if request.lora is not None:
                batch.adapters.append((request.lora, row, n))
            if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                batch.scored.append((request, row, start, n))
            if start + n == request.num_tokens + len(drafts):
                # The last known token's row samples the next token; each draft's row, the one after it.
                batch.sample_rows.extend(range(row + n - 1 - len(drafts), row + n))
                batch.sampled.append(item)
        return batch

    def _lora_groups(self, batch: _Batch) -> list[tuple[LoRAAdapter, torch.Tensor]]:
        """Each adapter of the step, resident on the device, with the rows of its requests."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, row, n in batch.adapters:
            rows.setdefault(adapter.lora_id, (adapter, []))[1].extend(range(row, row + n))
        resident = self.resident.activate([adapter for adapter, _ in rows.values()])
        return [
            (adapter, torch.tensor(ids, dtype=torch.long, device=self.device))
            for adapter, (_, ids) in zip(resident, rows.values())
        ]

    def _sample(self, hidden: torch.Tensor, batch: _Batch, out: ModelRunnerOutput, speculate: bool) -> list[DraftInput]:
        """Sample every sampling row (verifying drafts), record each request's new tokens in `out`,
        and return what the proposer drafts from next."""
        device = self.device
        logits = self.model.logits(hidden[torch.tensor(batch.sample_rows, dtype=torch.long, device=device)])
        rows = [item.request for item in batch.sampled for _ in range(len(item.spec_token_ids) + 1)]
        draft_rows = [token for item in batch.sampled for token in (*item.spec_token_ids, -1)]
        meta = sampling_metadata(rows, self._generators, self.eos_token_ids, self.matchers, device)
        if len(draft_rows) > len(batch.sampled):
            meta.draft_token_ids = torch.tensor(draft_rows, dtype=torch.long, device=device)
        result = self.sampler(logits, meta)
        tokens = result.tokens.tolist()
        accepted = result.accepted.tolist() if result.accepted is not None else None
        row = 0
        to_draft: list[DraftInput] = []
        for item in batch.sampled:
            request, drafts = item.request, item.spec_token_ids
            # Drafts up to the first rejection, then the token sampled at that row (the resampled
            # token, or after all drafts the bonus token).
            num_accepted = 0
            while num_accepted < len(drafts) and accepted[row + num_accepted]:
                num_accepted += 1
            new_tokens = [*drafts[:num_accepted], tokens[row + num_accepted]]
            out.sampled[request.request_id] = new_tokens
            if row in result.logprobs:
                logprob, top = result.logprobs[row]
                out.logprobs[request.request_id] = [TokenLogprobs(new_tokens[0], logprob, top)]
            params = request.params
            if (
                speculate
                and item.propose
                and params.speculable
                and request.num_output_tokens + len(new_tokens) >= params.min_tokens
            ):
                to_draft.append(DraftInput(request.request_id, request.token_ids + new_tokens, item.block_ids))
            row += len(drafts) + 1
        return to_draft

    def _prompt_logprobs(
        self, hidden: torch.Tensor, request: Request, row: int, position: int, num_tokens: int
    ) -> tuple[int, list[TokenLogprobs]]:
        """Scores of the prompt tokens that a chunk of `num_tokens` rows from `row` (positions from
        `position`) predicts: position p scores token p + 1, up to the prompt's last token."""
        count = min(position + num_tokens, request.num_prompt_tokens - 1) - position
        logprobs = torch.log_softmax(self.model.logits(hidden[row : row + count]), dim=-1)
        targets = torch.tensor(request.token_ids[position + 1 : position + 1 + count], device=self.device)
        k = request.params.prompt_logprobs or 0
        scores = token_logprobs(logprobs, targets, {i: k for i in range(count)})
        return position + 1, [TokenLogprobs(int(t), *scores[i]) for i, t in enumerate(targets.tolist())]


def _is_decode(item: ScheduledRequest) -> bool:
    """The request computes only its last token (and the drafts after it)."""
    return (
        item.num_tokens == 1 + len(item.spec_token_ids)
        and item.request.num_computed_tokens == item.request.num_tokens - 1
    )
