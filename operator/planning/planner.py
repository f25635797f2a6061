"""plan(spec) -> Plan: what fits on the GPU, the engine's limits, the choices and their reasons.

Pure: the spec, the catalogs, the runtime's declared capabilities (runtimes.py) and (for an unset
GPU type) the GPU products the cluster's nodes carry go in, a Plan comes out. Only quantization
schemes, speculative modes and tensor-parallel sizes the runtime declares are ever chosen, so every
plan renders into arguments the runtime accepts. Every input that cannot be served is a Plan with
fits=False, a `failure` code and a one-line reason carrying the numbers; nothing here raises for bad
input.

Tensor parallelism: a replica of TP GPUs is planned as one device with TP times the memory,
bandwidth and throughput of one (the weights and the KV heads split evenly, which the head counts
dividing by TP guarantees), TP times the runtime reserve (each GPU has its own), and two all-reduces
of the step's hidden states per layer over the GPUs' link added to every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from kvpilot.engine.config import SPECULATIVE_MAX_BATCH_SIZE, EngineCapabilities
from kvpilot.engine.device_profile import DeviceProfile
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import CPU_TYPE, Architecture, InferenceServiceSpec, LoadSpec, hub_source
from kvpilot.operator.planning import cpus, sizing, speculation
from kvpilot.operator.planning.context import Correction, PlanContext
from kvpilot.operator.planning.gpus import GPU, GPUS, find_gpu
from kvpilot.operator.planning.models import MODELS, find_model
from kvpilot.operator.runtimes import RUNTIMES

# Least lossy first: INT8 weight-only keeps the activations and rounds each weight to one of 256
# levels, W8A8 rounds the activations too, INT4 has only 16 levels per group of weights.
QUALITY_ORDER = ("none", "int8", "fp8", "w8a8", "int4")

# Beyond ~1k running sequences the scheduler's per-step bookkeeping, not the GPU, sets the pace
# (vLLM caps max_num_seqs at 256-1024 for the same reason).
MAX_NUM_SEQS_CAP = 1024
# Token budget per step: at least enough to prefill a few blocks per step, at most what the
# activation reserve is sized for without dominating small GPUs.
MIN_BATCHED_TOKENS = 256
MAX_BATCHED_TOKENS = 8192
# A prefill chunk may use this share of the TPOT SLO; the rest is the decode work of the step.
PREFILL_SHARE_OF_TPOT = 0.5

# Speculation spends compute that decode leaves idle (decode is bandwidth-bound at small batch),
# and drafts are accepted mostly when sampling is near-greedy: it pays at small batch and low
# temperature. The engine stops speculating above this running batch, and predictions do too.
SPECULATION_MAX_BATCH = SPECULATIVE_MAX_BATCH_SIZE
HIGH_TEMPERATURE = 1.0
# Verifying k + 1 tokens costs more than a plain decode step: 1.15x is an assumption for a
# bandwidth-bound GPU (no GPU was at hand; on this project's 2-core CPU, where decode is
# compute-bound, it measured ~1.5x, and a measured device computes it as a step of k + 1 rows).
# Draft acceptance (assumed and observed) is the engines' unit: planning/speculation.py.
# The modes that run serving.draftModel beside the target (auto chooses only "draft").
DRAFTED = ("draft", "eagle")
VERIFY_OVERHEAD = 1.15
# Predictions are 95th percentiles (_p95): the tail share and the normal quantile of 0.95.
P95_TAIL = 0.05
Z_95 = 1.645


class _Draft(NamedTuple):
    """A draft model as the engine runs it beside the target: unquantized in the target's dtype (the
    engine loads it so), with a KV cache of one slot per slot of the target's."""

    source: str
    arch: Architecture
    weights: int
    kv_per_token: int
    head_copy: int = 0  # of `weights`, a tied head's packed copy, which a step reads in place of the rows

    def on(self, gpu: GPU) -> _Draft:
        """The draft as the engine holds it on `gpu`: 4 bytes per value on a CPU that computes in
        fp32, and a tied head twice where the engine packs weights for oneDNN (sizing.weight_bytes)."""
        plain = sizing.weight_bytes(self.arch, "none", bytes_per_value=gpu.bytes_per_value)
        held = sizing.weight_bytes(self.arch, "none", bytes_per_value=gpu.bytes_per_value, packed=gpu.packs_weights)
        return self._replace(
            weights=held, kv_per_token=sizing.kv_bytes_per_token(self.arch, gpu.bytes_per_value), head_copy=held - plain
        )


class _Replica(NamedTuple):
    """What one engine replica is: the model on its GPUs at one quantization, with its draft."""

    arch: Architecture
    gpu: GPU  # the tensor-parallel group as one device (_group)
    tp: int
    decode_weight_bytes: int  # the target's weight bytes one decode step moves (sizing.decode_weight_bytes)
    kv_per_token: int  # the target's
    quantization: str  # the GEMMs' rate: gpu.matmul_flops(quantization, tokens)
    max_num_seqs: int
    draft: _Draft | None
    compiled: bool = False  # a lone sequence's decode step is compiled (compile_decode)


class _Perf(NamedTuple):
    batch: float  # concurrent sequences per replica (Little's law)
    ttft_s: float
    tpot_s: float
    overload: str | None  # why the replica cannot keep up, None when it can


class _Sizes(NamedTuple):
    """The numbers of a (GPU, quantization) pair a Plan reports, whether it fits or not."""

    gpu: str
    quantization: str
    weight_bytes: int  # the target's and the draft's
    draft_weight_bytes: int
    kv_bytes_per_token: int  # the target's and the draft's: what every KV slot holds
    draft_kv_bytes_per_token: int
    checkpoint_bytes: int
    kv_pool_bytes: int
    max_model_len: int


class _Memory(NamedTuple):
    """How one replica's GPU memory divides: weights, reserve, and the KV pool's sequences."""

    replica: _Replica
    sizes: _Sizes
    budget: int
    batching_reason: str
    mean_context: int
    kv_reason: str


class _Speculation(NamedTuple):
    """The speculative mode a (GPU, quantization) pair runs, with the memory and replicas it gives."""

    mode: str
    reason: str
    memory: _Memory
    replicas: int
    perf: _Perf
    miss: str | None
    compiled: str = ""  # why the plan compiles a lone sequence's decode step, when it does


def _gib(n: float) -> str:
    return f"{n / sizing.GiB:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _failed(spec: InferenceServiceSpec, failure: str, reason: str, sizes: _Sizes | None = None) -> Plan:
    return Plan(
        fits=False,
        failure=failure,
        reason=reason,
        model=spec.model.name,
        runtime=spec.runtime,
        block_size=spec.serving.block_size,
        gpu_memory_utilization=spec.serving.gpu_memory_utilization,
        **(sizes._asdict() if sizes else {}),
    )


def _listed(options: Iterable[str]) -> str:
    return ", ".join(options) or "nothing"


