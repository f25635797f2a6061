"""How a replica's memory divides: weights, the runtime reserve, the KV pool and the sequences it holds,
with the reason texts that quote those numbers."""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.planning import recurrent, sizing
from kvpilot.operator.planning.adapters import lora_settings, resident_bytes
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.latency import batched_tokens, step_seconds
from kvpilot.operator.planning.reasons import failed_plan, gib, ms
from kvpilot.operator.planning.replica import Inputs, Replica, Sizes, kv_bytes_per_value
from kvpilot.operator.planning.reserve import sparse_attention, vllm_reserve

# Beyond ~1k running sequences the scheduler's per-step bookkeeping, not the GPU, sets the pace
# (vLLM caps max_num_seqs at 256-1024 for the same reason).
MAX_NUM_SEQS_CAP = 1024
# How far above what vLLM allocates the predicted pool may be (the calibration's bound on public
# start-up logs, tests/operator/planning/test_vllm_memory.py).
MEASURED_POOL_MARGIN = 0.02


class Memory(NamedTuple):
    """How one replica's GPU memory divides: weights, reserve, and the KV pool's sequences."""

    replica: Replica
    sizes: Sizes
    budget: int
    batching_reason: str
    mean_context: int
    kv_reason: str


def _target_weights(inputs: Inputs, gpu: Device, quantization: str) -> int:
    """The target's weights as the runtime holds them on `gpu` at `quantization`: a checkpoint's own
    bytes where the runtime holds it as stored, at its own scheme, and they are known (less its MTP
    modules', which vLLM skips); else counted."""
    arch, runtime, stored = inputs.arch, inputs.capabilities, inputs.spec.model.quantization
    loaded = arch.loaded_checkpoint_bytes
    if runtime.holds_checkpoint_as_stored and loaded and quantization == stored:
        return loaded
    return sizing.weight_bytes(
        arch, quantization, runtime.quantized_lm_head, sizing.HeldAs(gpu.bytes_per_value, gpu.packs_weights)
    )


def replica_sizes(inputs: Inputs, group: tuple[Device, int], quantization: str, reserve: int) -> Sizes:
    """What one replica (its GPUs as one device, and how many) holds: the target's (and the draft's)
    weights and KV per token, and the KV pool left of its GPUs after `reserve`; a pool of 0 when the
    weights do not fit."""
    spec, arch, context, runtime, draft = inputs.spec, inputs.arch, inputs.context, inputs.capabilities, inputs.draft
    gpu, tp = group
    kv_bytes = kv_bytes_per_value(gpu, inputs.kv_cache_dtype)
    # The engine gives the draft a KV slot for every slot of the target's, so each slot holds both, in
    # the cache's dtype (vLLM's draft layers take the target's cache config).
    draft_weights = draft.weights if draft else 0
    draft_kv = sizing.kv_bytes_per_token(draft.arch, kv_bytes, tp) if draft else 0
    weights = sizing.held_by_group(arch, _target_weights(inputs, gpu, quantization), tp) + draft_weights
    lora = lora_settings(spec.adapters)
    # The runtime allocates the adapters' slots as it loads the weights: the pool is what both leave.
    adapters = resident_bytes(arch, lora, tp, gpu.bytes_per_value) if lora else 0
    pool = sizing.kv_pool_bytes(gpu.memory_bytes, spec.serving.gpu_memory_utilization, weights + adapters, reserve)
    layout, block, state_bytes = _kv_layout(inputs, group, kv_bytes, draft_kv)
    return Sizes(
        gpu=gpu.name,
        quantization=quantization,
        weight_bytes=weights,
        draft_weight_bytes=draft_weights,
        kv_bytes_per_token=sizing.kv_bytes_per_token(arch, kv_bytes, tp) + draft_kv,
        draft_kv_bytes_per_token=draft_kv,
        checkpoint_bytes=arch.checkpoint_bytes
        or sizing.weight_bytes(arch, spec.model.quantization or "none", runtime.quantized_lm_head),
        kv_pool_bytes=max(pool, 0),
        max_model_len=context,
        kv_cache_dtype=inputs.kv_cache_dtype,
        kv_layout=layout,
        adapter_bytes=adapters,
        block_size=block,
        state_bytes=state_bytes,
    )


