"""CPU node types as devices the planner sizes for, from device profiles (`kvpilot profile`).

A profile is what one engine process measured on one CPU node type with its thread count: memory
bandwidth, each scheme's matmul rate by tokens per step, and this engine's decode steps on the
embedded model. `cpu_device` turns it into the planner's device record (planning/gpus.py's GPU), so
a CPU replica is sized with the same formulas as a GPU: KV from memory, decode bounded by bandwidth
or arithmetic, prefill by arithmetic, plus the engine's measured per-step work, which a GPU's spec
sheet does not have and which dominates a small model's step on a CPU.

Profiles come built in (profiles/*.json: CPU families this project measured) or from a ConfigMap
in the operator's namespace whose `profile.json` key holds one, so an admin profiles a node type once.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from kvpilot.engine.device_profile import DeviceProfile, MatmulProfile, parse_device_profile
from kvpilot.operator.api.spec import CPU_TYPE, Architecture
from kvpilot.operator.planning.gpus import GPU, MiB
from kvpilot.operator.planning.models import find_model

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


def _roofline_seconds(device: GPU, weight_bytes: float, parameters: float, batch: int) -> float:
    compute = 2 * parameters * batch / device.matmul_flops("none", batch)
    return max(weight_bytes / device.bandwidth_bytes_per_s, compute)


def cpu_device(profile: DeviceProfile, arch: Architecture) -> GPU | str:
    """The device record of `profile`'s CPU for serving `arch`, or why the profile cannot plan.

    The engine's per-step work beyond weights and arithmetic is fitted to the profile's measured
    decode steps: at batch 1 (a constant) and at its largest batch (a cost per running sequence:
    sampling, attention and bookkeeping per sequence). Both were measured on the embedded model; for
    another model they scale with its layer count (ASSUMED: the step's small ops run per layer)."""
    steps = profile.engine
    if steps is None:
        return (
            f"device profile {profile.name} has no engine steps ({profile.engine_skipped}): run "
            "`kvpilot profile` where the engine's embedded model is installed"
        )
    bytes_per_value = _BYTES_PER_VALUE.get(steps.dtype)
    if bytes_per_value is None:
        return f"device profile {profile.name}: engine dtype {steps.dtype!r} is not one the planner sizes"
    dense = profile.matmul.bf16 if bytes_per_value == 2 else profile.matmul.fp32
    curves = {"none": _curve(dense)} | {
        scheme: _curve(matmul) for scheme, matmul in profile.matmul if scheme not in ("fp32", "bf16") and matmul
    }
    peak = max(rate for _, rate in curves["none"])
    device = GPU(
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
        measured=True,
        matmul_curves=tuple(curves.items()),
        bytes_per_value=bytes_per_value,
        cpus=profile.threads,
    )
    reference = find_model(steps.model)
    scale = arch.layers / reference.layers if reference else 1.0
    first, last = steps.steps[0], steps.steps[-1]
    parameters = steps.weight_bytes / bytes_per_value
    overhead = max(0.0, first.seconds - _roofline_seconds(device, steps.weight_bytes, parameters, 1))
    per_sequence = 0.0
    if last.batch > 1:
        rest = last.seconds - _roofline_seconds(device, steps.weight_bytes, parameters, last.batch) - overhead
        per_sequence = max(0.0, rest / (last.batch - 1))
    compiled = steps.compiled_step_s / first.seconds if steps.compiled_step_s else None
    return device.model_copy(
        update={
            "step_overhead_s": overhead * scale,
            "sequence_overhead_s": per_sequence * scale,
            "compiled_step_factor": compiled,
        }
    )


def describe(profile: DeviceProfile) -> str:
    """One line for a plan's reasons: which measurements the plan stands on."""
    bandwidth = profile.memory_bandwidth_bytes_per_s / 1e9
    dense = profile.matmul.bf16.peak_flop_per_s / 1e9
    return (
        f"profile {profile.name} ({profile.cpu_model}, {profile.threads} threads, {bandwidth:.0f} GB/s, "
        f"bf16 {dense:.0f} GFLOP/s, measured {profile.measured_at:%Y-%m-%d})"
    )