def _unsupported_pins(spec: InferenceServiceSpec, capabilities: EngineCapabilities) -> str | None:
    """Why the spec pins options its runtime cannot run, None when it pins none."""
    runtime = f"runtime {spec.runtime}"
    cpu = spec.accelerator.type == CPU_TYPE
    problems = [
        f"{field} {value!r} is not one {runtime} runs (supported: {_listed(supported)}{auto})"
        for field, value, supported, auto in (
            (
                "serving.quantization",
                spec.serving.quantization,
                (
                    *capabilities.quantization,
                    *(capabilities.cpu_only_quantization if cpu else ()),
                    *((spec.model.quantization,) if spec.model.quantization else ()),
                ),
                "; or 'auto'",
            ),
            ("serving.speculative", spec.serving.speculative, capabilities.speculative, "; or 'auto'"),
            ("model.quantization", spec.model.quantization, capabilities.checkpoint_quantization, ""),
        )
        if value not in (None, "auto") and value not in supported
    ]
    if spec.serving.quantization in capabilities.cpu_only_quantization and not cpu:
        problems.append(f"serving.quantization {spec.serving.quantization} runs on CPUs only (accelerator.type cpu)")
    block = spec.serving.block_size
    if capabilities.block_sizes is not None and block not in capabilities.block_sizes:
        problems.append(f"serving.blockSize {block}: {runtime} runs {_listed(map(str, capabilities.block_sizes))}")
    if spec.accelerator.type == CPU_TYPE and capabilities.tensor_parallel_sizes != (1,):
        problems.append(f"accelerator.type cpu: {runtime} is planned on GPUs only; runtime kvpilot serves on CPUs")
    count = spec.accelerator.count
    if count is not None and count not in capabilities.tensor_parallel_sizes:
        others = [n for n, r in RUNTIMES.items() if count in r.capabilities.tensor_parallel_sizes]
        problems.append(
            f"accelerator.count {count}: {runtime} runs {_listed(map(str, capabilities.tensor_parallel_sizes))} "
            "GPU(s) per replica" + (f"; runtime: {others[0]} runs tensor parallelism over {count}" if others else "")
        )
    return "; ".join(problems) or None


def _draft(spec: InferenceServiceSpec, target: Architecture, capabilities: EngineCapabilities) -> _Draft | Plan | None:
    """The draft model a plan may run (serving.draftModel, under a mode that may choose it), a
    failed Plan when it cannot be sized or the engine would refuse it, None when there is none."""
    serving = spec.serving
    source = serving.draft_model
    mode = "draft" if serving.speculative == "auto" else serving.speculative
    if source is None or mode not in DRAFTED or mode not in capabilities.speculative:
        return None
    hub = hub_source(source)
    arch = serving.draft_model_architecture or find_model(hub.repo if hub else source.rstrip("/"))
    if arch is None:
        return _failed(
            spec,
            "UnknownDraftModel",
            f"serving.draftModel {source!r} is not a catalog model ({', '.join(MODELS)}) by its "
            "repository or folder name, and serving.draftModelArchitecture is not set: the "
            "planner needs the draft's size",
        )
    problem = sizing.architecture_problem(arch)
    if problem is not None:
        return _failed(spec, "InvalidArchitecture", f"serving.draftModel {source!r}: {problem}")
    if arch.vocab_size != target.vocab_size:
        return _failed(
            spec,
            "DraftVocabularyMismatch",
            f"serving.draftModel {source!r} has a vocabulary of {arch.vocab_size} tokens and "
            f"{spec.model.name} {target.vocab_size}: the engine drafts only with the target's "
            "tokens, so it would refuse this draft",
        )
    return _Draft(source, arch, sizing.weight_bytes(arch, "none"), sizing.kv_bytes_per_token(arch))


def choose_speculative(
    mode: str, *, batch: float, tpot_bound: bool, temperature: float, draft_model: str | None, supported: Sequence[str]
) -> tuple[str, str]:
    """The speculative mode to run and why; `supported` are the engine's modes, and a pinned
    `mode` is one of them (plan() refuses a spec pinning any other)."""
    if mode != "auto":
        return mode, f"{mode}: set in the spec"
    if not set(supported) - {"off"}:
        return "off", f"off: this runtime runs no speculative mode (supported: {_listed(supported)})"
    if batch > SPECULATION_MAX_BATCH:
        return "off", (
            f"off: predicted batch {batch:.1f} per replica > {SPECULATION_MAX_BATCH}, "
            "the device is already busy and speculation has no spare compute to use"
        )
    if temperature >= HIGH_TEMPERATURE:
        return "off", (f"off: temperature {temperature:g} >= {HIGH_TEMPERATURE:g}, drafts are rarely accepted")
    if not tpot_bound:
        return "off", "off: TTFT, not TPOT, is closest to its SLO; speculation only shortens TPOT"
    # A draft model accepts more tokens than prompt-lookup n-grams, when there is one to run.
    proposers = [m for m in (("draft",) if draft_model else ()) + ("ngram",) if m in supported]
    if not proposers:
        return "off", (
            f"off: speculation would pay, but this engine's modes "
            f"({_listed(supported)}) need a serving.draftModel, which is not set"
        )
    return proposers[0], (
        f"{proposers[0]}: predicted batch {batch:.1f} per replica <= "
        f"{SPECULATION_MAX_BATCH}, low temperature and a TPOT-bound SLO"
    )


def _efficiency(gpu: GPU) -> float:
    """The share of its GEMM rate a device's prefill reaches: a spec sheet's peak at the usual
    efficiency, a measured rate as it is."""
    return 1.0 if gpu.measured else sizing.PREFILL_COMPUTE_EFFICIENCY


def computed_prompt_tokens(load: LoadSpec) -> float:
    """The prompt tokens a request's prefill computes: those the prefix cache does not serve
    (load.prefixShare). ASSUMED: the step costs what a prompt of that many tokens does; its
    attention over the cached part is left out (a small share of a prefill at these lengths)."""
    return max(1.0, load.mean_prompt_tokens * (1 - load.prefix_share))


def _prefill_seconds(arch: Architecture, gpu: GPU, quantization: str, tokens: float) -> float:
    """The step that computes a prompt of the served model: as measured where the device measured
    it (a CPU profile's, made for this model), else its GEMMs."""
    measured = gpu.measured_prefill(quantization, tokens)
    return _gemm_prefill_seconds(arch, gpu, quantization, tokens) if measured is None else measured


def _gemm_prefill_seconds(arch: Architecture, gpu: GPU, quantization: str, tokens: float) -> float:
    ops = gpu.matmul_flops(quantization, tokens)
    return sizing.prefill_seconds(arch.parameters_per_token, tokens, ops, _efficiency(gpu))