def _kv_layout(
    inputs: Inputs, group: tuple[Device, int], kv_bytes: int, draft_kv: int
) -> tuple[sizing.KVLayout, int, int]:
    """How vLLM lays out the KV cache of a replica's GPUs, in blocks of how many tokens, and a hybrid's
    state of one layer and sequence on one GPU (0 for other models): a hybrid's attention block is
    raised until its page holds a state (planning/recurrent.py), which the pod is rendered with."""
    arch, block = inputs.arch, inputs.spec.serving.block_size
    state = recurrent.architecture_state(arch)
    if state is None:
        draft = inputs.draft.arch if inputs.draft is not None else None
        every_token = sizing.every_token_held(arch, inputs.spec.serving.speculative, draft)
        return (
            sizing.kv_layout(arch, kv_bytes, group[1], draft_kv, every_token, draft),
            sizing.kernel_block(arch, block),
            0,
        )
    # The one drafter planned beside state layers is the model's MTP modules (choices.state_speculation).
    mtp = inputs.draft.arch.layers if inputs.draft is not None else 0
    serving = recurrent.Serving(group[0].name, group[1], block, kv_bytes, inputs.speculative_tokens, mtp)
    hybrid = recurrent.hybrid_kv(state, serving)
    return hybrid.layout, hybrid.block_size, hybrid.state_bytes


def in_flight(budget: int) -> int:
    """The tokens a sliding-window layer keeps beyond its window at a step `budget`: bounded by the
    largest budget the plan may raise it to (one decode token for each of max_num_seqs)."""
    return sizing.tokens_in_flight(max(budget, MAX_NUM_SEQS_CAP))


def kv_rule(arch: Architecture, sizes: Sizes, held: int, tp: int, speculative_tokens: int = 0) -> str:
    """What a token or a sequence keeps beyond full attention over K and V heads, with a hybrid's
    state pages for `speculative_tokens` draft tokens, for the reason text ('' when nothing)."""
    layout = sizes.kv_layout
    if arch.state is not None:
        return (
            f" in {arch.state.attention_layers} attention layers; and in each of {arch.state.layers} {arch.state.kind} "
            f"layers a state per sequence of {sizes.state_bytes:,} bytes per GPU, which vLLM 0.33 holds in "
            f"{sizes.block_size}-token blocks raised until an attention page ({sizes.block_size} x one token's K and V "
            f"in one layer) holds it ({layout.full_groups} attention and {layout.state_groups} state layer groups; "
            f"{layout.state_blocks} state pages per sequence and group under prefix caching"
            + (
                f", {speculative_tokens} of them, and as many rows of its convolution window, for the draft "
                "tokens a step verifies)"
                if speculative_tokens
                else ")"
            )
        )
    if arch.indexer is not None:
        latent = (
            f"a {sizing.FP8_DS_MLA_BYTES}-byte" if sizes.kv_cache_dtype == "fp8" else f"one {arch.latent_dim}-value"
        )
        return (
            f" ({latent} latent per token and layer, and a {arch.indexer.key_bytes}-byte key in the "
            f"sparse-attention indexer of {arch.indexer.layers} of them, whole on each of the {tp} GPUs, in the "
            f"{sizes.block_size}-token blocks vLLM 0.33's sparse kernels take)"
        )
    if arch.latent_dim is not None:
        return f" (one {arch.latent_dim}-value latent per token and layer, whole on each of the {tp} GPUs)"
    if arch.chunked and layout.window is None:
        return (
            f" (every token in all {arch.layers} layers, the {arch.windowed_layers} chunked local attention ones "
            "too: vLLM 0.33 turns its hybrid KV cache manager off for chunked local attention beside an EAGLE "
            "head and allocates them as full attention)"
        )
    if layout.window is None:
        return ""
    if layout.chunked:
        return (
            f" ({layout.sliding_groups} chunked local attention and {layout.full_groups} full-attention layer "
            f"groups: the chunked ones keep at most the current {layout.window}-token chunk + {held} tokens "
            f"in flight{_drafted(layout)})"
        )
    return (
        f" ({layout.sliding_groups} sliding-window and {layout.full_groups} full-attention layer groups: "
        f"the sliding ones keep at most the {layout.window}-token window + {held} tokens in flight"
        f"{_shaped(arch, layout)}{_drafted(layout)})"
    )


