"""plan(spec, context) -> Plan: the search over devices, quantization schemes and tensor-parallel sizes.

Pure: the spec, the catalogs, the runtime's declared capabilities (operator/runtimes/) and a
PlanContext (the GPU products the cluster's nodes carry, CPU profiles, the service's correction) go
in, a Plan comes out. Only quantization schemes, speculative modes and tensor-parallel sizes the
runtime declares are ever chosen, so every plan renders into arguments the runtime accepts. Every
input that cannot be served is a Plan with fits=False, a `failure` code and a one-line reason
carrying the numbers; nothing here raises for bad input. The options are sized in memory.py, timed
in latency.py and given their speculation and quantization in choices.py; this module searches
them in the order of preference and says why the chosen one.

Tensor parallelism: a replica of TP GPUs is planned as one device with TP times the memory,
bandwidth and throughput of one (the weights and the KV heads split evenly, which the head counts
dividing by TP guarantees), TP times the runtime reserve (each GPU has its own), and two all-reduces
of the step's hidden states per layer over the GPUs' link added to every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.engine.contract.device_profile import DeviceProfile
from kvpilot.operator.api.plan import LoraPlan, Plan
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.planning import cpus, sizing
from kvpilot.operator.planning.adapters import adapter_problem, describe, lora_settings
from kvpilot.operator.planning.choices import (
    Speculation,
    choose_speculation,
    draft_model,
    kv_cache_dtype_reason,
    kv_cache_dtypes,
    quantization_schemes,
    state_speculation,
    unloaded_class,
    unsupported_pins,
    with_adapters,
)
from kvpilot.operator.planning.context import NO_CORRECTION, PlanContext
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.latency import Perf, capacity_rps, computed_prompt_tokens, draft_acceptance, predict
from kvpilot.operator.planning.memory import Memory, divide_memory, replica_sizes, tp_group
from kvpilot.operator.planning.models import MODELS, find_model
from kvpilot.operator.planning.placement import (
    devices_to_try,
    heads_problem,
    most_per_node,
    tensor_parallel_sizes,
    tp_reason,
)
from kvpilot.operator.planning.reasons import failed_plan, gib, ms, rejected_because
from kvpilot.operator.planning.replica import DRAFT_MODEL_MODES, DRAFTED, Inputs
from kvpilot.operator.planning.startup import startup_fields
from kvpilot.operator.runtimes import RUNTIMES


class Option(NamedTuple):
    """One (GPU type, tensor-parallel size, quantization, KV dtype) tried: its plan, and for one that
    fits the speculation it runs (which the chosen option's capacity is measured with)."""

    plan: Plan
    speculation: Speculation | None = None


def _size(inputs: Inputs, device: tuple[Device, int], quantization: str) -> Option:
    """The option of one (GPU type, tensor-parallel size, quantization). The runtime splits a draft
    over the target's GPUs, so a draft whose heads the size does not divide is left out (or, pinned,
    makes the option fail)."""
    spec, gpu, tp = inputs.spec, *device
    draft = inputs.draft.on(gpu, tp, inputs.kv_cache_dtype) if inputs.draft is not None else None
    problem = heads_problem(draft.arch, tp) if draft is not None else None
    if problem is not None:
        if spec.serving.speculative in DRAFTED:
            failed = failed_plan(
                spec,
                "NoTensorParallelSize",
                f"serving.draftModel {draft.source}: {problem}, and the runtime splits the draft over the "  # type: ignore[union-attr]
                "target's GPUs",
            )
            return Option(failed.model_copy(update={"gpu": gpu.name, "quantization": quantization, "gpu_count": tp}))
        draft = None
    fp8 = [
        what
        for what, value in (("quantization fp8", quantization), ("an FP8 KV cache", inputs.kv_cache_dtype))
        if value == "fp8"
    ]
    if fp8 and not gpu.fp8:
        failed = failed_plan(
            spec,
            "UnsupportedOnGPU",
            f"{gpu.name} has no FP8 tensor cores, which {' and '.join(fp8)} run on (GPUs with them: "
            f"{', '.join(g.name for g in GPUS.values() if g.fp8)})",
            replica_sizes(inputs._replace(draft=None), (tp_group(gpu, tp), tp), quantization, 0),
        )
        return Option(failed)
    # Sized with the draft when the spec pins a drafted mode; auto adds it only where speculation pays.
    pinned = draft if spec.serving.speculative in DRAFTED else None
    pinned_mode = spec.serving.speculative not in ("auto", "off")
    memory = divide_memory(inputs._replace(draft=pinned, speculating=pinned_mode), device, quantization)
    if isinstance(memory, Plan):
        return Option(memory.model_copy(update={"gpu_count": tp}))
    speculation = choose_speculation(inputs._replace(draft=draft), memory, device)
    return Option(_fitting_plan(spec, speculation), speculation)


def _replicas_reason(spec: InferenceServiceSpec, chosen: Speculation) -> tuple[str, Perf]:
    """Why this many replicas, and the latencies the plan predicts at them: the model's own, so
    that observed / predicted keeps measuring the model even where the replicas were chosen with
    the observed corrections (a corrected prediction would chase its own correction)."""
    perf, replicas, replica = chosen.perf, chosen.replicas, chosen.memory.replica
    rate = spec.load.requests_per_second
    if chosen.miss is None:
        reason = (
            f"{replicas} replica(s) for {rate:g} req/s: {perf.batch:.1f} running "
            f"sequences each ({replica.max_num_seqs} fit), TTFT {ms(perf.ttft_s)} ms <= "
            f"{spec.slo.ttft_p95_ms:g} ms, TPOT {ms(perf.tpot_s)} ms <= "
            f"{spec.slo.tpot_p95_ms:g} ms"
        )
    else:
        reason = f"SLO not met at maxReplicas {replicas} for {rate:g} req/s: {chosen.miss}"
    if spec.load.prefix_share:
        reason += (
            f"; prefill computes {computed_prompt_tokens(spec.load):.0f} of {spec.load.mean_prompt_tokens} prompt "
            f"tokens (load.prefixShare {spec.load.prefix_share:g}: the rest from the prefix cache)"
        )
    correction = replica.correction
    if (correction.ttft, correction.tpot) == (1.0, 1.0):
        return reason, perf
    reason += (
        f"; latencies corrected by what the engines showed (observed / predicted p95): TTFT x"
        f"{correction.ttft:.2f}, TPOT x{correction.tpot:.2f} (status.correction)"
    )
    model = replica._replace(correction=correction._replace(ttft=1.0, tpot=1.0))
    return reason, predict(spec, model, replicas, chosen.mode)


def _fitting_plan(spec: InferenceServiceSpec, chosen: Speculation) -> Plan:
    """The Plan of a pair that fits, from its speculation, memory and replicas."""
    serving, memory, replicas = spec.serving, chosen.memory, chosen.replicas
    sizes, max_num_seqs = memory.sizes, memory.replica.max_num_seqs
    replicas_reason, perf = _replicas_reason(spec, chosen)
    latency = sizing.request_latency(perf.ttft_s, perf.tpot_s, spec.load.mean_output_tokens)
    finite = math.isfinite(perf.tpot_s)
    speculating = chosen.mode != "off"
    lora, lora_reason = _adapters(spec, memory)
    return Plan(
        fits=True,
        reason=(
            f"{spec.model.name} on {sizes.gpu} ({sizes.quantization}): {max_num_seqs} sequences of "
            f"{memory.mean_context} tokens on average (up to {sizes.max_model_len}) in a "
            f"{gib(sizes.kv_pool_bytes)} GiB KV pool; "
            + (
                f"predicted TTFT {ms(perf.ttft_s)} ms, TPOT {ms(perf.tpot_s)} ms at {replicas} replica(s)"
                if finite
                else replicas_reason
            )
        ),
        model=spec.model.name,
        runtime=spec.runtime,
        gpu_count=memory.replica.tp,
        speculative=chosen.mode,
        draft_model=serving.draft_model if chosen.mode in DRAFT_MODEL_MODES else None,
        eagle3_head=chosen.mode == "eagle"
        and memory.replica.draft is not None
        and memory.replica.draft.arch.eagle3_head,
        num_speculative_tokens=serving.num_speculative_tokens if speculating else None,
        compile_decode=memory.replica.compiled,
        assumed_draft_acceptance=(
            round(draft_acceptance(memory.replica.correction, chosen.mode, serving.num_speculative_tokens), 4)
            if speculating
            else None
        ),
        assumed_prefix_share=spec.load.prefix_share,
        block_size=sizes.block_size,
        gpu_memory_utilization=serving.gpu_memory_utilization,
        kv_blocks=sizes.kv_pool_bytes // sizing.kv_block_bytes(sizes.kv_layout, sizes.block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=memory.budget,
        predicted_batch=round(perf.batch, 2) if finite else 0.0,
        predicted_ttft_ms=round(perf.ttft_s * 1000, 1) if finite else 0.0,
        predicted_tpot_ms=round(perf.tpot_s * 1000, 1) if finite else 0.0,
        predicted_latency_ms=round(latency * 1000, 1) if finite else 0.0,
        replicas=replicas,
        meets_slo=chosen.miss is None,
        reasons={
            "kvCache": memory.kv_reason,
            "batching": memory.batching_reason,
            **lora_reason,
            "speculative": chosen.reason,
            "replicas": replicas_reason,
            **({"compiledDecode": chosen.compiled} if chosen.compiled else {}),
        },
        lora=lora,
        **sizes.reported(),
    )


def _adapters(spec: InferenceServiceSpec, memory: Memory) -> tuple[LoraPlan | None, dict[str, str]]:
    """The plan's LoRA settings and their reason; none where the spec lists no adapter."""
    settings = lora_settings(spec.adapters)
    if settings is None:
        return None, {}
    replica, slots = memory.replica, memory.sizes.adapter_bytes
    lora = LoraPlan(
        adapters=settings.adapters,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras,
        slot_bytes=slots,
    )
    return lora, {"adapters": describe(settings, slots, slots / replica.gpu.bandwidth_bytes_per_s, replica.arch)}


def _adapters_problem(spec: InferenceServiceSpec, arch: Architecture, where: str) -> Plan | None:
    """Why the spec's adapters cannot be planned on this model (their slots cannot be sized), None when
    they can or there are none."""
    problem = adapter_problem(arch) if spec.adapters else None
    if problem is not None:
        return failed_plan(spec, "AdaptersNotPlanned", f"spec.adapters on {spec.model.name} ({where}): {problem}")
    return None


def _architecture(spec: InferenceServiceSpec, checkpoint: Architecture | None) -> tuple[Architecture, str] | Plan:
    """The model's architecture and where it comes from (the spec's, the catalog's, else its
    checkpoint's config.json), or why it cannot be planned."""
    explicit = spec.model.architecture
    catalog = None if explicit else find_model(spec.model.name)
    arch = explicit or catalog or checkpoint
    if arch is None:
        return failed_plan(
            spec,
            "UnknownModel",
            f"model {spec.model.name!r} is not in the catalog ({', '.join(MODELS)}) and "
            "spec.model.architecture is not set (nor model.source a checkpoint whose config.json is read: hf:// "
            "from the Hub; a claim or a path in the image by the operator's inspection Job; offline, "
            "`kvpilot plan --model-config DIR`)",
        )
    if explicit:
        where = f"spec.model.architecture ({arch.source})" if arch.source else "spec.model.architecture"
    else:
        where = f"catalog ({arch.source})" if catalog else f"the checkpoint's {arch.source}"
    problem = sizing.architecture_problem(arch) or sizing.checkpoint_problem(arch, spec.model.quantization)
    if problem is not None:
        return failed_plan(spec, "InvalidArchitecture", f"{where}: {problem}")
    context = spec.serving.max_context_length or arch.max_context
    if context > arch.max_context:
        return failed_plan(
            spec,
            "ContextTooLong",
            f"maxContextLength {context} exceeds {spec.model.name}'s maximum context {arch.max_context}",
        )
    return _adapters_problem(spec, arch, where) or (arch, where)


def _choice_reasons(
    spec: InferenceServiceSpec, chosen: Plan, rejected: Sequence[Plan], gpus: Sequence[Device], not_run: str
) -> dict[str, str]:
    """Why this quantization and this GPU: what was tried before the chosen option and why not."""
    passed = [
        f"{o.gpu}/{o.quantization}/TP {o.gpu_count}{'/FP8 KV' if o.kv_cache_dtype == 'fp8' else ''}: "
        f"{rejected_because(o)}"
        for o in rejected
    ]
    if spec.model.quantization is not None:
        quantization = f"{chosen.quantization}: the checkpoint's own (model.quantization)"
    elif spec.serving.quantization != "auto":
        quantization = f"{chosen.quantization}: set in the spec"
    elif chosen.meets_slo:
        tried = f" (rejected {'; '.join(passed)})" if passed else ""
        quantization = f"{chosen.quantization}: the least lossy scheme that fits and meets the SLO{tried}{not_run}"
    else:
        quantization = (
            f"{chosen.quantization}: no scheme meets the SLO within maxReplicas; this is the "
            f"least lossy that fits{not_run}"
        )
    if spec.accelerator.type:
        gpu = f"{chosen.gpu}: set in the spec"
    else:
        gpu = f"{chosen.gpu}: the smallest of the nodes' GPUs ({', '.join(g.name for g in gpus)}) that " + (
            "fits and meets the SLO" if chosen.meets_slo else "fits"
        )
    return {"gpu": gpu, "quantization": quantization}


def _options(
    inputs: Inputs, gpus: Sequence[Device], schemes: Sequence[str], per_node: Mapping[str, int]
) -> tuple[list[Option], dict[str, str]]:
    """A plan for every GPU type, scheme and tensor-parallel size, in the order of preference
    (cheapest GPU, least lossy scheme, fewest GPUs per replica), and per GPU type the sizes ruled out."""
    spec, arch, capabilities = inputs.spec, inputs.arch, inputs.capabilities
    options: list[Option] = []
    ruled_out: dict[str, str] = {}
    for gpu in gpus:
        sizes, ruled_out[gpu.name] = tensor_parallel_sizes(spec, arch, gpu, capabilities, per_node.get(gpu.name))
        if not sizes:
            options.append(
                Option(
                    failed_plan(spec, "NoTensorParallelSize", f"{spec.model.name} on {gpu.name}: {ruled_out[gpu.name]}")
                )
            )
        kv_dtypes = kv_cache_dtypes(spec, capabilities, gpu)
        options += [
            _size(inputs._replace(kv_cache_dtype=kv), (gpu, tp), q) for q in schemes for tp in sizes for kv in kv_dtypes
        ]
    return options, ruled_out


def _runtime_refusal(
    spec: InferenceServiceSpec, arch: Architecture, capabilities: EngineCapabilities, model_reason: str
) -> Plan | None:
    """Why the runtime does not run this model as the spec asks, None when it does."""
    beyond = sizing.beyond_plain_decoder(arch)
    if beyond and capabilities.plain_decoders_only:
        return failed_plan(
            spec,
            "UnsupportedByRuntime",
            f"{spec.model.name} has {beyond} ({model_reason}); runtime {spec.runtime} runs only decoders whose "
            "every layer attends to the whole sequence over K and V heads, text only: use runtime vllm",
        )
    unloaded = unloaded_class(arch, capabilities, spec.runtime)
    if unloaded:
        return failed_plan(spec, "UnsupportedByRuntime", f"{spec.model.name}: {unloaded} ({model_reason})")
    block = spec.serving.block_size
    if arch.chunked and arch.sliding_window % block:
        return failed_plan(
            spec,
            "UnsupportedByRuntime",
            f"{spec.model.name}'s attention chunks of {arch.sliding_window} tokens ({model_reason}) are not a whole "
            f"number of serving.blockSize {block}-token blocks: vLLM's chunked local attention maps each chunk to "
            "whole blocks (it asserts attention_chunk_size % block_size == 0); set a blockSize that divides it",
        )
    beside = state_speculation(arch, spec.serving.speculative) if spec.serving.speculative != "auto" else None
    if beside:
        return failed_plan(
            spec, "UnsupportedByRuntime", f"serving.speculative {spec.serving.speculative!r}: {beside}; set it to off"
        )
    return None


def plan(spec: InferenceServiceSpec, context: PlanContext | None = None) -> Plan:
    """Plan serving `spec` on its runtime (or on `context.capabilities`), with what the cluster and the
    service's engines showed (PlanContext); a Plan with fits=False says why it cannot be served."""
    context = context or PlanContext()
    available_gpus, capabilities = context.available_gpus, context.capabilities
    gpus_per_node, device_profiles, correction = context.gpus_per_node, context.device_profiles, context.correction
    capabilities = capabilities or RUNTIMES[spec.runtime].capabilities
    unsupported = unsupported_pins(spec, capabilities)
    if unsupported:
        # No GPU or model changes what the runtime can run: say so before anything else.
        return failed_plan(spec, "UnsupportedByRuntime", unsupported)
    capabilities = with_adapters(spec, capabilities)
    found = _architecture(spec, context.checkpoint)
    if isinstance(found, Plan):
        return found
    arch, model_reason = found
    refused = _runtime_refusal(spec, arch, capabilities, model_reason)
    if refused is not None:
        return refused
    devices = devices_to_try(spec, arch, available_gpus, device_profiles or {})
    if isinstance(devices, Plan):
        return devices
    gpus, cpu = devices
    draft = draft_model(spec, arch, capabilities, context.draft_checkpoint)
    if isinstance(draft, Plan):
        return draft
    tried = quantization_schemes(spec, capabilities, cpu[0] if cpu else None)
    if isinstance(tried, Plan):
        return tried
    schemes, not_run = tried
    per_node = most_per_node(gpus_per_node or {})
    context_length = spec.serving.max_context_length or arch.max_context
    inputs = Inputs(spec, arch, context_length, capabilities, draft, correction or NO_CORRECTION)
    sized, ruled_out = _options(inputs, gpus, schemes, per_node)
    options = [option.plan for option in sized]
    chosen = next((o for o in options if o.fits and o.meets_slo), None) or next((o for o in options if o.fits), None)
    if chosen is None:
        # The most capable option tried (largest GPU, most compressed scheme, most GPUs) says best why
        # not, unless the GPU lacks the scheme's kernels altogether.
        last = next((o for o in reversed(options) if o.failure != "UnsupportedOnGPU"), options[-1])
        hint = f"; {ruled_out[str(last.gpu)]}" if ruled_out.get(str(last.gpu)) else ""
        if last.failure in ("WeightsDoNotFit", "ContextDoesNotFit") and capabilities.tensor_parallel_sizes == (1,):
            hint += "; runtime: vllm splits a replica over up to 8 GPUs (tensor parallelism)"
        return last.model_copy(update={"reason": last.reason + not_run + hint})
    earlier = options[: options.index(chosen)]
    smaller = [o for o in earlier if (o.gpu, o.quantization) == (chosen.gpu, chosen.quantization)]
    reasons = {
        "model": model_reason,
        **kv_cache_dtype_reason(spec, chosen, earlier),
        **_choice_reasons(spec, chosen, earlier, gpus, not_run),
        "tensorParallel": tp_reason(spec, chosen, smaller, ruled_out[str(chosen.gpu)]),
        **chosen.reasons,
    }
    return _completed(spec, arch, sized[options.index(chosen)], reasons, cpu)


def _completed(
    spec: InferenceServiceSpec,
    arch: Architecture,
    chosen: Option,
    reasons: dict[str, str],
    cpu: tuple[Device, DeviceProfile] | None,
) -> Plan:
    """The chosen option with all its reasons, what one replica serves and how long one takes to start."""
    speculation = chosen.speculation
    assert speculation is not None  # a plan that fits has run its speculation choice
    capacity = capacity_rps(spec, speculation.memory.replica, speculation.mode)
    planned = chosen.plan.model_copy(update={"reasons": reasons, "capacity_rps": capacity, **_cpu_fields(cpu, reasons)})
    startup, reasons["startup"] = startup_fields(spec, arch, planned)
    return planned.model_copy(update={"reasons": reasons, **startup})


def _cpu_fields(cpu: tuple[Device, DeviceProfile] | None, reasons: dict[str, str]) -> dict[str, object]:
    """What a CPU plan adds: its profile, the CPUs a replica requests, and what the profile measured."""
    if cpu is None:
        return {}
    device, profile = cpu
    reasons["gpu"] += f"; {cpus.describe(profile)}"
    return {"device_profile": profile.name, "cpus": device.cpus}