def _batched_tokens(spec: InferenceServiceSpec, arch: Architecture, gpu: GPU, quantization: str) -> tuple[int, str]:
    """Tokens per engine step, so that a step's prefill chunk leaves room for its decodes."""
    block = spec.serving.block_size
    slo = spec.slo.tpot_p95_ms
    seconds = slo / 1000 * PREFILL_SHARE_OF_TPOT
    ops = gpu.matmul_flops(quantization, MAX_BATCHED_TOKENS)
    raw = int(seconds * ops * _efficiency(gpu) / (2 * arch.parameters_per_token))
    tokens = max(block, min(max(raw, MIN_BATCHED_TOKENS), MAX_BATCHED_TOKENS) // block * block)
    chunk = _ms(_prefill_seconds(arch, gpu, quantization, tokens))
    if raw < MIN_BATCHED_TOKENS:
        return tokens, (
            f"{tokens} tokens per step (the minimum): even this chunk takes {chunk} ms of the {slo:g} ms TPOT SLO"
        )
    if raw > MAX_BATCHED_TOKENS:
        return tokens, (
            f"{tokens} tokens per step (the maximum): a chunk takes {chunk} ms, well within the {slo:g} ms TPOT SLO"
        )
    return tokens, (
        f"{tokens} tokens per step: a prefill chunk that size takes {chunk} ms, "
        f"{PREFILL_SHARE_OF_TPOT:.0%} of the {slo:g} ms TPOT SLO"
    )


def _draft_step_seconds(draft: _Draft, gpu: GPU, running: float, context: float) -> float:
    """One decode step of the draft model for `running` sequences of `context` tokens."""
    return sizing.decode_step_seconds(
        bytes_read=draft.weights - draft.head_copy + running * context * draft.kv_per_token,
        bandwidth=gpu.bandwidth_bytes_per_s,
        parameters_per_token=draft.arch.parameters_per_token,
        batch=running,
        ops_per_s=gpu.matmul_flops("none", running),
        measured=gpu.measured,
    )


def _allreduces_seconds(arch: Architecture, gpu: GPU, tp: int, tokens: float) -> float:
    """The two all-reduces per layer (after attention, after the MLP) of a step over `tokens`."""
    hidden_bytes = tokens * arch.hidden_size * sizing.BYTES_PER_VALUE
    return 2 * arch.layers * sizing.allreduce_seconds(hidden_bytes, tp, gpu.link_bytes_per_s, gpu.link_latency_us / 1e6)


def _step_seconds(replica: _Replica, running: float, context: float, tokens_per_sequence: float = 1) -> float:
    """One decode step of `running` sequences holding `context` tokens each, computing
    `tokens_per_sequence` each on average (1; k + 1 in a speculative verification)."""
    arch, gpu, tp = replica.arch, replica.gpu, replica.tp
    tokens = running * tokens_per_sequence
    # A mixture of experts reads only the experts its tokens route to; a dense model reads all.
    share = min(1.0, tokens * arch.parameters_per_token / arch.parameters)
    kv_bytes = running * context * replica.kv_per_token
    # Where attention was measured (a CPU) it runs after the GEMMs at its own rate; else the KV is
    # read at the bandwidth with the weights. The engine's own work grows with the token rows of the
    # step (a verification's k + 1 per sequence costs what a decode step of as many sequences does).
    attention = kv_bytes / gpu.kv_read_bytes_per_s if gpu.kv_read_bytes_per_s else 0.0
    step = sizing.decode_step_seconds(
        bytes_read=replica.decode_weight_bytes * share + (0.0 if attention else kv_bytes),
        bandwidth=gpu.bandwidth_bytes_per_s,
        parameters_per_token=arch.parameters_per_token,
        batch=tokens,
        ops_per_s=gpu.matmul_flops(replica.quantization, tokens),
        measured=gpu.measured,
        overhead_s=gpu.step_overhead(replica.quantization, tokens) + attention,
    )
    if replica.compiled and running <= 1 and tokens_per_sequence == 1 and gpu.compiled_step_factor:
        return step * gpu.compiled_step_factor  # the engine compiles the step of a lone sequence only
    return step + _allreduces_seconds(arch, gpu, tp, running)


def _perf(spec: InferenceServiceSpec, replica: _Replica, replicas: int, speculative: str) -> _Perf:
    arch, gpu, tp, max_num_seqs = replica.arch, replica.gpu, replica.tp, replica.max_num_seqs
    draft = replica.draft if speculative in DRAFTED else None
    load, computed = spec.load, computed_prompt_tokens(spec.load)
    rate = load.requests_per_second / replicas if replicas else 0.0
    prefill = _prefill_seconds(arch, gpu, replica.quantization, computed)
    prefill += _allreduces_seconds(arch, gpu, tp, computed)
    if draft is not None:
        # The draft computes the prompt too, in the step that samples the first token.
        prefill += _gemm_prefill_seconds(draft.arch, gpu, "none", computed)
    busy = rate * prefill  # share of GPU time spent on prefill
    if busy >= 1:
        return _Perf(
            math.inf, math.inf, math.inf, f"prefill alone needs {busy:.1f}x the GPU at {rate:.2f} req/s per replica"
        )
    context = load.mean_prompt_tokens + load.mean_output_tokens / 2  # mean tokens in cache
    speculating = speculative != "off"
    if speculating:
        k = spec.serving.num_speculative_tokens
        acceptance = _acceptance(gpu, speculative, k)
        # The engine's acceptance window leaves a request that rejects its drafts verifying a few
        # steps of its answer only; `verifying` is that share, 1 where drafts are mostly accepted.
        verifying = speculation.verifying_share(acceptance, k, load.mean_output_tokens - 1)

    def means(batch: float) -> tuple[float, float, float, float]:
        """Mean TTFT and TPOT at a running batch, the plain decode step, and the part of TPOT no
        prefill interrupts."""
        # A sequence decodes beside the `batch` others it finds running (Poisson arrivals see time
        # averages): its steps are of batch + 1.
        running = batch + 1.0
        step = _step_seconds(replica, running, context)
        if replica.compiled:
            # The compiled step runs while the sequence is alone, which it is with probability e^-batch.
            alone = math.exp(-batch)
            step = alone * _step_seconds(replica, 1.0, context) + (1 - alone) * step
        uninterrupted = step
        if speculating and running <= SPECULATION_MAX_BATCH:
            uninterrupted = _speculative_step(replica, draft, running, context, step, k, verifying, acceptance)
        # M/M/1 wait for the prefill server, plus half a step to reach the next step boundary.
        ttft = prefill * busy / (1 - busy) + step / 2 + prefill
        return ttft * gpu.ttft_factor, uninterrupted / (1 - busy) * gpu.tpot_factor, step, uninterrupted

    batch = 0.0
    for _ in range(200):
        ttft, tpot, _, _ = means(batch)
        following = rate * sizing.request_latency(ttft, tpot, load.mean_output_tokens)
        if following > max_num_seqs:
            return _Perf(
                following,
                ttft,
                tpot,
                f"{rate:.2f} req/s per replica keeps {following:.1f}+ sequences running, only {max_num_seqs} fit",
            )
        converged = abs(following - batch) < 1e-3
        batch = following
        if converged:
            break
    _, _, step, uninterrupted = means(batch)
    ttft_p95, tpot_p95 = _p95(prefill, busy, step, uninterrupted, rate, load.mean_output_tokens)
    return _Perf(batch, ttft_p95 * gpu.ttft_factor, tpot_p95 * gpu.tpot_factor, None)


def _speculative_step(
    replica: _Replica,
    draft: _Draft | None,
    running: float,
    context: float,
    step: float,
    k: int,
    verifying: float,
    acceptance: float,
) -> float:
    """Seconds per token of a step in which a share `verifying` of the `running` sequences verifies
    k + 1 tokens, after the draft model's k decode steps for them (`step`: the plain one); each
    verification yields 1 + k x acceptance tokens."""
    gpu = replica.gpu
    drafting = 0.0 if draft is None else verifying * k * _draft_step_seconds(draft, gpu, running, context)
    # A measured device computes the step over its token rows, the verifications' k + 1 each.
    verify = (
        _step_seconds(replica, running, context, 1 + verifying * k)
        if gpu.measured
        else step * (1 + verifying * (VERIFY_OVERHEAD - 1))
    )
    return (verify + drafting) / (1 + verifying * k * acceptance)


def _p95(
    prefill: float, busy: float, step: float, uninterrupted: float, rate: float, output_tokens: int
) -> tuple[float, float]:
    """The 95th percentiles of TTFT and of a request's TPOT (what the SLOs and the engines' reports
    are) around the means the batch is solved with (Little's law takes means).

    TTFT: an arrival waits out the step under way (a whole one at worst) and, at the waiting time's
    95th percentile, the prefills ahead of it: Poisson arrivals, prefills of one length (M/D/1), whose
    tail Kingman's approximation gives as P(wait > t) = busy e^(-2 t (1 - busy) / prefill).
    TPOT: a request's decode of D seconds is interrupted by the prefills of the requests arriving
    meanwhile, Poisson with mean rate x D, their 95th percentile by the normal approximation. D at
    its own 95th percentile is the uninterrupted decode plus those interruptions, which lengthen D
    and so let more arrive: D = c + prefill (rate D + z sqrt(rate D)), c the uninterrupted decode
    (`uninterrupted` seconds per token), a quadratic in sqrt(D). Without the feedback (D taken at
    its mean) the tail came out 1.4-1.75x short where prefills keep the engine 17-40 % busy (int4 on
    CPU, bench/RESULTS.md)."""
    wait = prefill / (2 * (1 - busy)) * math.log(busy / P95_TAIL) if busy > P95_TAIL else 0.0
    steps = max(output_tokens - 1, 1)
    a, b = 1 - busy, prefill * Z_95 * math.sqrt(rate)
    root = (b + math.sqrt(b * b + 4 * a * steps * uninterrupted)) / (2 * a)
    return prefill + wait + step, root * root / steps


def _slo_miss(spec: InferenceServiceSpec, perf: _Perf) -> str | None:
    if perf.overload:
        return perf.overload
    misses = []
    if perf.ttft_s * 1000 > spec.slo.ttft_p95_ms:
        misses.append(f"TTFT {_ms(perf.ttft_s)} ms > {spec.slo.ttft_p95_ms:g} ms")
    if perf.tpot_s * 1000 > spec.slo.tpot_p95_ms:
        misses.append(f"TPOT {_ms(perf.tpot_s)} ms > {spec.slo.tpot_p95_ms:g} ms")
    return "predicted " + ", ".join(misses) if misses else None


def _replicas(spec: InferenceServiceSpec, replica: _Replica, speculative: str) -> tuple[int, _Perf, str | None]:
    """The fewest replicas within the autoscaling bounds that meet the SLO, else the maximum.

    A bisection: more replicas share the same load, so each runs a smaller batch and queues less,
    and a count that meets the SLO is followed by counts that do too. log2(maxReplicas) + 2
    predictions, not one per count."""
    bounds = spec.autoscaling
    if spec.load.requests_per_second == 0:
        count = bounds.min_replicas
        perf = _perf(spec, replica, max(count, 1), speculative)
        return count, perf, _slo_miss(spec, perf)
    low, high = max(bounds.min_replicas, 1), bounds.max_replicas
    most = _perf(spec, replica, high, speculative)
    miss = _slo_miss(spec, most)
    if miss is not None:
        return high, most, miss
    while low < high:  # the SLO is met at `high`; is it at fewer?
        middle = (low + high) // 2
        if _slo_miss(spec, _perf(spec, replica, middle, speculative)) is None:
            high = middle
        else:
            low = middle + 1
    return high, _perf(spec, replica, high, speculative), None


def _sizes(
    spec: InferenceServiceSpec,
    arch: Architecture,
    gpu: GPU,
    quantization: str,
    context: int,
    draft: _Draft | None,
    reserve: int,
    runtime: EngineCapabilities,
) -> _Sizes:
    """What one replica holds: the target's (and the draft's) weights and KV per token, and the KV
    pool left of its GPUs; a pool of 0 when the weights do not fit."""
    draft_weights, draft_kv = (draft.weights, draft.kv_per_token) if draft else (0, 0)
    # The engine gives the draft a KV slot for every slot of the target's, so each slot holds both.
    weights = (
        sizing.weight_bytes(arch, quantization, runtime.quantized_lm_head, gpu.bytes_per_value, gpu.packs_weights)
        + draft_weights
    )
    pool = sizing.kv_pool_bytes(gpu.memory_bytes, spec.serving.gpu_memory_utilization, weights, reserve)
    return _Sizes(
        gpu=gpu.name,
        quantization=quantization,
        weight_bytes=weights,
        draft_weight_bytes=draft_weights,
        kv_bytes_per_token=sizing.kv_bytes_per_token(arch, gpu.bytes_per_value) + draft_kv,
        draft_kv_bytes_per_token=draft_kv,
        checkpoint_bytes=sizing.weight_bytes(arch, spec.model.quantization or "none", runtime.quantized_lm_head),
        kv_pool_bytes=max(pool, 0),
        max_model_len=context,
    )


def _group(gpu: GPU, tp: int) -> GPU:
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


def _memory(
    spec: InferenceServiceSpec,
    arch: Architecture,
    device: tuple[GPU, int],
    quantization: str,
    context: int,
    draft: _Draft | None,
    runtime: EngineCapabilities,
) -> _Memory | Plan:
    """How the memory of a replica's GPUs (a GPU type and the tensor-parallel size) divides at one
    quantization, with a draft model or none: a failed Plan when the weights or one full sequence
    do not fit."""
    # One piece: the numbers and the reasons that quote them (a dozen of them) are made side by side.
    serving = spec.serving
    tp = device[1]
    gpu = _group(*device)
    budget, batching_reason = _batched_tokens(spec, arch, gpu, quantization)
    reserve = sizing.runtime_reserve_bytes(arch, budget) * tp
    sizes = _sizes(spec, arch, gpu, quantization, context, draft, reserve, runtime)
    target_weights, draft_weights = sizes.weight_bytes - sizes.draft_weight_bytes, sizes.draft_weight_bytes
    kv_per_token, draft_kv = sizes.kv_bytes_per_token, sizes.draft_kv_bytes_per_token
    target_kv, pool = kv_per_token - draft_kv, sizes.kv_pool_bytes
    lookahead = serving.num_speculative_tokens if draft else 0
    usable = int(gpu.memory_bytes * serving.gpu_memory_utilization)
    where = (
        f"{serving.gpu_memory_utilization:.0%} of the {_gib(gpu.memory_bytes)} GiB "
        + (f"{tp} x {gpu.name} report" if tp > 1 else f"{gpu.name} reports")
        + f" ({_gib(usable)} GiB)"
    )
    weighed = f"{quantization} weights {_gib(target_weights)} GiB" + (
        f" + draft model weights {_gib(draft_weights)} GiB" if draft else ""
    )
    if pool <= 0:
        # The draft's lookahead slots (the positions it writes ahead of each sequence) count below.
        return _failed(
            spec,
            "WeightsDoNotFit",
            f"{spec.model.name} {weighed} + runtime reserve {_gib(reserve)} GiB exceed {where}",
            sizes,
        )
    drafted = f" with its draft's KV and {lookahead} lookahead slots" if draft else ""
    per_sequence = (
        kv_per_token * sizing.blocks_per_sequence(context + lookahead, serving.block_size) * serving.block_size
    )
    fitting = sizing.sequences_that_fit(pool, kv_per_token, context + lookahead, serving.block_size)
    if fitting == 0:
        return _failed(
            spec,
            "ContextDoesNotFit",
            f"one {context}-token sequence{drafted} needs {_gib(per_sequence)} GiB of KV cache "
            f"but only {_gib(pool)} GiB is left of {where} after {weighed}",
            sizes,
        )
    # Sized for the mean context (prompt + half the output: what a sequence holds on average over its
    # life), as vLLM sizes its batch: the few sequences that grow long are preempted and recomputed.
    mean_context = min(context, math.ceil(spec.load.mean_prompt_tokens + spec.load.mean_output_tokens / 2))
    fitting_mean = sizing.sequences_that_fit(pool, kv_per_token, mean_context + lookahead, serving.block_size)
    max_num_seqs = min(fitting_mean, MAX_NUM_SEQS_CAP)
    kv = f"{kv_per_token / sizing.MiB:.3g} MiB/token" + (
        f" ({target_kv / sizing.MiB:.3g} target + {draft_kv / sizing.MiB:.3g} draft)" if draft else ""
    )
    kv_reason = (
        f"{fitting_mean} sequences at the mean context of {mean_context} tokens (prompt + half "
        f"the output) fit, {fitting} at the full {context}{drafted}; preemption covers sequences "
        f"that grow long: KV {kv}, {_gib(per_sequence)} GiB per full sequence, pool {_gib(pool)} "
        f"GiB = {where} - weights {_gib(target_weights)} GiB"
        + (f" - draft model weights {_gib(draft_weights)} GiB" if draft else "")
        + f" - reserve {_gib(reserve)} GiB"
        + (f"; capped at {MAX_NUM_SEQS_CAP}" if fitting_mean > MAX_NUM_SEQS_CAP else "")
    )
    # A CPU's packed low-bit kernels read the stored weights (a tied head's packed copy in place of
    # the embedding's rows); a GPU may dequantize them first.
    decode_bytes = (
        sizing.weight_bytes(arch, quantization, runtime.quantized_lm_head, gpu.bytes_per_value)
        if gpu.is_cpu
        else sizing.decode_weight_bytes(arch, quantization, runtime)
    )
    replica = _Replica(arch, gpu, tp, decode_bytes, target_kv, quantization, max_num_seqs, draft)
    if gpu.is_cpu:
        replica, sizes, kv_reason = _cpu_batch(spec, replica, sizes, (mean_context, context, lookahead), kv_reason)
    if budget < replica.max_num_seqs:
        # Every running sequence decodes one token per step, so the budget must cover them all.
        budget = replica.max_num_seqs
        batching_reason = f"{budget} tokens per step: one decode token for each of max_num_seqs"
    return _Memory(replica, sizes, budget, batching_reason, mean_context, kv_reason)


def _cpu_batch(
    spec: InferenceServiceSpec, replica: _Replica, sizes: _Sizes, contexts: tuple[int, int, int], kv_reason: str
) -> tuple[_Replica, _Sizes, str]:
    """A CPU replica runs at most the batch whose decode step still meets the TPOT SLO (a larger
    one slows every running sequence past it; the rest wait their turn), and requests memory for the
    KV of that batch, not all of its node's: it holds that many sequences at the mean context, and
    one at the full context."""
    mean_context, context, lookahead = contexts
    slo_s = spec.slo.tpot_p95_ms / 1000
    cap = 1
    while cap < replica.max_num_seqs and _step_seconds(replica, cap + 1, mean_context) <= slo_s:
        cap += 1
    block, kv_per_token = spec.serving.block_size, sizes.kv_bytes_per_token
    blocks = max(
        cap * sizing.blocks_per_sequence(mean_context + lookahead, block),
        sizing.blocks_per_sequence(context + lookahead, block),
    )
    pool = blocks * block * kv_per_token
    step = _step_seconds(replica, cap, mean_context)
    reason = (
        f"{kv_reason}; on a CPU the batch is capped at {cap}, the most whose decode step "
        f"({_ms(step)} ms) stays within the {spec.slo.tpot_p95_ms:g} ms TPOT SLO"
        f"{' (even one sequence misses it)' if step > slo_s else ''}, and the KV pool holds "
        f"{cap} mean and one full sequence: {pool / sizing.MiB:.0f} MiB"
    )
    return replica._replace(max_num_seqs=cap), sizes._replace(kv_pool_bytes=pool), reason


def _speculation(
    spec: InferenceServiceSpec,
    memory: _Memory,
    device: tuple[GPU, int],
    capabilities: EngineCapabilities,
    draft: _Draft | None,
) -> _Speculation:
    """The speculative mode for a replica whose memory is `memory` (sized with the draft when the
    spec pins one), and the replicas it then needs."""
    serving = spec.serving
    k = serving.num_speculative_tokens
    off = _Speculation("off", "", memory, *_replicas(spec, memory.replica, "off"))
    perf = off.perf
    tpot_bound = perf.tpot_s * 1000 / spec.slo.tpot_p95_ms >= perf.ttft_s * 1000 / spec.slo.ttft_p95_ms

    def choose(draft_model: str | None) -> tuple[str, str]:
        return choose_speculative(
            serving.speculative,
            batch=perf.batch,
            tpot_bound=tpot_bound,
            temperature=spec.load.temperature,
            draft_model=draft_model,
            supported=capabilities.speculative,
        )

    mode, reason = choose(draft.source if draft else None)
    if mode == "draft" and serving.speculative != "draft":
        # Chosen for the target alone: the draft's weights and KV must fit beside it too.
        replica = memory.replica
        with_draft = _memory(
            spec, replica.arch, device, memory.sizes.quantization, memory.sizes.max_model_len, draft, capabilities
        )
        if isinstance(with_draft, Plan):
            mode, reason = choose(None)
            reason += f" (the draft model does not fit: {with_draft.reason})"
        else:
            memory = with_draft
    if mode in DRAFTED and draft is not None:
        reason += (
            f"; {'EAGLE head' if mode == 'eagle' else 'draft model'} {draft.source}: {_gib(draft.weights)} GiB of "
            f"weights (unquantized), {draft.kv_per_token / sizing.MiB:.3g} MiB of KV per token; "
            + f"{_acceptance(device[0], mode, k):.2f} of drafts accepted, "
            + (
                "observed (status.correction)"
                if mode in dict(device[0].observed_acceptance)
                else "assumed (not measured)"
            )
        )
    if mode == "off":
        off = off._replace(reason=reason)
    else:
        speculating = _Speculation(mode, reason, memory, *_replicas(spec, memory.replica, mode))
        if serving.speculative != "auto" or not _observed_worse(speculating, off):
            return speculating
        off = off._replace(reason=_observed_reason(speculating, off, k))
    return _compiled(spec, off) if off.memory.replica.gpu.compiled_step_factor else off


def _acceptance(gpu: GPU, mode: str, k: int) -> float:
    """The share of its k drafts a verification keeps, to predict `mode` with: the one observed on
    the service's engines (status.correction) where there is one, else the assumed one."""
    observed = dict(gpu.observed_acceptance)
    return observed[mode] if mode in observed else speculation.assumed_acceptance(mode, k)


def _observed_worse(speculating: _Speculation, off: _Speculation) -> bool:
    """Whether a speculative mode the engines' observed acceptance is known for does no better than
    no speculation: more replicas, or as many and a TPOT no lower."""
    if speculating.mode not in dict(speculating.memory.replica.gpu.observed_acceptance):
        return False
    ranked = ((s.miss is None, -s.replicas, -s.perf.tpot_s) for s in (speculating, off))
    return next(ranked) <= next(ranked)


def _observed_reason(speculating: _Speculation, off: _Speculation, k: int) -> str:
    acceptance = _acceptance(speculating.memory.replica.gpu, speculating.mode, k)
    return (
        f"off: {speculating.mode} would be chosen ({speculating.reason}), but with the acceptance its engines "
        f"reported, {acceptance:.2f} of drafts (status.correction; assumed "
        f"{speculation.assumed_acceptance(speculating.mode, k):.2f}), it "
        f"predicts TPOT {_ms(speculating.perf.tpot_s)} ms at {speculating.replicas} replica(s) against "
        f"{_ms(off.perf.tpot_s)} ms at {off.replicas} without drafts"
    )


def _compiled(spec: InferenceServiceSpec, eager: _Speculation) -> _Speculation:
    """Compiled decoding where the plan's TPOT needs it: when compiling a lone sequence's step (as
    the profile measured it) meets the SLO where eager steps do not, or with fewer replicas, and the
    plain weights the compiled graph reads fit beside the packed ones the eager steps read."""
    replica = eager.memory.replica._replace(compiled=True)
    replicas, perf, miss = _replicas(spec, replica, "off")
    factor = replica.gpu.compiled_step_factor
    if (miss is None, -replicas) <= (eager.miss is None, -eager.replicas):
        return eager
    sizes, plain = _with_plain_weights(spec, eager.memory)
    gain = (
        f"a lone sequence's step x{factor:.2f} of the eager one (the profile's measurement) "
        f"{'meets the SLO' if miss is None else 'comes closest to the SLO'} with {replicas} replica(s) where "
        f"eager steps need {eager.replicas}" + ("" if eager.miss is None else f" and miss it ({eager.miss})")
    )
    if sizes is None:
        return eager._replace(
            compiled=f"off: {gain}, but the plain weights its graph reads, {_gib(plain)} GiB beside the packed "
            f"ones, do not fit the node's {_gib(eager.memory.replica.gpu.memory_bytes)} GiB"
        )
    why = f"on: {gain}"
    if plain:
        why += f"; the compiled graph reads plain weights, {_gib(plain)} GiB beside the packed ones"
    memory = eager.memory._replace(replica=replica, sizes=sizes)
    return _Speculation(eager.mode, eager.reason, memory, replicas, perf, miss, why)


def _with_plain_weights(spec: InferenceServiceSpec, memory: _Memory) -> tuple[_Sizes | None, int]:
    """A replica's sizes with compiled decoding, and the bytes of plain weights it adds: an engine that
    packs its weights for oneDNN keeps the plain ones for the compiled graph (sizing.weight_bytes).
    None where they do not fit in the node's memory beside the KV pool."""
    replica, sizes = memory.replica, memory.sizes
    gpu = replica.gpu
    if not gpu.packs_weights:
        return sizes, 0
    arch, quantization, bpv = replica.arch, sizes.quantization, gpu.bytes_per_value
    plain = sizing.weight_bytes(
        arch, quantization, bytes_per_value=bpv, packed=True, plain_beside_packed=True
    ) - sizing.weight_bytes(arch, quantization, bytes_per_value=bpv, packed=True)
    weights = sizes.weight_bytes + plain
    left = sizing.kv_pool_bytes(
        gpu.memory_bytes,
        spec.serving.gpu_memory_utilization,
        weights,
        sizing.runtime_reserve_bytes(arch, memory.budget),
    )
    if left < sizes.kv_pool_bytes:
        return None, plain
    return sizes._replace(weight_bytes=weights), plain


def _size(
    spec: InferenceServiceSpec,
    arch: Architecture,
    device: tuple[GPU, int],
    quantization: str,
    context: int,
    capabilities: EngineCapabilities,
    draft: _Draft | None,
) -> Plan:
    """The plan for one (GPU type, tensor-parallel size, quantization). The runtime splits a draft
    over the target's GPUs, so a draft whose heads the size does not divide is left out (or, pinned,
    makes the option fail)."""
    gpu, tp = device
    draft = draft.on(gpu) if draft is not None else None
    problem = _heads_problem(draft.arch, tp) if draft is not None else None
    if problem is not None:
        if spec.serving.speculative in DRAFTED:
            failed = _failed(
                spec,
                "NoTensorParallelSize",
                f"serving.draftModel {draft.source}: {problem}, and the runtime splits the draft over the "  # type: ignore[union-attr]
                "target's GPUs",
            )
            return failed.model_copy(update={"gpu": gpu.name, "quantization": quantization, "gpu_count": tp})
        draft = None
    if quantization == "fp8" and not gpu.fp8:
        return _failed(
            spec,
            "UnsupportedOnGPU",
            f"{gpu.name} has no FP8 tensor cores, which quantization fp8 runs on (GPUs with them: "
            f"{', '.join(g.name for g in GPUS.values() if g.fp8)})",
            _sizes(spec, arch, _group(gpu, tp), quantization, context, None, 0, capabilities),
        )
    memory = _memory(
        spec, arch, device, quantization, context, draft if spec.serving.speculative in DRAFTED else None, capabilities
    )
    if isinstance(memory, Plan):
        return memory.model_copy(update={"gpu_count": tp})
    return _fitting_plan(spec, _speculation(spec, memory, device, capabilities, draft))


def _replicas_reason(spec: InferenceServiceSpec, chosen: _Speculation) -> tuple[str, _Perf]:
    """Why this many replicas, and the latencies the plan predicts at them: the model's own, so
    that observed / predicted keeps measuring the model even where the replicas were chosen with
    the observed corrections (a corrected prediction would chase its own correction)."""
    perf, replicas, replica = chosen.perf, chosen.replicas, chosen.memory.replica
    rate = spec.load.requests_per_second
    if chosen.miss is None:
        reason = (
            f"{replicas} replica(s) for {rate:g} req/s: {perf.batch:.1f} running "
            f"sequences each ({replica.max_num_seqs} fit), TTFT {_ms(perf.ttft_s)} ms <= "
            f"{spec.slo.ttft_p95_ms:g} ms, TPOT {_ms(perf.tpot_s)} ms <= "
            f"{spec.slo.tpot_p95_ms:g} ms"
        )
    else:
        reason = f"SLO not met at maxReplicas {replicas} for {rate:g} req/s: {chosen.miss}"
    if spec.load.prefix_share:
        reason += (
            f"; prefill computes {computed_prompt_tokens(spec.load):.0f} of {spec.load.mean_prompt_tokens} prompt "
            f"tokens (load.prefixShare {spec.load.prefix_share:g}: the rest from the prefix cache)"
        )
    if (replica.gpu.ttft_factor, replica.gpu.tpot_factor) == (1.0, 1.0):
        return reason, perf
    reason += (
        f"; latencies corrected by what the engines showed (observed / predicted p95): TTFT x"
        f"{replica.gpu.ttft_factor:.2f}, TPOT x{replica.gpu.tpot_factor:.2f} (status.correction)"
    )
    model = replica.gpu.model_copy(update={"ttft_factor": 1.0, "tpot_factor": 1.0})
    return reason, _perf(spec, replica._replace(gpu=model), replicas, chosen.mode)


def _fitting_plan(spec: InferenceServiceSpec, chosen: _Speculation) -> Plan:
    """The Plan of a pair that fits, from its speculation, memory and replicas."""
    serving, memory, replicas = spec.serving, chosen.memory, chosen.replicas
    sizes, max_num_seqs = memory.sizes, memory.replica.max_num_seqs
    replicas_reason, perf = _replicas_reason(spec, chosen)
    latency = sizing.request_latency(perf.ttft_s, perf.tpot_s, spec.load.mean_output_tokens)
    finite = math.isfinite(perf.tpot_s)
    speculating = chosen.mode != "off"
    return Plan(
        fits=True,
        reason=(
            f"{spec.model.name} on {sizes.gpu} ({sizes.quantization}): {max_num_seqs} sequences of "
            f"{memory.mean_context} tokens on average (up to {sizes.max_model_len}) in a "
            f"{_gib(sizes.kv_pool_bytes)} GiB KV pool; "
            + (
                f"predicted TTFT {_ms(perf.ttft_s)} ms, TPOT {_ms(perf.tpot_s)} ms at {replicas} replica(s)"
                if finite
                else replicas_reason
            )
        ),
        model=spec.model.name,
        runtime=spec.runtime,
        gpu_count=memory.replica.tp,
        speculative=chosen.mode,
        draft_model=serving.draft_model if chosen.mode in DRAFTED else None,
        num_speculative_tokens=serving.num_speculative_tokens if speculating else None,
        compile_decode=memory.replica.compiled,
        assumed_draft_acceptance=(
            round(_acceptance(memory.replica.gpu, chosen.mode, serving.num_speculative_tokens), 4)
            if speculating
            else None
        ),
        assumed_prefix_share=spec.load.prefix_share,
        block_size=serving.block_size,
        gpu_memory_utilization=serving.gpu_memory_utilization,
        kv_blocks=sizes.kv_pool_bytes // (sizes.kv_bytes_per_token * serving.block_size),
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
            "speculative": chosen.reason,
            "replicas": replicas_reason,
            **({"compiledDecode": chosen.compiled} if chosen.compiled else {}),
        },
        **sizes._asdict(),
    )


