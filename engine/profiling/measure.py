"""The measurements behind a device profile (`kvpilot profile`): memory bandwidth, the matmul of each
scheme through the engine's own linear layer (its kernels and its routing by tokens per step), and
decode steps of the engine itself.

Each figure comes from repeated timed calls after one untimed warm-up call (which allocates, packs
and fills the caches). Bandwidth and matmul rates take the fastest call, as STREAM reports its best
rate: they are what the hardware does, and on a shared machine a call whose threads were descheduled
(a whole 4 ms time slice for a 40 us matmul here) says nothing about it. Engine steps take the
median: a step's own jitter (Python, allocation) is part of what serving costs.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable

import torch

from kvpilot.engine.contract.config import EMBEDDED_MODEL, EngineConfig
from kvpilot.engine.contract.device_profile import (
    EngineStep,
    EngineSteps,
    MatmulPoint,
    MatmulProfile,
    PrefillStep,
    SchemeSteps,
)
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.cpu.compile_cache import resolve_root
from kvpilot.engine.cpu.features import choose_kernel_path, read_cpu_flags
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.loader import cache_root, embedded_model_dir
from kvpilot.engine.model.quantization import INT4_DENSE_TOKENS, INT8_DENSE_TOKENS, for_scheme

Progress = Callable[[str], None]

GROUP_SIZE: int = EngineConfig.model_fields["quantization_group_size"].default
# Profile name -> (the engine's quantization scheme, the activations' dtype, what runs); W8A8's
# activations and GEMM are those of this CPU's kernel path (kvpilot.engine.cpu.features).
SCHEMES: dict[str, tuple[str, torch.dtype | None, str]] = {
    "fp32": ("none", torch.float32, "the engine's unquantized linear, fp32 weight and activations"),
    "bf16": ("none", torch.bfloat16, "the engine's unquantized linear, bf16 weight and activations"),
    "int8": (
        "int8",
        torch.bfloat16,
        "aten._weight_int8pack_mm (int8 weight per output channel, bf16 activations); "
        f"from {INT8_DENSE_TOKENS} tokens the weight dequantized into a bf16 aten.linear",
    ),
    "int4": (
        "int4",
        torch.bfloat16,
        f"aten._weight_int4pack_mm_for_cpu (int4 weight, groups of {GROUP_SIZE}, bf16 activations); "
        f"from {INT4_DENSE_TOKENS} tokens the weight dequantized into a bf16 aten.linear",
    ),
    "w8a8": (
        "w8a8",
        None,
        "int8 weight per output channel x int8 activations per token (quantized at each call), summed by",
    ),
}
# Prompts of the engine steps: any text; the steps decode past it with ignore_eos.
_PASSAGE = "Paged attention keeps the keys and values of every token in fixed-size blocks of memory. " * 80
_PROMPT_TOKENS = 64
_LONG_CONTEXT_TOKENS = 1024
_LONG_CONTEXT_BATCH = 4
# The engine's schemes, "none" first: the ones SCHEMES measures as matmuls.
ENGINE_SCHEMES = tuple(dict.fromkeys(scheme for scheme, _, _ in SCHEMES.values()))


def call_seconds(call: Callable[[], object], min_seconds: float, min_calls: int = 3) -> list[float]:
    """The times of `call`, repeated until `min_seconds` and `min_calls` are both reached."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return times


def memory_bandwidth(nbytes: int, min_seconds: float) -> tuple[float, float]:
    """(read, copy) bytes/s over an fp32 buffer of `nbytes`: a sum reads it once; a copy into a second
    buffer reads and writes it, counted as 2 x nbytes as STREAM counts its Copy."""
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    read = nbytes / min(call_seconds(source.sum, min_seconds))
    copy = 2 * nbytes / min(call_seconds(lambda: target.copy_(source), min_seconds))
    return read, copy


def engine_linear(scheme: str, dtype: torch.dtype, shape: tuple[int, int], integer_kernels: bool = True) -> Linear:
    """The engine's linear layer for `scheme`, its weight loaded through its weight_loader and put in
    its serving form, as the model loader and the model runner do (packed for oneDNN where it would be)."""
    out_features, in_features = shape
    quantization, _ = for_scheme(scheme, GROUP_SIZE, integer_kernels)
    layer = Linear(in_features, out_features, quantization=quantization)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    layer.weight.weight_loader(layer.weight, weight)  # type: ignore[attr-defined]
    layer.process_weights_after_loading()
    if quantization is not None:
        quantization.cpu_kernel = scheme in served_matmul_schemes()
        return layer
    layer = layer.to(dtype)
    if onednn_linear.serves(torch.device("cpu"), dtype, choose_kernel_path("auto").onednn_dtypes):
        layer.pack_for_onednn()
    return layer