def _shaped(arch: Architecture, layout: sizing.KVLayout) -> str:
    """Gemma 4's full-attention layers of their own K/V heads and its layers that keep no K and V, for
    kv_rule's text ('' when neither)."""
    text = ""
    if arch.full_attention is not None:
        heads, head = arch.full_kv_shape
        text += f"; the full-attention ones {heads} KV heads of {head} values"
        if layout.block_factor > 1:
            text += f", {layout.block_factor}x the block size's tokens a block"
        if layout.sliding_block_factor > 1:
            text += f"; the sliding ones {layout.sliding_block_factor}x the block size's tokens a block"
    if arch.shared_kv is not None:
        shared = arch.shared_kv.full_layers + arch.shared_kv.sliding_layers
        text += f"; {shared} layers read earlier layers' K and V and keep none"
    return text


def _drafted(layout: sizing.KVLayout) -> str:
    """The draft's groups of their own beside local layers, for kv_rule's text ('' when none)."""
    if not layout.draft_groups:
        return ""
    groups = sum(g.groups for g in layout.draft_groups)
    widest = max(layout.block_factor, layout.sliding_block_factor)
    held = f" (the target's blocks hold up to {widest}x the block size's tokens)" if widest > 1 else ""
    return f"; the draft model's layers in {groups} group(s) of their own, every page raised to the widest{held}"


def tp_group(gpu: Device, tp: int) -> Device:
    """TP GPUs of one type as one device: TP times the memory, bandwidth and throughput."""
    if tp == 1 or gpu.is_cpu:
        return gpu
    return gpu.model_copy(
        update={
            "usable_memory_mib": gpu.usable_memory_mib * tp,
            "bandwidth_gbps": gpu.bandwidth_gbps * tp,
            "fp16_tflops": gpu.fp16_tflops * tp,
            "int8_tops": gpu.int8_tops * tp,
        }
    )


def mean_sequence_tokens(spec: InferenceServiceSpec, context: int) -> int:
    """Prompt + half the output: what a sequence holds on average over its life."""
    return min(context, math.ceil(spec.load.mean_prompt_tokens + spec.load.mean_output_tokens / 2))


def _reserve(inputs: Inputs, group: tuple[Device, int], quantization: str, budget: int) -> tuple[int, str]:
    """The reserve of a replica's GPUs together, and (for a runtime that measures its own pool) what
    it is made of on each GPU."""
    arch, tp = inputs.arch, group[1]
    sparse = partial(sparse_attention, arch, tp=tp, max_model_len=inputs.context, fp8=inputs.kv_cache_dtype == "fp8")
    if not inputs.capabilities.measures_kv_pool:
        return sizing.runtime_reserve_bytes(arch, budget) * tp, ""
    # vLLM's sampler is profiled at max_num_seqs rows, and max_num_seqs follows from the pool: bound
    # it by the larger pool the rest of the reserve leaves, so the reserve is never under vLLM's.
    unsampled = replica_sizes(inputs, group, quantization, vllm_reserve(arch, budget, 0, tp, sparse(budget)).total * tp)
    lookahead = inputs.spec.serving.num_speculative_tokens if inputs.draft else 0
    fitting = sizing.sequences_that_fit(
        unsampled.kv_pool_bytes,
        unsampled.kv_layout,
        mean_sequence_tokens(inputs.spec, inputs.context) + lookahead,
        unsampled.block_size,
        in_flight(budget),
    )
    seqs = min(fitting, MAX_NUM_SEQS_CAP)
    per_gpu = vllm_reserve(arch, max(budget, seqs), seqs, tp, sparse(max(budget, seqs)))
    return per_gpu.total * tp, f" ({per_gpu.describe()} per GPU, as vLLM profiles it)"