def _cpu(
    spec: InferenceServiceSpec, arch: Architecture, profiles: Mapping[str, DeviceProfile | str]
) -> tuple[GPU, DeviceProfile] | Plan:
    """The CPU device of accelerator.profile: a built-in profile, else one of `profiles` (the
    operator's profile ConfigMaps; a string says why one could not be read)."""
    name = str(spec.accelerator.profile)
    known = {**cpus.builtin_profiles(), **profiles}
    profile = known.get(name)
    if profile is None:
        return _failed(
            spec,
            "UnknownDeviceProfile",
            f"accelerator.profile {name!r} is neither a built-in profile ({', '.join(cpus.builtin_profiles())}) "
            f"nor a ConfigMap of that name in the operator's namespace with a {cpus.PROFILE_CONFIGMAP_KEY} key",
        )
    if isinstance(profile, str):
        return _failed(spec, "InvalidDeviceProfile", profile)
    device = cpus.cpu_device(profile, arch)
    if isinstance(device, str):
        return _failed(spec, "InvalidDeviceProfile", device)
    return device, profile


def _devices(
    spec: InferenceServiceSpec,
    arch: Architecture,
    available: Iterable[str],
    profiles: Mapping[str, DeviceProfile | str],
    correction: Correction | None,
) -> tuple[list[GPU], tuple[GPU, DeviceProfile] | None] | Plan:
    """The devices to try (the CPU of accelerator.profile, else GPUs), with the service's observed
    corrections, and the CPU with its profile for a CPU plan."""
    cpu = _cpu(spec, arch, profiles) if spec.accelerator.type == CPU_TYPE else None
    if isinstance(cpu, Plan):
        return cpu
    gpus = [cpu[0]] if cpu else _gpus(spec, available)
    if isinstance(gpus, Plan):
        return gpus
    if correction is not None:
        observed = {
            "ttft_factor": correction.ttft,
            "tpot_factor": correction.tpot,
            "observed_acceptance": correction.acceptance,
        }
        gpus = [gpu.model_copy(update=observed) for gpu in gpus]
    return gpus, cpu