@functools.cache
def served_matmul_schemes() -> frozenset[str]:
    """The weight-only schemes whose decode-sized matmuls an engine here runs on cpu_kernels' C++
    library (loaded as the model runner loads it); none where it cannot be loaded."""
    flags = read_cpu_flags()
    try:
        cpu_kernels.load(resolve_root(None), flags, cache_root() / cpu_kernels.KERNELS)
    except (RuntimeError, OSError):
        return frozenset()
    return cpu_kernels.matmul_schemes(flags)


def matmul_profile(name: str, shape: tuple[int, int], tokens: tuple[int, ...], min_seconds: float) -> MatmulProfile:
    scheme, dtype, kernel = SCHEMES[name]
    path = choose_kernel_path("auto")
    if dtype is None:
        dtype = torch.bfloat16 if path.bf16 else torch.float32
        gemm = "torch._int_mm (int32)" if path.integer_kernels else "an fp32 aten.linear"
        kernel = f"{kernel} {gemm}, {str(dtype).removeprefix('torch.')} activations ({path.name} kernel path)"
    layer = engine_linear(scheme, dtype, shape, path.integer_kernels)
    if layer.packed_weight is not None:
        kernel += " (weight packed in oneDNN's layout)"
    if layer.quantization is not None and layer.quantization.cpu_kernel:
        kernel += f"; decode-sized calls on kvpilot::{scheme}_mm (cpu_kernels) where the layer takes it"
    points = []
    with torch.inference_mode():
        for n in tokens:
            x = torch.randn(n, shape[1], generator=torch.Generator().manual_seed(n)).to(dtype)
            seconds = min(call_seconds(lambda x=x: layer(x), min_seconds))
            points.append(MatmulPoint(tokens=n, flop_per_s=2 * n * shape[0] * shape[1] / seconds))
    return MatmulProfile(kernel=kernel, weight_shape=shape, points=tuple(points))


def embedded_model_problem() -> str | None:
    """Why the embedded model cannot be loaded here, or None when it can."""
    try:
        embedded_model_dir()
    except RuntimeError as err:
        return str(err)
    return None


def _admit(engine: LLMEngine, batch: int, prompt: list[int], prompt_tokens: int, max_tokens: int) -> None:
    """Requests up to `batch` running, their prompts prefilled (untimed), and one decode step taken."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(len(engine.requests), batch):
        engine.add_request(prompt[i % 7 : i % 7 + prompt_tokens], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()


def _engine(max_num_seqs: int, **options: object) -> LLMEngine:
    # No prefix caching: every prefill step computes its whole prompt.
    config = EngineConfig(
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        **options,
    )
    return LLMEngine(config)


def _decode_step(engine: LLMEngine, steps: int) -> EngineStep:
    """The median of `steps` decode steps of the running requests, with their mean context."""
    before = statistics.mean(r.num_tokens for r in engine.requests.values())
    seconds = statistics.median(call_seconds(engine.step, 0.0, min_calls=steps))
    after = statistics.mean(r.num_tokens for r in engine.requests.values())
    return EngineStep(batch=len(engine.requests), context_tokens=(before + after) / 2, seconds=seconds)


def _prefill_step(engine: LLMEngine, prompt: list[int], tokens: int, steps: int) -> PrefillStep:
    """The median step that computes one prompt of `tokens`, alone (each prompt a new one)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    offsets = itertools.count()

    def step() -> None:
        start = next(offsets) % (len(prompt) - tokens)
        engine.add_request(prompt[start : start + tokens], params)
        engine.step()

    return PrefillStep(tokens=tokens, seconds=statistics.median(call_seconds(step, 0.0, min_calls=steps)))


