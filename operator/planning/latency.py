"""How fast a replica serves: prefill and decode steps, the batch the load keeps running, the TTFT and
TPOT percentiles the SLO is checked against, and the fewest replicas that meet it."""

from __future__ import annotations

import math
from typing import NamedTuple

from kvpilot.engine.contract.config import SPECULATIVE_MAX_BATCH_SIZE
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec, LoadSpec
from kvpilot.operator.planning import sizing, speculation
from kvpilot.operator.planning.context import Correction
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.reasons import ms
from kvpilot.operator.planning.replica import DRAFTED, Draft, Replica

# Speculation spends compute that decode leaves idle (decode is bandwidth-bound at small batch),
# and drafts are accepted mostly when sampling is near-greedy: it pays at small batch and low
# temperature. The engine stops speculating above this running batch, and predictions do too.
SPECULATION_MAX_BATCH = SPECULATIVE_MAX_BATCH_SIZE


VERIFY_OVERHEAD = 1.15


# Predictions are 95th percentiles (p95): the tail share and the normal quantile of 0.95.
P95_TAIL = 0.05


Z_95 = 1.645


# A prefill chunk may use this share of the TPOT SLO; the rest is the decode work of the step.
PREFILL_SHARE_OF_TPOT = 0.5


# Token budget per step: at least enough to prefill a few blocks per step, at most what the
# activation reserve is sized for without dominating small GPUs.
MIN_BATCHED_TOKENS = 256


MAX_BATCHED_TOKENS = 8192


# What a GPU's engine (vLLM) spends beside the arithmetic and the reads a spec sheet times, ASSUMED
# from public measurements (bench/latency_calibration.py, bench/RESULTS.md: chosen on its fit points,
# checked on the held-out ones). Every step: scheduling, preparing the inputs, sampling and handing
# the tokens out, ~1 ms even with the next step scheduled while one runs. Every layer of every step:
# under CUDA graphs a layer still runs ~10 kernels (norms, QKV, RoPE, attention, output, MLP), each
# with a floor of a few microseconds whatever its size. Qwen3-1.7B on an A100 decodes a lone
# sequence in 4.6 ms where its weights take 3.3 ms to read (28 layers); gpt-oss-120b on 8 H100s at
# 4 sequences in 3.7 ms where its experts' reads and all-reduces take 1.3 ms (36 layers).
GPU_STEP_OVERHEAD_S = 1e-3
GPU_LAYER_OVERHEAD_S = 25e-6
# A request's own cost before its first token beside its prefill: the HTTP request, tokenizing and
# templating the prompt, scheduling it, detokenizing and streaming the token: a lone 128-token
# prompt of Qwen3-1.7B on an A100 comes back in 11.4 ms, of which its prefill step is ~6 ms.
GPU_REQUEST_OVERHEAD_S = 5e-3
# Every running sequence in every step: the scheduler's bookkeeping, its rows of the inputs, its
# sampling and output, in Python per request. Without it TPOT's ratio to the published one fell as
# concurrency rose (1.11 at 2 to 0.88 at 32 sequences of Qwen2.5-0.5B on an L4; 0.85 at 50 of
# Qwen2-7B on an A100); 20 us brings those to 1.11 / 0.95 / 0.87 and gpt-oss-120b at 64 on 8 H100s
# from 0.85 to 1.00.
GPU_SEQUENCE_OVERHEAD_S = 20e-6
# The share of the dense peak a step's arithmetic reaches. GEMMs of a few hundred rows reach about
# half (tile and wave quantisation, short kernels); from a few thousand rows they reach ~70 %, as
# large prompts on A100s and H100s are published (Qwen2.5-72B's 4-8k-token prompts on 2 H100s at
# 58-60 %: 1.23-1.26x too slow at a flat 50 %). Attention's QK^T and PV stay at half.
GPU_ATTENTION_EFFICIENCY = 0.5
GEMM_EFFICIENCY_LOW, GEMM_EFFICIENCY_HIGH = 0.5, 0.7
GEMM_TOKENS_LOW, GEMM_TOKENS_HIGH = 512, 4096