def _gpus(spec: InferenceServiceSpec, available: Iterable[str]) -> list[GPU] | Plan:
    wanted = spec.accelerator.type
    if wanted:
        gpu = find_gpu(wanted)
        if gpu is None:
            return _failed(spec, "UnknownGPU", f"GPU type {wanted!r} is not in the catalog ({', '.join(GPUS)})")
        return [gpu]
    found = {gpu.name: gpu for gpu in map(find_gpu, available) if gpu is not None}
    if not found:
        return _failed(
            spec, "NoGPUType", "spec.accelerator.type is not set and no node carries a known GPU product label"
        )
    # Smallest (cheapest) first, so the first that works wastes the least.
    return sorted(found.values(), key=lambda g: (g.memory_gib, g.bandwidth_gbps))


def _architecture(spec: InferenceServiceSpec) -> tuple[Architecture, str] | Plan:
    """The model's architecture and where it comes from, or why it cannot be planned."""
    explicit = spec.model.architecture
    arch = explicit or find_model(spec.model.name)
    if arch is None:
        return _failed(
            spec,
            "UnknownModel",
            f"model {spec.model.name!r} is not in the catalog ({', '.join(MODELS)}) and "
            "spec.model.architecture is not set",
        )
    problem = sizing.architecture_problem(arch)
    if problem is not None:
        where = "spec.model.architecture" if explicit else f"the catalog's {spec.model.name}"
        return _failed(spec, "InvalidArchitecture", f"{where}: {problem}")
    context = spec.serving.max_context_length or arch.max_context
    if context > arch.max_context:
        return _failed(
            spec,
            "ContextTooLong",
            f"maxContextLength {context} exceeds {spec.model.name}'s maximum context {arch.max_context}",
        )
    return arch, "spec.model.architecture" if explicit else f"catalog ({arch.source})"


