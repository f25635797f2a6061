"""CPU node types as devices the planner sizes for, from device profiles (`kvpilot profile`).

A profile is what one engine process measured on one CPU node type with its thread count: memory
bandwidth, each scheme's matmul rate by tokens per step, and this engine's decode steps on the
embedded model. `cpu_device` turns it into the planner's device record (planning/device.py's Device), so
a CPU replica is sized with the same formulas as a GPU: KV from memory, decode bounded by bandwidth
or arithmetic, prefill by arithmetic, plus the engine's measured per-step work, which a GPU's spec
sheet does not have and which dominates a small model's step on a CPU.

Profiles come built in (profiles/*.json: CPU families this project measured) or from a ConfigMap
in the operator's namespace whose `profile.json` key holds one, so an admin profiles a node type once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from kvpilot.engine.contract.device_profile import (
    DeviceProfile,
    EngineStep,
    EngineSteps,
    MatmulProfile,
    PrefillStep,
    SchemeSteps,
    parse_device_profile,
)
from kvpilot.operator.api.spec import CPU_TYPE, Architecture
from kvpilot.operator.planning.device import Device, Measured, MiB
from kvpilot.operator.planning.models import find_model
from kvpilot.operator.planning.sizing import HeldAs, kv_bytes_per_token, weight_bytes

Step = TypeVar("Step", EngineStep, PrefillStep)
BUILTIN_DIR = Path(__file__).parent / "profiles"
PROFILE_CONFIGMAP_KEY = "profile.json"
# The engine's dtypes on a CPU: bf16 where the CPU has bf16 arithmetic, fp32 elsewhere.
_BYTES_PER_VALUE = {"bfloat16": 2, "float16": 2, "float32": 4}


@cache
def builtin_profiles() -> dict[str, DeviceProfile]:
    """The profiles shipped with the operator, by name."""
    found = (parse_device_profile(path.read_text(), path.name) for path in sorted(BUILTIN_DIR.glob("*.json")))
    return {profile.name: profile for profile in found}


def configmap_profile(configmap: Mapping[str, Any]) -> DeviceProfile:
    """The profile a ConfigMap holds under `profile.json`; a ValueError saying what is wrong."""
    meta = configmap.get("metadata") or {}
    where = f"ConfigMap {meta.get('namespace')}/{meta.get('name')}"
    text = (configmap.get("data") or {}).get(PROFILE_CONFIGMAP_KEY)
    if not text:
        raise ValueError(f"{where} has no {PROFILE_CONFIGMAP_KEY} key (the output of `kvpilot profile`)")
    return parse_device_profile(text, f"{where} key {PROFILE_CONFIGMAP_KEY}")


def _curve(matmul: MatmulProfile) -> tuple[tuple[int, float], ...]:
    return tuple((p.tokens, p.flop_per_s) for p in matmul.points)


def _compute_seconds(device: Device, quantization: str, parameters: float, tokens: int) -> float:
    return 2 * parameters * tokens / device.matmul_flops(quantization, tokens)


def _attention_rate(steps: EngineSteps, kv_per_token: int) -> float | None:
    """Bytes of KV per second that the measured attention gets through: the long-context step beside
    the decode step of the same batch (None where it cost nothing measurable)."""
    long = steps.long_context
    short = next((s for s in steps.schemes[0].decode if s.batch == long.batch), None)
    if short is None or long.context_tokens <= short.context_tokens or long.seconds <= short.seconds:
        return None
    seconds_per_token = (long.seconds - short.seconds) / (long.batch * (long.context_tokens - short.context_tokens))
    return kv_per_token / seconds_per_token


class Reference(NamedTuple):
    """The model a profile's engine steps were measured on, as the planner counts its work."""

    parameters: float  # multiplied in a decode step's GEMMs
    kv_per_token: int
    kv_bytes_per_s: float | None  # the measured attention's rate (None: not measurable)
    scale: float  # the served model's layers over this one's