def gemm_efficiency(tokens: float) -> float:
    """The share of its dense peak a GPU's GEMMs reach over `tokens` rows: GEMM_EFFICIENCY_LOW up to
    GEMM_TOKENS_LOW rows, rising with the rows' logarithm to GEMM_EFFICIENCY_HIGH at GEMM_TOKENS_HIGH."""
    if tokens <= GEMM_TOKENS_LOW:
        return GEMM_EFFICIENCY_LOW
    if tokens >= GEMM_TOKENS_HIGH:
        return GEMM_EFFICIENCY_HIGH
    share = math.log(tokens / GEMM_TOKENS_LOW) / math.log(GEMM_TOKENS_HIGH / GEMM_TOKENS_LOW)
    return GEMM_EFFICIENCY_LOW + share * (GEMM_EFFICIENCY_HIGH - GEMM_EFFICIENCY_LOW)


# A replica's capacity is found to this many requests per second (or 0.1 %), and is reported as at most the
# other (no replica of any catalog device serves a million requests a second).
CAPACITY_PRECISION_RPS = 0.001


MAX_CAPACITY_RPS = 1e6


class Prefills(NamedTuple):
    """The prompts' work as a queue: seconds one takes, the share of the device they keep busy, and
    their arrival rate per second."""

    seconds: float
    busy: float
    rate: float


class Drafting(NamedTuple):
    """How a speculative mode verifies: its draft model (None: drafts need none), the k drafted
    tokens, the share of sequences verifying, and the share of drafts accepted."""

    draft: Draft | None
    k: int
    verifying: float
    acceptance: float


class Perf(NamedTuple):
    batch: float  # concurrent sequences per replica (Little's law)
    ttft_s: float
    tpot_s: float
    overload: str | None  # why the replica cannot keep up, None when it can


def _efficiency(gpu: Device) -> float:
    """The share of its GEMM rate a device's prefill reaches: a spec sheet's peak at the usual
    efficiency, a measured rate as it is."""
    return 1.0 if gpu.measured is not None else sizing.PREFILL_COMPUTE_EFFICIENCY


def computed_prompt_tokens(load: LoadSpec) -> float:
    """The prompt tokens a request's prefill computes: those the prefix cache does not serve
    (load.prefixShare). ASSUMED: the step costs what a prompt of that many tokens does; its
    attention over the cached part is left out (a small share of a prefill at these lengths)."""
    return max(1.0, load.mean_prompt_tokens * (1 - load.prefix_share))


def _prefill_seconds(arch: Architecture, gpu: Device, quantization: str, tokens: float) -> float:
    """The step that computes a prompt of the served model: as measured where the device measured
    it (a CPU profile's, made for this model), else its GEMMs."""
    measured = gpu.measured_prefill(quantization, tokens)
    return _gemm_prefill_seconds(arch, gpu, quantization, tokens) if measured is None else measured


def _gemm_prefill_seconds(arch: Architecture, gpu: Device, quantization: str, tokens: float) -> float:
    ops = gpu.matmul_flops(quantization, tokens)
    return sizing.prefill_seconds(arch.parameters_per_token, tokens, ops, _efficiency(gpu))