def _schemes(
    spec: InferenceServiceSpec, capabilities: EngineCapabilities, cpu: GPU | None
) -> tuple[tuple[str, ...], str] | Plan:
    """The quantization schemes to try, least lossy first, and what was left out and why; on a
    CPU also those whose kernels run only there, where its profile measured them."""
    stored = spec.model.quantization
    if stored is not None and spec.serving.quantization not in ("auto", stored):
        return _failed(
            spec,
            "QuantizationMismatch",
            f"the checkpoint is quantized as {stored} (model.quantization): the runtime serves it as "
            f"stored and cannot re-quantize it to serving.quantization {spec.serving.quantization}; "
            f"set serving.quantization to auto or {stored}",
        )
    # On a CPU, only the schemes whose engine steps its profile measured: the others' cost is unknown.
    stepped = dict(cpu.step_overhead_curves) if cpu else {}
    if stored is not None or spec.serving.quantization != "auto":
        pinned = stored or spec.serving.quantization
        if cpu and pinned not in stepped:
            return _failed(
                spec,
                "InvalidDeviceProfile",
                f"{cpu.source} has no engine steps with quantization {pinned} (measured: {_listed(stepped)}): "
                "measure the node type again with `kvpilot profile`",
            )
        return (pinned,), ""
    # Only the schemes the runtime applies on load, and of those only the ones sizing knows the bytes of.
    runs = (
        tuple(s for s in (*capabilities.quantization, *capabilities.cpu_only_quantization) if s in stepped)
        if cpu
        else capabilities.quantization
    )
    schemes = tuple(s for s in QUALITY_ORDER if s in runs)
    if not schemes:
        return _failed(
            spec,
            "UnsupportedByRuntime",
            f"runtime {spec.runtime} runs no quantization scheme the planner can "
            f"size (supported: {_listed(capabilities.quantization)})",
        )
    skipped = [s for s in QUALITY_ORDER if s not in schemes]
    return schemes, (
        f"; not tried: {_listed(skipped)}, which runtime {spec.runtime} does not apply on load "
        f"(supported: {_listed(capabilities.quantization)}"
        + (
            f"; on a CPU whose profile measured them also {_listed(capabilities.cpu_only_quantization)})"
            if capabilities.cpu_only_quantization
            else ")"
        )
        if skipped
        else ""
    )