def _decode_overheads(
    device: Device, scheme: SchemeSteps, read_bytes: int, reference: Reference
) -> tuple[tuple[int, float], ...]:
    """One scheme's engine work in a decode step beyond the GEMMs (reading `read_bytes` of weights)
    and attention the planner counts, by running sequences, scaled to the served model. Not floored
    at 0: with the GEMMs counted back, the planner predicts the measured model's steps as measured
    even where the matmul micro-benchmark under-rates its kernels."""
    q, rate = scheme.quantization, reference.kv_bytes_per_s
    overheads = []
    for step in scheme.decode:
        compute = _compute_seconds(device, q, reference.parameters, step.batch)
        gemms = max(read_bytes / device.bandwidth_bytes_per_s, compute)
        attention = step.batch * step.context_tokens * reference.kv_per_token / rate if rate else 0.0
        overheads.append((step.batch, (step.seconds - gemms - attention) * reference.scale))
    return tuple(overheads)


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a run that falls
    is replaced by its mean."""
    pools: list[tuple[float, int]] = []  # (sum, count) of each pooled run
    for value in values:
        pools.append((value, 1))
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            (total, count), (last_total, last_count) = pools[-2], pools.pop()
            pools[-1] = (total + last_total, count + last_count)
    return [total / count for total, count in pools for _ in range(count)]


def _steady(scheme: SchemeSteps) -> SchemeSteps:
    """One scheme's steps with their seconds fitted non-decreasing, decode by batch and prefill by
    prompt tokens. A step of more sequences or tokens does at least the work of a smaller one; one
    measured faster caught the machine in a faster minute (threads on a shared VM drift between
    minutes), and taken as it is, it would make a second sequence or an n-gram verification cost
    nothing."""

    def fitted(steps: Sequence[Step], size: Callable[[Step], int]) -> tuple[Step, ...]:
        ordered = sorted(steps, key=size)
        seconds = non_decreasing([s.seconds for s in ordered])
        return tuple(s.model_copy(update={"seconds": v}) for s, v in zip(ordered, seconds))

    return scheme.model_copy(
        update={
            "decode": fitted(scheme.decode, lambda s: s.batch),
            "prefill": fitted(scheme.prefill, lambda s: s.tokens),
        }
    )


def _prefill_curve(scheme: SchemeSteps, scale: float) -> tuple[tuple[int, float], ...]:
    """One scheme's prefill steps by prompt tokens, scaled by `scale` (the parameters a token of the
    served model meets over the measured one's: prefill is arithmetic). Measured at several lengths
    and interpolated, not a line nor the matmul micro-benchmark: packed kernels' cost jumps between
    lengths with how the tokens fall into their tiles, which neither of those sees."""
    return tuple((step.tokens, step.seconds * scale) for step in scheme.prefill)


def _device(profile: DeviceProfile, bytes_per_value: int, stepped: set[str]) -> Device:
    """The record's measured rates: bandwidth, and the matmul curve of each scheme whose steps were
    measured too (the engine's dense dtype for "none")."""
    dense = profile.matmul.bf16 if bytes_per_value == 2 else profile.matmul.fp32
    curves = {"none": _curve(dense)} | {
        scheme: _curve(matmul)
        for scheme, matmul in profile.matmul
        if scheme not in ("fp32", "bf16") and matmul and scheme in stepped
    }
    peak = max(rate for _, rate in curves["none"])
    return Device(
        name=CPU_TYPE,
        product="",
        product_label="",
        resource="cpu",
        memory_gib=profile.memory_bytes / 1024**3,
        usable_memory_mib=profile.memory_bytes // MiB,
        bandwidth_gbps=profile.memory_bandwidth_bytes_per_s / 1e9,
        fp16_tflops=peak / 1e12,
        int8_tops=peak / 1e12,
        fp8=False,
        bf16=bytes_per_value == 2,
        source=f"device profile {profile.name}: {profile.cpu_model}, measured {profile.measured_at:%Y-%m-%d}",
        link="none",
        link_gbps=1,
        link_latency_us=0,
        max_per_node=1,
        measured=Measured(matmul_curves=tuple(curves.items())),
        bytes_per_value=bytes_per_value,
        cpus=profile.threads,
    )


def cpu_device(profile: DeviceProfile, arch: Architecture) -> Device | str:
    """The device record of `profile`'s CPU for serving `arch`, or why the profile cannot plan.

    Each scheme the engine's steps were measured with is planned with its own measured steps: a
    decode step as its GEMMs and attention plus the work beyond them at that batch (dispatch of the
    small ops, sampling, bookkeeping), a prefill step between the measured ones. Those were measured
    on the embedded model; for another model the work beyond the GEMMs scales with its layer count
    (ASSUMED: the step's small ops run per layer), a prefill with its parameters per token."""
    steps = profile.engine
    if steps is None:
        return (
            f"device profile {profile.name} has no engine steps ({profile.engine_skipped}): run "
            "`kvpilot profile` where the engine's embedded model is installed"
        )
    bytes_per_value = _BYTES_PER_VALUE.get(steps.dtype)
    if bytes_per_value is None:
        return f"device profile {profile.name}: engine dtype {steps.dtype!r} is not one the planner sizes"
    steps = steps.model_copy(update={"schemes": tuple(_steady(s) for s in steps.schemes)})
    device = _device(profile, bytes_per_value, {s.quantization for s in steps.schemes})
    measured = device.measured or Measured()
    reference = find_model(steps.model)
    scale = arch.layers / reference.layers if reference else 1.0
    reference_kv = kv_bytes_per_token(reference, bytes_per_value) if reference else 0
    kv_rate = _attention_rate(steps, reference_kv) if reference_kv else None
    # What a "none" step's GEMMs read: its weights less a tied head's second copy (the embedding's
    # rows are read a few at a time, the packed head whole).
    head_copy = (
        weight_bytes(reference, "none", held=HeldAs(bytes_per_value, packed=steps.onednn_weights))
        - weight_bytes(reference, "none", held=HeldAs(bytes_per_value))
        if reference
        else 0
    )
    parameters = (steps.schemes[0].weight_bytes - head_copy) / bytes_per_value
    per_token_scale = arch.parameters_per_token / reference.parameters_per_token if reference else 1.0
    planned = [s for s in steps.schemes if s.quantization in dict(measured.matmul_curves)]
    none_batch_one = steps.schemes[0].decode[0].seconds
    measured = measured.model_copy(
        update={
            "step_overhead_curves": tuple(
                (
                    s.quantization,
                    _decode_overheads(
                        device,
                        s,
                        s.weight_bytes - (head_copy if s.quantization == "none" else 0),
                        Reference(parameters, reference_kv, kv_rate, scale),
                    ),
                )
                for s in planned
            ),
            "prefill_curves": tuple((s.quantization, _prefill_curve(s, per_token_scale)) for s in planned),
            "kv_read_bytes_per_s": kv_rate,
            "compiled_step_factor": steps.compiled_step_s / none_batch_one if steps.compiled_step_s else None,
            "packs_weights": steps.onednn_weights,
        }
    )
    return device.model_copy(update={"measured": measured})


def describe(profile: DeviceProfile) -> str:
    """One line for a plan's reasons: which measurements the plan stands on."""
    bandwidth = profile.memory_bandwidth_bytes_per_s / 1e9
    dense = profile.matmul.bf16.peak_flop_per_s / 1e9
    return (
        f"profile {profile.name} ({profile.cpu_model}, {profile.threads} threads, {bandwidth:.0f} GB/s, "
        f"bf16 {dense:.0f} GFLOP/s, measured {profile.measured_at:%Y-%m-%d})"
    )