def compiled_step_factor(steps: int, progress: Progress) -> float:
    """The embedded model's batch-1 decode step with compile_decode over the same engine's eager
    step (its compile, from the compile cache when there is one, before the timing). The two are
    timed in alternating rounds on one sequence, so that the ratio holds while the machine's speed
    drifts between minutes (two threads on a shared VM; bench/RESULTS.md, "Device profile")."""
    progress("compiling the decode step (compile_decode; tens of seconds without a compile cache)")
    engine = _engine(1, compile_decode=True)
    per_round = 4
    rounds = max(1, steps // per_round)
    # Tokens for every timed step and each round's untimed first call, so that no step runs empty.
    _admit(engine, 1, engine.tokenize(_PASSAGE), _PROMPT_TOKENS, 2 * rounds * (per_round + 1) + 8)
    runner = engine.runner
    compiled_decode, times = runner.compiled_decode, {True: [], False: []}
    for _ in range(rounds):
        for compiled in (True, False):
            # Without its compiled forward the runner runs the lone sequence's step as an engine
            # without compile_decode does: eagerly, on the same C++ kernels.
            runner.compiled_decode = compiled_decode if compiled else None
            times[compiled] += call_seconds(engine.step, 0.0, min_calls=per_round)
    runner.compiled_decode = compiled_decode
    compiled_s, eager_s = statistics.median(times[True]), statistics.median(times[False])
    progress(
        f"engine decode step, batch 1, compiled: {compiled_s * 1e3:.2f} ms against {eager_s * 1e3:.2f} ms eager "
        f"in alternating rounds: x{compiled_s / eager_s:.2f}"
    )
    return compiled_s / eager_s


def falling_steps(points: list[tuple[int, float]], unit: str) -> list[str]:
    """Where a step of more sequences or tokens (`unit`) measured more than 5 % faster than a smaller
    one: no step does less work than a smaller one, so the machine ran faster at that moment."""
    return [
        f"{unit} {size} {seconds * 1e3:.1f} ms, below {unit} {smaller} {smaller_s * 1e3:.1f} ms"
        for (smaller, smaller_s), (size, seconds) in itertools.pairwise(sorted(points))
        if seconds < 0.95 * smaller_s
    ]


def scheme_steps(
    quantization: str, batches: tuple[int, ...], prefill_tokens: tuple[int, ...], steps: int, progress: Progress
) -> tuple[SchemeSteps, EngineStep | None, bool]:
    """The embedded model's decode steps at each batch and prefill steps of each prompt length with
    `quantization` (dtype auto, eager steps); for "none" also a decode step at a long context. And
    whether the engine packed full-precision weights for oneDNN."""
    engine = _engine(max(batches), quantization=quantization)
    prompt = engine.tokenize(_PASSAGE)
    # Fewer repeats of prefill steps: they are long, and their spread is smaller than a decode step's.
    prefill = tuple(_prefill_step(engine, prompt, tokens, max(3, steps // 3)) for tokens in prefill_tokens)
    # Enough tokens that the first request still decodes in the last batch's steps.
    max_tokens = len(batches) * (steps + 8)
    decode = []
    for batch in batches:
        _admit(engine, batch, prompt, _PROMPT_TOKENS, max_tokens)
        decode.append(_decode_step(engine, steps))
    shown = ", ".join(f"{s.batch}: {s.seconds * 1e3:.1f}" for s in decode)
    prefills = ", ".join(f"{s.tokens} tokens {s.seconds * 1e3:.1f}" for s in prefill)
    progress(f"engine steps, {quantization}: decode by batch {shown} ms; prefill {prefills} ms")
    falls = falling_steps([(s.batch, s.seconds) for s in decode], "batch")
    falls += falling_steps([(s.tokens, s.seconds) for s in prefill], "prefill of")
    if falls:
        progress(
            f"warning: {quantization} steps {'; '.join(falls)}: the machine's speed changed while measuring "
            "(the planner fits a non-decreasing curve over them); profile again on a quiet machine"
        )
    long_context = None
    if quantization == "none":
        for request_id in list(engine.requests):
            engine.abort(request_id)
        batch = min(_LONG_CONTEXT_BATCH, max(batches))
        _admit(engine, batch, prompt, _LONG_CONTEXT_TOKENS, steps + 8)
        long_context = _decode_step(engine, steps)
        progress(
            f"engine decode step, batch {batch} at {long_context.context_tokens:.0f} tokens of context: "
            f"{long_context.seconds * 1e3:.1f} ms"
        )
    weights = SchemeSteps(
        quantization=quantization, weight_bytes=engine.runner.weight_bytes, decode=tuple(decode), prefill=prefill
    )
    return weights, long_context, engine.runner.onednn_layers > 0


def engine_steps(
    batches: tuple[int, ...], prefill_tokens: tuple[int, ...], steps: int, progress: Progress, compiled: bool = False
) -> EngineSteps:
    """Every scheme's steps (scheme_steps); `compiled`: the batch-1 step with compile_decode too."""
    measured = [scheme_steps(q, batches, prefill_tokens, steps, progress) for q in ENGINE_SCHEMES]
    _, long_context, onednn_weights = measured[0]
    assert long_context is not None  # "none" comes first and measures it
    return EngineSteps(
        model=EMBEDDED_MODEL,
        dtype=str(EngineConfig().torch_dtype(torch.device("cpu"), choose_kernel_path("auto").bf16)).removeprefix(
            "torch."
        ),
        schemes=tuple(weights for weights, _, _ in measured),
        long_context=long_context,
        # The factor measured side by side, applied to the eager step the "none" scheme measured.
        compiled_step_s=compiled_step_factor(steps, progress) * measured[0][0].decode[0].seconds if compiled else None,
        onednn_weights=onednn_weights,
    )