def _heads_problem(arch: Architecture, tp: int) -> str | None:
    """Why `tp` GPUs cannot split `arch`'s attention, None when its heads divide evenly."""
    if arch.attention_heads % tp or arch.kv_heads % tp:
        return f"TP {tp} does not divide {arch.attention_heads} attention heads and {arch.kv_heads} KV heads"
    return None


def _tensor_parallel_sizes(
    spec: InferenceServiceSpec, arch: Architecture, gpu: GPU, capabilities: EngineCapabilities, per_node: int | None
) -> tuple[list[int], str]:
    """The tensor-parallel sizes to try on `gpu`, smallest first, and what rules the others out:
    the runtime's sizes (or the pinned accelerator.count), within one node (the most GPUs the
    cluster's nodes of the type carry, else the catalog's), dividing the heads."""
    sizes = [spec.accelerator.count] if spec.accelerator.count else list(capabilities.tensor_parallel_sizes)
    most, where = (per_node, "the cluster's nodes carry") if per_node else (gpu.max_per_node, "a node holds")
    usable, ruled_out = [], []
    for tp in sizes:
        if tp > most:
            ruled_out.append(f"TP {tp} > the {most} {gpu.name} GPUs {where}")
        elif _heads_problem(arch, tp):
            ruled_out.append(str(_heads_problem(arch, tp)))
        else:
            usable.append(tp)
    return usable, "; ".join(ruled_out)


