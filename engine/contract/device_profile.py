"""A CPU device profile: what `kvpilot profile` measured on a machine, as plain data. Torch-free.

The planner sizes a CPU deployment from it as it sizes a GPU from the catalog's spec-sheet figures
(memory bandwidth, matmul throughput), plus this engine's own per-step cost, which a spec sheet does
not have. The operator reads profiles (from a file or a ConfigMap) without torch, so this module
imports only pydantic.

Units are SI: bytes, bytes/s, FLOP/s, seconds. A quantized matmul (weight-only INT8/INT4, W8A8)
counts the FLOPs of the dense matmul it stands for (2 x tokens x out x in), so every scheme's rate
compares directly.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROFILE_VERSION = 2
# The /proc/cpuinfo flags that decide which kernels run fast: bf16 and int8 dot products
# (AVX512-BF16, AVX512-VNNI, AVX-VNNI), Intel's AMX tiles, and the AVX2 / AVX-512 baselines.
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

_Positive = Field(gt=0, allow_inf_nan=False)


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_increasing(values: list[int], first: int | None, what: str) -> None:
    if (first is not None and values[0] != first) or values != sorted(set(values)):
        start = f" start at {first} and" if first is not None else ""
        raise ValueError(f"{what} must{start} strictly increase, got {values}")


class MatmulPoint(_Data):
    tokens: int = Field(ge=1, description="rows of the activation (tokens in one step)")
    flop_per_s: float = _Positive


class MatmulProfile(_Data):
    """One scheme's matmul, x [tokens, in] @ W^T, W [out, in], at several token counts (the fastest of
    repeated calls). W is small enough to stay in cache: this is the kernel's arithmetic rate, and a
    step that streams its weights from memory is bounded by `memory_bandwidth_bytes_per_s` instead."""

    kernel: str = Field(min_length=1, description="the operation the engine runs for this scheme")
    weight_shape: tuple[int, int] = Field(description="(out, in)")
    points: tuple[MatmulPoint, ...] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _tokens_increase(cls, points: tuple[MatmulPoint, ...]) -> tuple[MatmulPoint, ...]:
        _check_increasing([p.tokens for p in points], None, "points' tokens")
        return points

    @property
    def peak_flop_per_s(self) -> float:
        return max(p.flop_per_s for p in self.points)


class Matmuls(_Data):
    fp32: MatmulProfile
    bf16: MatmulProfile
    int8: MatmulProfile | None = None
    int4: MatmulProfile | None = None
    w8a8: MatmulProfile | None = None


class EngineStep(_Data):
    batch: int = Field(ge=1, description="sequences decoding one token each")
    context_tokens: float = Field(gt=0, allow_inf_nan=False, description="mean tokens in each one's KV cache")
    seconds: float = _Positive


class PrefillStep(_Data):
    tokens: int = Field(ge=1, description="prompt tokens computed in the step, nothing else running")
    seconds: float = _Positive


class SchemeSteps(_Data):
    """This engine's steps (scheduler, model runner, sampler: all of `LLMEngine.step()`) with one
    quantization scheme on the model it loaded, median seconds: decode steps at each batch size, and
    the step that computes one prompt. What a step costs beyond its GEMMs (dispatch of the small ops,
    attention, sampling, bookkeeping) differs by scheme, so the planner reads each scheme's own."""

    quantization: str = Field(min_length=1)
    weight_bytes: int = Field(gt=0)
    decode: tuple[EngineStep, ...] = Field(min_length=1)
    prefill: tuple[PrefillStep, ...] = Field(min_length=1)

    @field_validator("decode")
    @classmethod
    def _batch_one_first(cls, steps: tuple[EngineStep, ...]) -> tuple[EngineStep, ...]:
        _check_increasing([s.batch for s in steps], 1, "decode steps' batches")
        return steps

    @field_validator("prefill")
    @classmethod
    def _tokens_increase(cls, steps: tuple[PrefillStep, ...]) -> tuple[PrefillStep, ...]:
        _check_increasing([s.tokens for s in steps], None, "prefill steps' tokens")
        return steps