def divide_memory(inputs: Inputs, device: tuple[Device, int], quantization: str) -> Memory | Plan:
    """How the memory of a replica's GPUs (a GPU type and the tensor-parallel size) divides at one
    quantization, with the inputs' draft model or none: a failed Plan when the weights or one full
    sequence do not fit."""
    # One piece: the numbers and the reasons that quote them (a dozen of them) are made side by side.
    spec, arch, context, runtime, draft = inputs.spec, inputs.arch, inputs.context, inputs.capabilities, inputs.draft
    serving = spec.serving
    tp = device[1]
    gpu = tp_group(*device)
    budget, batching_reason = batched_tokens(spec, arch, gpu, quantization)
    reserve, reserve_parts = _reserve(inputs, (gpu, tp), quantization, budget)
    sizes = replica_sizes(inputs, (gpu, tp), quantization, reserve)
    target_weights, draft_weights = sizes.weight_bytes - sizes.draft_weight_bytes, sizes.draft_weight_bytes
    kv_per_token, draft_kv = sizes.kv_bytes_per_token, sizes.draft_kv_bytes_per_token
    target_kv, pool = kv_per_token - draft_kv, sizes.kv_pool_bytes
    lookahead = serving.num_speculative_tokens if draft else 0
    usable = int(gpu.memory_bytes * serving.gpu_memory_utilization)
    where = (
        f"{serving.gpu_memory_utilization:.0%} of the {gib(gpu.memory_bytes)} GiB "
        + (f"{tp} x {gpu.name} report" if tp > 1 else f"{gpu.name} reports")
        + f" ({gib(usable)} GiB)"
    )
    adapters = f" + LoRA slots {gib(sizes.adapter_bytes)} GiB" if sizes.adapter_bytes else ""
    weighed = (
        f"{quantization} weights {gib(target_weights)} GiB"
        + (f" + draft model weights {gib(draft_weights)} GiB" if draft else "")
        + adapters
    )
    if pool <= 0:
        # The draft's lookahead slots (the positions it writes ahead of each sequence) count below.
        return failed_plan(
            spec,
            "WeightsDoNotFit",
            f"{spec.model.name} {weighed} + runtime reserve {gib(reserve)} GiB exceed {where}",
            sizes,
        )
    drafted = f" with its draft's KV and {lookahead} lookahead slots" if draft else ""
    layout, held, block = sizes.kv_layout, in_flight(budget), sizes.block_size
    per_sequence = sizing.sequence_bytes(layout, context + lookahead, block, held)
    fitting = sizing.sequences_that_fit(pool, layout, context + lookahead, block, held)
    # A runtime that measures its pool refuses to start when one full sequence does not fit in what
    # it finds: the prediction must fit it with the margin it may be over (test_vllm_memory.py).
    margin = MEASURED_POOL_MARGIN if runtime.measures_kv_pool else 0.0
    if per_sequence > pool * (1 - margin):
        return failed_plan(
            spec,
            "ContextDoesNotFit",
            f"one {context}-token sequence{drafted} needs {gib(per_sequence)} GiB of KV cache "
            f"but only {gib(pool)} GiB is left of {where} after {weighed}"
            + (f", less the {margin:.0%} by which the runtime may find less than predicted" if margin else ""),
            sizes,
        )
    # Sized for the mean context (prompt + half the output: what a sequence holds on average over its
    # life), as vLLM sizes its batch: the few sequences that grow long are preempted and recomputed.
    mean_context = mean_sequence_tokens(spec, context)
    fitting_mean = sizing.sequences_that_fit(pool, layout, mean_context + lookahead, block, held)
    max_num_seqs = min(fitting_mean, MAX_NUM_SEQS_CAP)
    kv = (
        f"{kv_per_token / sizing.MiB:.3g} MiB/token"
        + (f" ({target_kv / sizing.MiB:.3g} target + {draft_kv / sizing.MiB:.3g} draft)" if draft else "")
        + (" in FP8 (one byte per value)" if inputs.kv_cache_dtype == "fp8" else "")
    )
    kv_reason = (
        f"{fitting_mean} sequences at the mean context of {mean_context} tokens (prompt + half "
        f"the output) fit, {fitting} at the full {context}{drafted}; preemption covers sequences "
        f"that grow long: KV {kv}{kv_rule(arch, sizes, held, tp, inputs.speculative_tokens)}, "
        f"{gib(per_sequence)} GiB per full sequence, pool {gib(pool)} "
        f"GiB = {where} - weights {gib(target_weights)} GiB"
        + (f" - draft model weights {gib(draft_weights)} GiB" if draft else "")
        + adapters.replace("+", "-")
        + f" - reserve {gib(reserve)} GiB{reserve_parts}"
        + (f"; capped at {MAX_NUM_SEQS_CAP}" if fitting_mean > MAX_NUM_SEQS_CAP else "")
    )
    # A CPU's packed low-bit kernels read the stored weights (a tied head's packed copy in place of
    # the embedding's rows); a GPU may dequantize them first.
    decode_bytes = (
        sizing.weight_bytes(arch, quantization, runtime.quantized_lm_head, sizing.HeldAs(gpu.bytes_per_value))
        if gpu.is_cpu
        else sizing.decode_weight_bytes(arch, quantization, runtime)
    )
    # A decode step also reads the resident adapters' low-rank weights (planning/adapters.py).
    decode_bytes += sizes.adapter_bytes
    state = recurrent.architecture_state(arch)
    replica = Replica(
        arch,
        gpu,
        tp,
        decode_bytes,
        target_kv,
        quantization,
        max_num_seqs,
        draft,
        correction=inputs.correction,
        state_per_sequence=recurrent.sequence_state_bytes(state, tp) if state else 0,
    )
    if gpu.is_cpu:
        replica, sizes, kv_reason = _cpu_batch(spec, replica, sizes, (mean_context, context, lookahead), kv_reason)
    if budget < replica.max_num_seqs:
        # Every running sequence decodes one token per step, so the budget must cover them all.
        budget = replica.max_num_seqs
        batching_reason = f"{budget} tokens per step: one decode token for each of max_num_seqs"
    return Memory(replica, sizes, budget, batching_reason, mean_context, kv_reason)