def _tp_reason(spec: InferenceServiceSpec, chosen: Plan, smaller: Sequence[Plan], ruled_out: str) -> str:
    """Why this many GPUs per replica, and why not fewer."""
    tp = chosen.gpu_count
    if spec.accelerator.count:
        return f"{tp}: set in the spec (accelerator.count)"
    sizes = ", ".join(map(str, RUNTIMES[spec.runtime].capabilities.tensor_parallel_sizes))
    why = "fits and meets the SLO" if chosen.meets_slo else "fits"
    text = f"{tp}: the smallest of runtime {spec.runtime}'s sizes ({sizes}) on {chosen.gpu} that {why}"
    if tp > 1:
        text += f", over {find_gpu(str(chosen.gpu)).link}"  # type: ignore[union-attr]
    rejected = [f"TP {o.gpu_count}: {o.reason if not o.fits else o.reasons['replicas']}" for o in smaller]
    return text + (f" (rejected {'; '.join(rejected)})" if rejected else "") + (f"; {ruled_out}" if ruled_out else "")


def _choice_reasons(
    spec: InferenceServiceSpec, chosen: Plan, rejected: Sequence[Plan], gpus: Sequence[GPU], not_run: str
) -> dict[str, str]:
    """Why this quantization and this GPU: what was tried before the chosen option and why not."""
    passed = [
        f"{o.gpu}/{o.quantization}/TP {o.gpu_count}: {o.reason if not o.fits else o.reasons['replicas']}"
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
    spec: InferenceServiceSpec,
    arch: Architecture,
    gpus: Sequence[GPU],
    schemes: Sequence[str],
    capabilities: EngineCapabilities,
    draft: _Draft | None,
    per_node: Mapping[str, int],
) -> tuple[list[Plan], dict[str, str]]:
    """A plan for every GPU type, scheme and tensor-parallel size, in the order of preference
    (cheapest GPU, least lossy scheme, fewest GPUs per replica), and per GPU type the sizes ruled out."""
    context = spec.serving.max_context_length or arch.max_context
    options: list[Plan] = []
    ruled_out: dict[str, str] = {}
    for gpu in gpus:
        sizes, ruled_out[gpu.name] = _tensor_parallel_sizes(spec, arch, gpu, capabilities, per_node.get(gpu.name))
        if not sizes:
            options.append(
                _failed(spec, "NoTensorParallelSize", f"{spec.model.name} on {gpu.name}: {ruled_out[gpu.name]}")
            )
        options += [_size(spec, arch, (gpu, tp), q, context, capabilities, draft) for q in schemes for tp in sizes]
    return options, ruled_out


def plan_with(spec: InferenceServiceSpec, context: PlanContext) -> Plan:
    available_gpus, capabilities = context.available_gpus, context.capabilities
    gpus_per_node, device_profiles, correction = context.gpus_per_node, context.device_profiles, context.correction
    capabilities = capabilities or RUNTIMES[spec.runtime].capabilities
    unsupported = _unsupported_pins(spec, capabilities)
    if unsupported:
        # No GPU or model changes what the runtime can run: say so before anything else.
        return _failed(spec, "UnsupportedByRuntime", unsupported)
    found = _architecture(spec)
    if isinstance(found, Plan):
        return found
    arch, model_reason = found
    devices = _devices(spec, arch, available_gpus, device_profiles or {}, correction)
    if isinstance(devices, Plan):
        return devices
    gpus, cpu = devices
    draft = _draft(spec, arch, capabilities)
    if isinstance(draft, Plan):
        return draft
    tried = _schemes(spec, capabilities, cpu[0] if cpu else None)
    if isinstance(tried, Plan):
        return tried
    schemes, not_run = tried
    per_node: dict[str, int] = {}
    for product, count in (gpus_per_node or {}).items():
        known = find_gpu(product)
        if known is not None and count > 0:
            per_node[known.name] = max(per_node.get(known.name, 0), count)
    options, ruled_out = _options(spec, arch, gpus, schemes, capabilities, draft, per_node)
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
        **_choice_reasons(spec, chosen, earlier, gpus, not_run),
        "tensorParallel": _tp_reason(spec, chosen, smaller, ruled_out[str(chosen.gpu)]),
        **chosen.reasons,
    }
    return chosen.model_copy(update={"reasons": reasons, **_cpu_fields(cpu, reasons)})


def _cpu_fields(cpu: tuple[GPU, DeviceProfile] | None, reasons: dict[str, str]) -> dict[str, object]:
    """What a CPU plan adds: its profile, the CPUs a replica requests, and what the profile measured."""
    if cpu is None:
        return {}
    device, profile = cpu
    reasons["gpu"] += f"; {cpus.describe(profile)}"
    return {"device_profile": profile.name, "cpus": device.cpus}