class EngineSteps(_Data):
    """The engine's steps on the embedded model, per quantization scheme (the first is "none")."""

    model: str = Field(min_length=1)
    dtype: str = Field(min_length=1)
    schemes: tuple[SchemeSteps, ...] = Field(min_length=1)
    # A decode step of the "none" scheme at a long context: beside its decode curve at the same batch,
    # what attention costs per cached token (on a CPU far more than reading the KV at the bandwidth).
    long_context: EngineStep
    # The batch-1 step with compile_decode (`kvpilot profile --compiled`; its compile not counted),
    # as the "none" scheme's batch-1 step times the compiled/eager ratio measured side by side:
    # what the planner weighs when a plan's lone sequences miss the TPOT SLO eagerly.
    compiled_step_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The engine served full-precision weights from oneDNN's layout (engine/cpu/onednn_linear.py),
    # so "none" holds its own copy of a tied LM head beside the embedding (in its weight_bytes).
    onednn_weights: bool = False

    @field_validator("schemes")
    @classmethod
    def _none_first(cls, schemes: tuple[SchemeSteps, ...]) -> tuple[SchemeSteps, ...]:
        names = [s.quantization for s in schemes]
        if names[0] != "none" or len(set(names)) != len(names):
            raise ValueError(f"schemes must start with 'none' and name each scheme once, got {names}")
        return schemes

    def scheme(self, quantization: str) -> SchemeSteps | None:
        return next((s for s in self.schemes if s.quantization == quantization), None)


class DeviceProfile(_Data):
    version: int = PROFILE_VERSION
    name: str = Field(min_length=1)
    cpu_model: str = Field(description="lscpu's Model name (else /proc/cpuinfo's)")
    cpu_flags: tuple[str, ...] = Field(description=f"those of {', '.join(CPU_FLAGS)} the CPU has")
    torch_cpu_capability: str = Field(description="the vector ISA torch dispatches to (e.g. AVX512)")
    cores: int = Field(ge=1, description="CPUs this process may run on (its affinity mask)")
    memory_bytes: int = Field(gt=0, description="MemTotal, capped by the cgroup's memory limit")
    memory_bandwidth_bytes_per_s: float = Field(
        gt=0, allow_inf_nan=False, description="reading a buffer far larger than the caches (a sum; the fastest pass)"
    )
    memory_copy_bandwidth_bytes_per_s: float = Field(
        gt=0, allow_inf_nan=False, description="copying one such buffer to another, read + write counted (STREAM)"
    )
    matmul: Matmuls
    engine: EngineSteps | None
    engine_skipped: str | None = Field(None, description="why `engine` was not measured")
    torch_version: str = Field(min_length=1)
    threads: int = Field(ge=1, description="torch threads of every measurement, as the engine would use")
    threads_source: str
    load_average: tuple[float, float, float] = Field(description="1, 5, 15 min, when the measurement began")
    quick: bool = Field(description="measured with `--quick`: small sizes, rough numbers")
    measured_at: datetime

    @field_validator("version", mode="before")
    @classmethod
    def _known_version(cls, version: Any) -> Any:
        if version != PROFILE_VERSION:
            raise ValueError(
                f"device profile version {version!r} is not one this build reads ({PROFILE_VERSION}): "
                "measure it again with this build's `kvpilot profile`"
            )
        return version

    @field_validator("cpu_flags")
    @classmethod
    def _known_flags(cls, flags: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(flags) - set(CPU_FLAGS))
        if unknown:
            raise ValueError(f"unknown CPU flags {unknown}; known: {list(CPU_FLAGS)}")
        return flags

    @field_validator("measured_at")
    @classmethod
    def _aware(cls, when: datetime) -> datetime:
        if when.tzinfo is None:
            raise ValueError("measured_at needs a time zone")
        return when

    @model_validator(mode="after")
    def _engine_or_reason(self) -> DeviceProfile:
        if (self.engine is None) == (self.engine_skipped is None):
            raise ValueError("exactly one of engine (the measured steps) and engine_skipped (why not) is needed")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def parse_device_profile(text: str, source: str) -> DeviceProfile:
    """A profile from its JSON; a ValueError naming `source` and every wrong field otherwise."""
    try:
        return DeviceProfile.model_validate_json(text)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'profile'}: {e['msg'].removeprefix('Value error, ')}"
            for e in err.errors()
        )
        raise ValueError(f"device profile {source} is not valid: {problems}") from None


def load_device_profile(path: str | Path) -> DeviceProfile:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read device profile {path}: {err.strerror}") from None
    return parse_device_profile(text, str(path))