def batched_tokens(spec: InferenceServiceSpec, arch: Architecture, gpu: Device, quantization: str) -> tuple[int, str]:
    """Tokens per engine step, so that a step's prefill chunk leaves room for its decodes."""
    block = spec.serving.block_size
    slo = spec.slo.tpot_p95_ms
    seconds = slo / 1000 * PREFILL_SHARE_OF_TPOT
    ops = gpu.matmul_flops(quantization, MAX_BATCHED_TOKENS)
    raw = int(seconds * ops * _efficiency(gpu) / (2 * arch.parameters_per_token))
    tokens = max(block, min(max(raw, MIN_BATCHED_TOKENS), MAX_BATCHED_TOKENS) // block * block)
    chunk = ms(_prefill_seconds(arch, gpu, quantization, tokens))
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


def _rates(gpu: Device, quantization: str, tokens: float) -> sizing.Rates:
    """The device's bandwidth and GEMM rate for a step of `tokens` rows at `quantization`."""
    return sizing.Rates(gpu.bandwidth_bytes_per_s, gpu.matmul_flops(quantization, tokens), gpu.measured is not None)


def _draft_step_seconds(draft: Draft, gpu: Device, running: float, context: float) -> float:
    """One decode step of the draft model for `running` sequences of `context` tokens: the weights
    its tokens route to (as the target's step), with the target's values it computes with too (MTP
    modules' LM head, 16-bit in vLLM)."""
    share = min(1.0, running * draft.arch.parameters_per_token / draft.arch.parameters)
    return sizing.decode_step_seconds(
        (draft.weights - draft.head_copy) * share
        + draft.shared_values * sizing.BYTES_PER_VALUE
        + running * context * draft.kv_per_token,
        draft.arch.parameters_per_token + draft.shared_values,
        running,
        _rates(gpu, "none", running),
    )


def _allreduces_seconds(arch: Architecture, gpu: Device, tp: int, tokens: float) -> float:
    """The two all-reduces per layer (after attention, after the MLP) of a step over `tokens`."""
    hidden_bytes = tokens * arch.hidden_size * sizing.BYTES_PER_VALUE
    return 2 * arch.layers * sizing.allreduce_seconds(hidden_bytes, tp, gpu.link_bytes_per_s, gpu.link_latency_us / 1e6)


def gpu_overhead_seconds(arch: Architecture, running: float = 0.0) -> float:
    """The engine's own time in one step on a GPU of `running` decoding sequences, beside the step's
    reads and arithmetic."""
    return GPU_STEP_OVERHEAD_S + arch.layers * GPU_LAYER_OVERHEAD_S + running * GPU_SEQUENCE_OVERHEAD_S


def _layer_tokens(arch: Architecture, attended: float) -> tuple[float, float]:
    """The tokens the full-attention layers together attend to where each attends to `attended`, and
    the local layers' together (a hybrid's state layers attend to nothing): a sliding layer to its
    window at most, a chunked one to the tokens since its chunk began, half a chunk on average once
    past the first. A layer that reads another's K and V (Gemma 4) attends all the same; a sparse-attention
    layer to the indexer's topK at most."""
    full = (arch.attention_layer_count - arch.windowed_layers) * (
        min(attended, arch.indexer.top_k) if arch.indexer is not None else attended
    )
    window = arch.sliding_window
    if window is None:
        return full, 0.0
    local = (attended if attended < window else window / 2) if arch.chunked else min(attended, window)
    return full, arch.windowed_layers * local


def _attention_flops(arch: Architecture, tokens: float, attended: float, indexers: int = 1) -> float:
    """Attention's arithmetic for `tokens` rows attending to `attended` tokens each on average: QK^T
    and PV, 2 x 2 FLOPs per head dimension and attended token in every layer (_layer_tokens; Gemma
    4's full-attention heads are wider), and a sparse-attention indexer's scores of every token before
    each row, 2 FLOPs per index head dimension in each of its layers, computed `indexers` times (a
    decode's on every GPU of the group: vLLM replicates the indexer and shards only prefill rows)."""
    full, local = _layer_tokens(arch, attended)
    indexing = 2 * arch.indexer.heads * arch.indexer.head_dim * arch.indexer.layers * attended if arch.indexer else 0
    heads = 4 * arch.attention_heads * (arch.full_kv_shape[1] * full + arch.head_size * local)
    return tokens * (heads + indexers * indexing)


def _kv_read_bytes(replica: Replica, context: float) -> float:
    """The K and V one decoding sequence of `context` tokens reads in a step: its tokens' in every
    full-attention layer, its window's or chunk's in a local one (_layer_tokens), each layer's K and
    V as wide as its kind's, in the replica's cache dtype and over its GPUs (kv_per_token); under sparse
    attention, the topK tokens' latents and every token's indexer keys."""
    arch = replica.arch
    keys = sizing.indexer_bytes_per_token(arch, replica.tp)
    cached = sizing.kv_bytes_per_token(arch) - sizing.indexer_bytes_per_token(arch)
    if not cached:
        return 0.0
    full, local = _layer_tokens(arch, context)
    full_bytes, local_bytes = sizing.layer_kv_bytes(arch)
    return (replica.kv_per_token - keys) * (full * full_bytes + local * local_bytes) / cached + keys * context


def _multiplied(arch: Architecture) -> int:
    """The parameters a token is multiplied by: those it routes to but lookup tables beside the
    embedding (Gemma 4's per-layer embeddings)."""
    return arch.parameters_per_token - (arch.lookup_parameters or 0)


def _prompt_parameters(arch: Architecture) -> int:
    """The parameters a prompt token is multiplied by: those it routes to but the embedding (a
    lookup) and the LM head, which a prefill runs for the prompt's last token only."""
    embedding = arch.vocab_size * arch.hidden_size
    return max(_multiplied(arch) - embedding - (0 if arch.tie_word_embeddings else embedding), 1)


def gpu_step_seconds(
    replica: Replica, decoding: tuple[float, float], prefilling: tuple[float, float] = (0.0, 0.0)
) -> float:
    """One engine step on a GPU: `decoding` (sequences, the tokens each holds) compute a token each,
    beside `prefilling` (prompt tokens, the tokens each attends to on average: chunked prefill puts
    both in one step). It reads the weights its tokens route to (all of a dense model's) and the
    decoding sequences' KV, multiplies 2 FLOPs per parameter and token plus attention's, and takes
    the slower of the two (reads at 80 % of the bandwidth, GEMMs at gemm_efficiency of the step's rows,
    attention at half the peak), then the engine's own time (per step, layer and decoding sequence)
    and the all-reduces."""
    arch, gpu = replica.arch, replica.gpu
    (running, context), (prompt_tokens, attended) = decoding, prefilling
    tokens = running + prompt_tokens
    share = min(1.0, tokens * arch.parameters_per_token / arch.parameters)
    kv_bytes = running * (_kv_read_bytes(replica, context) + 2 * replica.state_per_sequence)
    # A lookup table beside the embedding is read a row per token, not whole.
    lookups = (arch.lookup_parameters or 0) * sizing.BYTES_PER_VALUE
    reads = (replica.decode_weight_bytes - lookups) * share + kv_bytes
    head = 2 * arch.vocab_size * arch.hidden_size if prompt_tokens else 0.0  # the prompt's last token's logits
    gemms = 2 * _multiplied(arch) * running + 2 * _prompt_parameters(arch) * prompt_tokens + head
    attention = _attention_flops(arch, running, context, replica.tp) + _attention_flops(arch, prompt_tokens, attended)
    peak = gpu.matmul_flops(replica.quantization, tokens)
    memory = reads / (gpu.bandwidth_bytes_per_s * sizing.DECODE_BANDWIDTH_EFFICIENCY)
    compute = gemms / (peak * gemm_efficiency(tokens)) + attention / (peak * GPU_ATTENTION_EFFICIENCY)
    overhead = gpu_overhead_seconds(arch, running)
    return max(memory, compute) + overhead + _allreduces_seconds(arch, gpu, replica.tp, tokens)


def at_concurrency(
    replica: Replica, lengths: tuple[int, float], concurrency: int, batched_tokens: int
) -> tuple[float, float]:
    """Mean TTFT and TPOT on a GPU in a benchmark's closed loop: `concurrency` clients each sending a
    request of `lengths` (prompt, output tokens) as soon as its previous one ends, as `vllm bench
    serve --max-concurrency` does with fixed lengths.

    Requests of one length started together stay in step: they finish on the same step, and the
    next `concurrency` arrive together (a wave). The wave's prompts are prefilled first come first
    served, `batched_tokens` per step (beside the decodes of those already past their prompts), so
    the k-th first token waits for k prompts: on average (c + 1) / 2. After its first token a request
    decodes one token per step, through the prefill steps of the wave's later prompts ((c - 1) / 2 on
    average) and then the wave's plain decode steps: those interruptions are what TPOT gains at high
    concurrency."""
    prompt, output = lengths
    c = concurrency
    decode = gpu_step_seconds(replica, (c, prompt + output / 2))
    chunk = min(batched_tokens, c * prompt)
    prefill = gpu_step_seconds(replica, ((c - 1) / 2, prompt), (chunk, prompt / 2))
    per_prompt = prefill * prompt / chunk
    ttft = GPU_REQUEST_OVERHEAD_S + per_prompt * (c + 1) / 2
    steps = max(output - 1, 1.0)
    interrupted = min((c - 1) / 2 * prompt / chunk, steps)
    return ttft, (interrupted * prefill + (steps - interrupted) * decode) / steps


def step_seconds(replica: Replica, running: float, context: float, tokens_per_sequence: float = 1) -> float:
    """One decode step of `running` sequences holding `context` tokens each, computing
    `tokens_per_sequence` each on average (1; k + 1 in a speculative verification)."""
    arch, gpu, tp = replica.arch, replica.gpu, replica.tp
    if gpu.measured is None:
        extra = running * (tokens_per_sequence - 1)  # a verification's drafted rows, at the context too
        return gpu_step_seconds(replica, (running, context), (extra, context))
    tokens = running * tokens_per_sequence
    # A mixture of experts reads only the experts its tokens route to; a dense model reads all.
    share = min(1.0, tokens * arch.parameters_per_token / arch.parameters)
    # A hybrid's state layers read each running sequence's state and write it back (0 for other models).
    kv_bytes = running * context * replica.kv_per_token + running * 2 * replica.state_per_sequence
    # Where attention was measured (a CPU) it runs after the GEMMs at its own rate; else the KV is
    # read at the bandwidth with the weights. The engine's own work grows with the token rows of the
    # step (a verification's k + 1 per sequence costs what a decode step of as many sequences does).
    attention = kv_bytes / gpu.kv_read_bytes_per_s if gpu.kv_read_bytes_per_s else 0.0
    step = sizing.decode_step_seconds(
        replica.decode_weight_bytes * share + (0.0 if attention else kv_bytes),
        arch.parameters_per_token,
        tokens,
        _rates(gpu, replica.quantization, tokens),
        overhead_s=gpu.step_overhead(replica.quantization, tokens) + attention,
    )
    if replica.compiled and running <= 1 and tokens_per_sequence == 1 and gpu.compiled_step_factor:
        return step * gpu.compiled_step_factor  # the engine compiles the step of a lone sequence only
    return step + _allreduces_seconds(arch, gpu, tp, running)


def _drafting(spec: InferenceServiceSpec, replica: Replica, speculative: str) -> Drafting | None:
    """How a speculating replica drafts, None when it does not."""
    if speculative == "off":
        return None
    k, output_tokens = spec.serving.num_speculative_tokens, spec.load.mean_output_tokens
    acceptance = draft_acceptance(replica.correction, speculative, k)
    # The engine's acceptance window leaves a request that rejects its drafts verifying a few
    # steps of its answer only; `verifying` is that share, 1 where drafts are mostly accepted.
    draft = replica.draft if speculative in DRAFTED else None
    return Drafting(draft, k, speculation.verifying_share(acceptance, k, output_tokens - 1), acceptance)


def _request_prefill_seconds(replica: Replica, load: LoadSpec, computed: float) -> float:
    """The step that computes a request's `computed` prompt tokens (the rest from the prefix cache,
    which they attend to)."""
    arch, gpu = replica.arch, replica.gpu
    if gpu.measured is None:
        return gpu_step_seconds(replica, (0.0, 0.0), (computed, load.mean_prompt_tokens - computed / 2))
    prefill = _prefill_seconds(arch, gpu, replica.quantization, computed)
    return prefill + _allreduces_seconds(arch, gpu, replica.tp, computed)


def predict(spec: InferenceServiceSpec, replica: Replica, replicas: int, speculative: str) -> Perf:
    """The running batch and p95 TTFT and TPOT of one of `replicas` replicas at the spec's load, or
    (Perf.overload) why that load does not fit it."""
    gpu, max_num_seqs = replica.gpu, replica.max_num_seqs
    correction = replica.correction
    draft = replica.draft if speculative in DRAFTED else None
    load, computed = spec.load, computed_prompt_tokens(spec.load)
    rate = load.requests_per_second / replicas if replicas else 0.0
    prefill = _request_prefill_seconds(replica, load, computed)
    # The server's own work on a request (GPU_REQUEST_OVERHEAD_S) runs beside the GPU's steps.
    request = GPU_REQUEST_OVERHEAD_S if gpu.measured is None else 0.0
    if draft is not None:
        # The draft computes the prompt too, in the step that samples the first token.
        prefill += _gemm_prefill_seconds(draft.arch, gpu, "none", computed)
    busy = rate * prefill  # share of GPU time spent on prefill
    if busy >= 1:
        return Perf(
            math.inf, math.inf, math.inf, f"prefill alone needs {busy:.1f}x the GPU at {rate:.2f} req/s per replica"
        )
    context = load.mean_prompt_tokens + load.mean_output_tokens / 2  # mean tokens in cache
    drafting = _drafting(spec, replica, speculative)

    def means(batch: float) -> tuple[float, float, float, float]:
        """Mean TTFT and TPOT at a running batch, the plain decode step, and the part of TPOT no
        prefill interrupts."""
        # A sequence decodes beside the `batch` others it finds running (Poisson arrivals see time
        # averages): its steps are of batch + 1.
        running = batch + 1.0
        step = step_seconds(replica, running, context)
        if replica.compiled:
            # The compiled step runs while the sequence is alone, which it is with probability e^-batch.
            alone = math.exp(-batch)
            step = alone * step_seconds(replica, 1.0, context) + (1 - alone) * step
        uninterrupted = step
        if drafting is not None and running <= SPECULATION_MAX_BATCH:
            uninterrupted = _speculative_step(replica, (running, context), step, drafting)
        # M/M/1 wait for the prefill server, plus half a step to reach the next step boundary.
        ttft = prefill * busy / (1 - busy) + step / 2 + prefill + request
        return ttft * correction.ttft, uninterrupted / (1 - busy) * correction.tpot, step, uninterrupted

    batch = 0.0
    for _ in range(200):
        ttft, tpot, _, _ = means(batch)
        following = rate * sizing.request_latency(ttft, tpot, load.mean_output_tokens)
        if following > max_num_seqs:
            return Perf(
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
    ttft_p95, tpot_p95 = p95(Prefills(prefill, busy, rate), step, uninterrupted, load.mean_output_tokens)
    return Perf(batch, (ttft_p95 + request) * correction.ttft, tpot_p95 * correction.tpot, None)


def _speculative_step(replica: Replica, batch: tuple[float, float], step: float, drafting: Drafting) -> float:
    """Seconds per token of a step in which a share `verifying` of the `running` sequences (of
    `context` tokens: the batch) verifies k + 1 tokens, after the draft model's k decode steps for
    them (`step`: the plain one); each verification yields 1 + k x acceptance tokens."""
    gpu, (running, context) = replica.gpu, batch
    draft, k, verifying, acceptance = drafting
    drafting = 0.0 if draft is None else verifying * k * _draft_step_seconds(draft, gpu, running, context)
    # A measured device computes the step over its token rows, the verifications' k + 1 each.
    verify = (
        step_seconds(replica, running, context, 1 + verifying * k)
        if gpu.measured is not None
        else step * (1 + verifying * (VERIFY_OVERHEAD - 1))
    )
    return (verify + drafting) / (1 + verifying * k * acceptance)


def p95(prefills: Prefills, step: float, uninterrupted: float, output_tokens: int) -> tuple[float, float]:
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
    prefill, busy, rate = prefills
    wait = prefill / (2 * (1 - busy)) * math.log(busy / P95_TAIL) if busy > P95_TAIL else 0.0
    steps = max(output_tokens - 1, 1)
    a, b = 1 - busy, prefill * Z_95 * math.sqrt(rate)
    root = (b + math.sqrt(b * b + 4 * a * steps * uninterrupted)) / (2 * a)
    return prefill + wait + step, root * root / steps


def _slo_miss(spec: InferenceServiceSpec, perf: Perf) -> str | None:
    if perf.overload:
        return perf.overload
    misses = []
    if perf.ttft_s * 1000 > spec.slo.ttft_p95_ms:
        misses.append(f"TTFT {ms(perf.ttft_s)} ms > {spec.slo.ttft_p95_ms:g} ms")
    if perf.tpot_s * 1000 > spec.slo.tpot_p95_ms:
        misses.append(f"TPOT {ms(perf.tpot_s)} ms > {spec.slo.tpot_p95_ms:g} ms")
    return "predicted " + ", ".join(misses) if misses else None


def fewest_replicas(spec: InferenceServiceSpec, replica: Replica, speculative: str) -> tuple[int, Perf, str | None]:
    """The fewest replicas within the autoscaling bounds that meet the SLO, else the maximum.

    A bisection: more replicas share the same load, so each runs a smaller batch and queues less,
    and a count that meets the SLO is followed by counts that do too. log2(maxReplicas) + 2
    predictions, not one per count."""
    bounds = spec.autoscaling
    if spec.load.requests_per_second == 0:
        count = bounds.min_replicas
        perf = predict(spec, replica, max(count, 1), speculative)
        return count, perf, _slo_miss(spec, perf)
    low, high = max(bounds.min_replicas, 1), bounds.max_replicas
    most = predict(spec, replica, high, speculative)
    miss = _slo_miss(spec, most)
    if miss is not None:
        return high, most, miss
    while low < high:  # the SLO is met at `high`; is it at fewer?
        middle = (low + high) // 2
        if _slo_miss(spec, predict(spec, replica, middle, speculative)) is None:
            high = middle
        else:
            low = middle + 1
    return high, predict(spec, replica, high, speculative), None


def capacity_rps(spec: InferenceServiceSpec, replica: Replica, speculative: str) -> float:
    """The most requests per second one replica serves within the SLO at the spec's request shape,
    to 0.1 % or a thousandth of a request (0.0 when even a lone request misses it): what mixed pools share the load by.

    predict sees the load only as the rate per replica, so n replicas meet the SLO at a rate R
    exactly when R / n <= this capacity. Doubling, then bisecting: ~20 predictions."""

    def meets(rate: float) -> bool:
        at_rate = spec.model_copy(update={"load": spec.load.model_copy(update={"requests_per_second": rate})})
        return _slo_miss(at_rate, predict(at_rate, replica, 1, speculative)) is None

    low, high = 0.0, 0.125
    while meets(high):
        low, high = high, high * 2
        if high > MAX_CAPACITY_RPS:
            return MAX_CAPACITY_RPS
    while high - low > max(CAPACITY_PRECISION_RPS, low / 1000):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return math.floor(low / CAPACITY_PRECISION_RPS) * CAPACITY_PRECISION_RPS


def draft_acceptance(correction: Correction, mode: str, k: int) -> float:
    """The share of its k drafts a verification keeps, to predict `mode` with: the one observed on
    the service's engines (status.correction) where there is one, else the assumed one."""
    observed = dict(correction.acceptance)
    return observed[mode] if mode in observed else speculation.assumed_acceptance(mode, k)