def _cpu_batch(
    spec: InferenceServiceSpec, replica: Replica, sizes: Sizes, contexts: tuple[int, int, int], kv_reason: str
) -> tuple[Replica, Sizes, str]:
    """A CPU replica runs at most the batch whose decode step still meets the TPOT SLO (a larger
    one slows every running sequence past it; the rest wait their turn), and requests memory for the
    KV of that batch, not all of its node's: it holds that many sequences at the mean context, and
    one at the full context."""
    mean_context, context, lookahead = contexts
    slo_s = spec.slo.tpot_p95_ms / 1000
    cap = 1
    while cap < replica.max_num_seqs and step_seconds(replica, cap + 1, mean_context) <= slo_s:
        cap += 1
    block, kv_per_token = spec.serving.block_size, sizes.kv_bytes_per_token
    blocks = max(
        cap * sizing.blocks_per_sequence(mean_context + lookahead, block),
        sizing.blocks_per_sequence(context + lookahead, block),
    )
    pool = blocks * block * kv_per_token
    step = step_seconds(replica, cap, mean_context)
    reason = (
        f"{kv_reason}; on a CPU the batch is capped at {cap}, the most whose decode step "
        f"({ms(step)} ms) stays within the {spec.slo.tpot_p95_ms:g} ms TPOT SLO"
        f"{' (even one sequence misses it)' if step > slo_s else ''}, and the KV pool holds "
        f"{cap} mean and one full sequence: {pool / sizing.MiB:.0f} MiB"
    )
    return replica._replace(max_num_seqs=cap), sizes._replace(kv_pool_bytes=pool), reason


def with_plain_weights(spec: InferenceServiceSpec, memory: Memory) -> tuple[Sizes | None, int]:
    """A replica's sizes with compiled decoding, and the bytes of plain weights it adds: an engine that
    packs its weights for oneDNN keeps the plain ones for the compiled graph (sizing.weight_bytes).
    None where they do not fit in the node's memory beside the KV pool."""
    replica, sizes = memory.replica, memory.sizes
    gpu = replica.gpu
    if not gpu.packs_weights:
        return sizes, 0
    arch, quantization, bpv = replica.arch, sizes.quantization, gpu.bytes_per_value
    plain = sizing.weight_bytes(arch, quantization, held=sizing.HeldAs(bpv, True, True)) - sizing.weight_bytes(
        arch, quantization, held=sizing.HeldAs(bpv, True)
    )
    weights = sizes.weight_bytes + plain
    left = sizing.kv_pool_bytes(
        gpu.memory_bytes,
        spec.serving.gpu_memory_utilization,
        weights + sizes.adapter_bytes,
        sizing.runtime_reserve_bytes(arch, memory.budget),
    )
    if left < sizes.kv_pool_bytes:
        return None, plain
    return sizes._replace(weight_bytes=weights), plain
