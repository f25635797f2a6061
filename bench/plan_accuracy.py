"""Plan accuracy on a CPU or an NVIDIA GPU: the planner's predicted p95 TTFT and TPOT beside what a
real engine, started with the plan's own arguments, shows at the planned rate.

    # from the repository root:
    .venv/bin/python -m bench.plan_accuracy [--threads 1] [--profile FILE] [--schemes none,int4]
        [--speculative off,ngram] [--batches 1,3,6] [--warmup 8] [--requests 64]
    # on a machine with an NVIDIA GPU (bench/gpu_check.sh runs this):
    .venv/bin/python -m bench.plan_accuracy --accelerator auto --schemes none,int8

1. This machine's device profile first: `kvpilot profile` with OMP_NUM_THREADS=--threads, the thread
   count every engine then runs with (or --profile FILE, measured earlier the same way).
2. Per case (scheme x speculative mode x load level): an InferenceServiceSpec for the embedded model
   on `accelerator.type: cpu` with that profile and one replica (minReplicas = maxReplicas = 1), at
   the rate whose planned batch is the level's target batch (a bisection on the planner's own
   predicted batch, so the levels go from ~1 running sequence to several); plan() with the profile;
   render.engine_args() for the argv; `kvpilot serve` on 127.0.0.1 with it (only host and port
   replaced); Poisson arrivals at the planned rate, streaming /v1/completions, greedy, ignore_eos, so
   every request has the same prompt and output length. The first --warmup requests are left out
   of the statistics; the arrivals run on without a pause, so the measured ones meet a warm engine
   in its steady state. The engine is stopped by its PID after each case.
3. Observed client-side from the stream, as the engine's kvpilot_ histograms define them: TTFT from
   sending to the first token; TPOT per request, (last token - first token) / (tokens - 1). Beside
   them, from the engine's /metrics: the running batch sampled every 0.25 s (or 8 times, in a shorter
   window) while the measured requests arrive, the draft acceptance (accepted / proposed draft
   tokens, warm-up included) and the prefix-cache hits (which should be none).

Prompts: chat-templated and open-ended (a story to write: n-gram drafts find little to copy in such
answers; the planner's assumed acceptance 0.29 was measured on answers like them), each opening with
its own number in the system message so that no two share a KV block (the prefix cache would serve
every prompt after the first otherwise), all of one token count (checked).

The machine is shared: each case waits up to --settle seconds for the 1-minute load average to fall
below --max-load, records the load at its start and end, and counts the CPUs the rest of the machine
kept busy while its requests ran (/proc/stat less the engine and this process); cases run beside
more than --max-others of them run again at the end (--repeat-loaded), and the table keeps the
quieter run.
GPU mode (--accelerator NAME, a GPU of the planner's catalog, or auto: the catalog GPU whose product
nvidia-smi names for the GPU the engines' `device: auto` takes, CUDA_VISIBLE_DEVICES's first): no profile
(the catalog's spec sheet is the device), the spec says `accelerator: {type: NAME, count: 1}`, and the
rendered argv is served as it is, threads left to the engine. Its memory arguments are a pod's on a
whole GPU: --gpu-memory-utilization (0.9) of the device's total for weights, activations and a KV
pool sized by the engine's own profiling step, no --kv-cache-memory-bytes; this process holds only
a CUDA context, so 10 % is left for it. Each case checks, once the engine is ready, that the GPU
holds at least half the planned KV pool (an engine that fell back to the CPU would not), and names
the GPU nvidia-smi reports; an explicit NAME nvidia-smi maps to another catalog GPU is refused, as
its observations would be another GPU's.

Progress goes to stderr; the JSON to --output (default bench/plan-accuracy-<accelerator>.json); the
markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine, write_result
from bench.serve import RequestResult, WorkItem, poisson_arrivals, run_rate, summarize
from e2e.procs import LOOPBACK, free_port, kvpilot_executable, start_http
from kvpilot.engine.contract.device_profile import DeviceProfile, load_device_profile
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import CPU_TYPE, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.controller.correction import Correction
from kvpilot.operator.planning.device import MiB
from kvpilot.operator.planning.gpus import GPUS, find_gpu
from kvpilot.operator.planning.plan import PlanContext, plan

_REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
PROFILE_NAME = "plan-accuracy"
GOAL = 0.25  # the band for TPOT: observed within predicted x (1 +- GOAL)
SYSTEM = "Session {n:04d}. You are a creative writer."
USER = (
    "Write a long, original story about a lighthouse keeper on a remote northern island who one winter "
    "night finds a strange map washed up in a bottle. Describe the island, the keeper's daily life, "
    "the storm, the map's markings and where it leads, the people the keeper meets on the way, and "
    "how the journey changes them. Use vivid details and your own ideas; do not repeat these instructions."
)


def progress(line: str) -> None:
    print(f"plan_accuracy: {line}", file=sys.stderr, flush=True)


def make_spec(
    scheme: str,
    speculative: str,
    rate: float,
    prompt_tokens: int,
    output_tokens: int,
    slo: tuple[float, float],
    accelerator: str = CPU_TYPE,
) -> InferenceServiceSpec:
    """One replica of the embedded model at `rate` requests/s: on a CPU with this machine's profile,
    or on one GPU of the catalog's `accelerator` type."""
    placement = (
        {"type": CPU_TYPE, "profile": PROFILE_NAME} if accelerator == CPU_TYPE else {"type": accelerator, "count": 1}
    )
    return InferenceServiceSpec.model_validate(
        {
            "model": {"name": MODEL},
            "runtime": "kvpilot",
            "accelerator": placement,
            "serving": {"maxContextLength": 2048, "quantization": scheme, "speculative": speculative},
            "slo": {"ttftP95Ms": slo[0], "tpotP95Ms": slo[1]},
            "load": {"requestsPerSecond": rate, "meanPromptTokens": prompt_tokens, "meanOutputTokens": output_tokens},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 1},
        }
    )


def plan_for(spec: InferenceServiceSpec, profile: DeviceProfile | None, correction: Correction | None = None) -> Plan:
    """The plan of `spec`: from the CPU's measured `profile`, or from the catalog (a GPU: None)."""
    return plan(spec, PlanContext(device_profiles={PROFILE_NAME: profile} if profile else {}, correction=correction))


def with_observed_acceptance(record: dict[str, Any], profile: DeviceProfile | None, settings: Settings) -> None:
    """What the operator's re-plan predicts once the engines reported their draft acceptance
    (status.correction.acceptance; latencies uncorrected): added to a speculating case's record."""
    accepted = record["observed"]["draft_acceptance"]
    if record["speculative"] == "off" or accepted is None:
        return
    replanned = plan_for(
        case_spec(record, settings), profile, Correction(1.0, 1.0, ((record["speculative"], accepted),))
    )
    record["replanned"] = {"tpot_ms": replanned.predicted_tpot_ms, "assumed_draft_acceptance": accepted}
    record["tpot_p95_replanned"] = ratio_row(replanned.predicted_tpot_ms, record["observed"]["tpot_ms"]["p95"])


def rate_for_batch(planned: Callable[[float], Plan], target: float, high: float = 64.0, limit: float = 1e6) -> float:
    """The rate (requests/s, 3 significant digits) whose planned batch is `target`: the planner's
    batch grows with the rate until the replica cannot keep up (a plan without latencies), so a
    bisection on it, from `high` doubled until it reaches the target (a GPU's planned steps are
    short: hundreds of requests/s for a small batch); `limit` when even that rate plans less."""

    def reaches(rate: float) -> bool:
        found = planned(rate)
        return found.predicted_tpot_ms == 0 or found.predicted_batch >= target

    while not reaches(high):
        if high >= limit:
            return limit
        high = min(2 * high, limit)
    low = 0.0
    for _ in range(40):
        middle = (low + high) / 2
        if reaches(middle):
            high = middle
        else:
            low = middle
    return float(f"{high:.3g}")


def ratio_row(predicted_ms: float, observed_ms: float) -> dict[str, float]:
    """Observed beside predicted: their ratio and the error in percent of the prediction."""
    ratio = observed_ms / predicted_ms if predicted_ms > 0 else math.inf
    return {
        "predicted_ms": predicted_ms,
        "observed_ms": observed_ms,
        "ratio": ratio,
        "error_pct": (ratio - 1) * 100,
    }


def within_goal(ratio: float) -> bool:
    return abs(ratio - 1) <= GOAL


def fixed_length_prompts(n: int, first: int = 0) -> list[list[int]]:
    """`n` chat-templated prompts of one token count, no two sharing their first KV block."""
    from kvpilot.engine.model.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    prompts = []
    for i in range(first, first + n):
        messages = [{"role": "system", "content": SYSTEM.format(n=i % 10000)}, {"role": "user", "content": USER}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"the prompts tokenize to different lengths {sorted(lengths)}: fix SYSTEM")
    return prompts


def catalog_gpu(requested: str, detected: str) -> str:
    """The catalog name of the GPU to plan for: `requested` (a catalog name, or auto) beside
    `detected`, the name nvidia-smi gives this machine's GPU ("NVIDIA H200", "NVIDIA H100 80GB HBM3":
    the node product label's words, which the catalog matches)."""
    found = find_gpu(detected)
    catalog = ", ".join(GPUS)
    if requested == "auto":
        if found is None:
            raise ValueError(
                f"nvidia-smi names this GPU {detected!r}, which the planner's catalog lacks ({catalog}): "
                "pass --accelerator NAME to plan it as one of them"
            )
        return found.name
    named = find_gpu(requested)
    if named is None:
        raise ValueError(f"--accelerator {requested!r}: not cpu, auto or a catalog GPU ({catalog})")
    if found is not None and found.name != named.name:
        raise ValueError(
            f"--accelerator {named.name}, but this machine's GPU is {detected!r} ({found.name} in the catalog): "
            "the observations would be another GPU's"
        )
    return named.name


def nvidia_smi(fields: str) -> list[list[str]]:
    """nvidia-smi's `fields` (--query-gpu, no units), a list per GPU: the GPUs CUDA_VISIBLE_DEVICES
    names first, where it is set, so that the first is the one the engines take."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    select = ["--id", visible] if visible else []
    try:
        run = subprocess.run(
            ["nvidia-smi", *select, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise ValueError(f"no NVIDIA GPU to measure on (nvidia-smi: {err})") from None
    rows = [[value.strip() for value in line.split(",")] for line in run.stdout.splitlines() if line.strip()]
    if not rows:
        raise ValueError("nvidia-smi lists no GPU")
    return rows


def measure_profile(threads: int, out: Path) -> DeviceProfile:
    """This machine's profile, measured now with `threads` torch threads (kvpilot profile)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    argv = [kvpilot_executable(), "profile", "--output", str(out), "--name", PROFILE_NAME]
    progress(f"measuring this machine's profile: OMP_NUM_THREADS={threads} {' '.join(argv[1:])}")
    run = subprocess.run(argv, env=env, stderr=subprocess.PIPE, text=True, timeout=900, check=False)
    for line in run.stderr.splitlines():
        progress(f"  {line}")
    if run.returncode != 0:
        raise RuntimeError(f"kvpilot profile failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return load_device_profile(out)


def served_argv(spec: InferenceServiceSpec, planned: Plan, port: int) -> list[str]:
    """`kvpilot serve` with the plan's rendered arguments, listening on LOOPBACK:`port`."""
    args = render.engine_args(spec, planned, model=MODEL)
    for flag, value in (("--host", LOOPBACK), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    return [sys.executable, "-m", "kvpilot.engine.cli", "serve", *args]


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text: every sample's value by its name, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def _drive(
    base_url: str, items: list[WorkItem], arrivals: list[float], window: tuple[float, float], timeout: float
) -> tuple[list[RequestResult], float, list[float], dict[str, float]]:
    """Run the arrivals while sampling the engine's running batch within `window` (seconds from the
    first arrival); the results, the wall time, the samples and the engine's counters afterwards."""
    import httpx

    samples: list[float] = []
    done = asyncio.Event()
    # Every 0.25 s, or 8 times in a shorter window (a GPU's planned rates bring the measured
    # requests in within tens of milliseconds).
    interval = max(0.001, min(0.25, (window[1] - window[0]) / 8))

    async def sample(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter() - start
            if window[0] <= now <= window[1]:
                text = (await client.get(f"{base_url}/metrics")).text
                samples.append(metric_values(text).get("kvpilot_num_requests_running", math.nan))
            await asyncio.sleep(interval)

    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        sampler = asyncio.create_task(sample(client))
        results, wall = await run_rate(base_url, MODEL, items, arrivals, timeout)
        done.set()
        await sampler
        counters = metric_values((await client.get(f"{base_url}/metrics")).text)
    return results, wall, samples, counters


@dataclass(frozen=True)
class Settings:
    accelerator: str  # cpu or a catalog GPU
    threads: int | None  # OMP_NUM_THREADS of a CPU's engines; a GPU's choose their own
    prompt_tokens: int
    output_tokens: int
    slo: tuple[float, float]
    warmup: int
    requests: int
    seed: int
    max_load: float
    settle_s: float
    log_dir: Path


def _settle(settings: Settings) -> tuple[float, float, float]:
    """Wait up to settle_s for the 1-minute load average to fall below max_load; the load then."""
    deadline = time.monotonic() + settings.settle_s
    while os.getloadavg()[0] >= settings.max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()


def busy_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds the machine (all its CPUs, idle and I/O wait left out) or process `pid` (all
    its threads) has run so far, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    if pid is not None:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in cpu[:8])
    return (user + nice + system + irq + softirq + steal) / ticks


def others_cores(before: Sequence[float], after: Sequence[float], wall: float) -> float:
    """CPUs the rest of the machine kept busy between two readings of (machine, engine, this
    process) CPU seconds `wall` seconds apart: the contention a case ran under."""
    machine_s, engine_s, own_s = (b - a for a, b in zip(before, after))
    return max(0.0, (machine_s - engine_s - own_s) / wall)


def observed(
    results: list[RequestResult], wall: float, samples: list[float], counters: dict[str, float], settings: Settings
) -> dict[str, Any]:
    """What the measured requests (those after the warm-up) showed, with the engine's counters."""
    measured = results[settings.warmup :]
    summary = summarize(0.0, measured, wall, math.inf, math.inf)
    drafted = counters.get("kvpilot_spec_decode_num_draft_tokens_total", 0.0)
    accepted = counters.get("kvpilot_spec_decode_num_accepted_tokens_total", 0.0)
    finite = [s for s in samples if not math.isnan(s)]
    return {
        "requests": summary["requests"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "output_tokens": sorted({r.output_tokens for r in measured if r.ok}),
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "itl_ms": summary["itl_ms"],
        "e2e_ms": summary["e2e_ms"],
        "running_batch_mean": sum(finite) / len(finite) if finite else math.nan,
        "running_batch_samples": len(finite),
        "draft_tokens": drafted,
        "draft_acceptance": accepted / drafted if drafted else None,
        "prefix_cache_hits": counters.get("kvpilot_prefix_cache_hits_total", 0.0),
        "preemptions": counters.get("kvpilot_num_preemptions_total", 0.0),
    }


def gpu_memory_in_use(planned: Plan) -> float:
    """MiB the GPU holds now, with the engine ready: at least half the planned KV pool, or the engine
    did not take the GPU (a torch without CUDA falls back to the CPU under `device: auto`)."""
    used = float(nvidia_smi("memory.used")[0][0])
    if used * MiB < planned.kv_pool_bytes / 2:
        raise RuntimeError(
            f"the GPU holds {used:.0f} MiB with the engine ready, under half its planned KV pool of "
            f"{planned.kv_pool_bytes / MiB:.0f} MiB: the engine is not serving from the GPU"
        )
    return used


def case_spec(case: dict[str, Any], settings: Settings) -> InferenceServiceSpec:
    """The spec of a case (its scheme, speculative mode and rate) on the settings' accelerator."""
    return make_spec(
        case["scheme"],
        case["speculative"],
        case["rate"],
        settings.prompt_tokens,
        settings.output_tokens,
        settings.slo,
        settings.accelerator,
    )


def run_case(
    case: dict[str, Any], profile: DeviceProfile | None, prompts: list[list[int]], settings: Settings
) -> dict[str, Any]:
    """Plan one case, serve it with the plan's arguments at the planned rate, and compare."""
    spec = case_spec(case, settings)
    planned = plan_for(spec, profile)
    if not planned.fits:
        raise RuntimeError(f"{case}: the plan does not fit: {planned.reason}")
    load_start = _settle(settings)
    port = free_port()
    argv = served_argv(spec, planned, port)
    label = f"{case['scheme']}-{case['speculative']}-b{case['target_batch']:g}"
    threads = {} if settings.threads is None else {"OMP_NUM_THREADS": str(settings.threads)}
    env = {**os.environ, **threads, "PYTHONUNBUFFERED": "1"}
    progress(
        f"{label} on {settings.accelerator}: {case['rate']:g} req/s, planned batch {planned.predicted_batch}, "
        f"load {load_start[0]:.2f}"
    )
    base_url = f"http://{LOOPBACK}:{port}"
    log = settings.log_dir / f"engine-{label}.log"
    process = start_http(argv, log, f"{base_url}/ready", 300, env, cwd=_REPO, append=False, grace_s=90)
    gpu_used_mib = None
    try:
        if settings.accelerator != CPU_TYPE:
            gpu_used_mib = gpu_memory_in_use(planned)
        # One lone request first: the first forward pays for lazy initialisation, not for load. A
        # second one alone probes the machine's speed now against the profile's (lone_tpot).
        lone = [WorkItem(prompts[-1], settings.output_tokens)]
        asyncio.run(run_rate(base_url, MODEL, lone, [0.0], 300))
        probe = asyncio.run(run_rate(base_url, MODEL, lone, [0.0], 300))[0][0]
        n = settings.warmup + settings.requests
        items = [WorkItem(p, settings.output_tokens) for p in prompts[:n]]
        arrivals = poisson_arrivals(n, case["rate"], settings.seed)
        window = (arrivals[settings.warmup], arrivals[-1])
        cpu_before = (busy_cpu_seconds(), busy_cpu_seconds(process.pid), _own_cpu_seconds())
        results, wall, samples, counters = asyncio.run(_drive(base_url, items, arrivals, window, 600))
        cpu_after = (busy_cpu_seconds(), busy_cpu_seconds(process.pid), _own_cpu_seconds())
    finally:
        process.stop(grace_s=90)
    load_end = os.getloadavg()
    seen = observed(results, wall, samples, counters, settings)
    record = {
        **case,
        "label": label,
        "argv": argv[3:],
        "gpu_memory_used_mib": gpu_used_mib,
        "wall_s": wall,
        "load_average_start": load_start,
        "load_average_end": load_end,
        # CPUs other processes used while the requests ran (2 cores here), and the engine's own.
        "others_cores": others_cores(cpu_before, cpu_after, wall),
        "engine_cores": (cpu_after[1] - cpu_before[1]) / wall,
        "predicted": {
            "batch": planned.predicted_batch,
            "ttft_ms": planned.predicted_ttft_ms,
            "tpot_ms": planned.predicted_tpot_ms,
            "max_num_seqs": planned.max_num_seqs,
            "max_num_batched_tokens": planned.max_num_batched_tokens,
            "kv_pool_bytes": planned.kv_pool_bytes,
            "assumed_draft_acceptance": planned.assumed_draft_acceptance,
            "meets_slo": planned.meets_slo,
            "reasons": planned.reasons,
        },
        "observed": seen,
        "ttft_p95": ratio_row(planned.predicted_ttft_ms, seen["ttft_ms"]["p95"]),
        "tpot_p95": ratio_row(planned.predicted_tpot_ms, seen["tpot_ms"]["p95"]),
        "tpot_mean": ratio_row(planned.predicted_tpot_ms, seen["tpot_ms"]["mean"]),
        # One request alone before the load, against the plan's TPOT for a lone sequence: how much
        # slower than at profiling time the machine ran this case (this VM drifts 20-60 %).
        "lone_tpot": ratio_row(
            plan_for(case_spec({**case, "rate": 1e-3}, settings), profile).predicted_tpot_ms, probe.tpot * 1e3
        ),
    }
    with_observed_acceptance(record, profile, settings)
    progress(
        f"{label}: TTFT p95 {seen['ttft_ms']['p95']:.0f} ms (predicted {planned.predicted_ttft_ms:.0f}), "
        f"TPOT p95 {seen['tpot_ms']['p95']:.1f} ms (predicted {planned.predicted_tpot_ms:.1f}), "
        f"batch {seen['running_batch_mean']:.2f}, failed {seen['failed']}, load {load_end[0]:.2f}, "
        f"others' CPUs {record['others_cores']:.2f}"
    )
    return record


def cases(
    profile: DeviceProfile | None,
    schemes: Sequence[str],
    modes: Sequence[str],
    batches: Sequence[float],
    settings: Settings,
) -> list[dict[str, Any]]:
    """The grid: every scheme and mode at the rates whose planned batches are `batches`."""
    grid = []
    for scheme in schemes:
        for mode in modes:

            def planned(rate: float, scheme: str = scheme, mode: str = mode) -> Plan:
                return plan_for(case_spec({"scheme": scheme, "speculative": mode, "rate": rate}, settings), profile)

            for target in batches:
                grid.append(
                    {"accelerator": settings.accelerator, "scheme": scheme, "speculative": mode, "target_batch": target}
                )
                grid[-1]["rate"] = rate_for_batch(planned, target)
    return grid


def _cell(row: dict[str, float], digits: int) -> str:
    # At least two significant digits of the prediction (a GPU's are fractions of a millisecond).
    if row["predicted_ms"] > 0:
        digits = max(digits, 1 - math.floor(math.log10(row["predicted_ms"])))
    pair = f"{row['predicted_ms']:.{digits}f} / {row['observed_ms']:.{digits}f}"
    return f"{pair} | {row['ratio']:.2f} | {row['error_pct']:+.0f} %"


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """The RESULTS table: per case predicted and observed p95 TTFT and TPOT, ratio and error."""
    lines = [
        "| device | scheme | spec | req/s | batch planned / seen | TTFT p95 pred / obs (ms) | ratio | error "
        "| TPOT p95 pred / obs (ms) | ratio | error | TPOT mean obs / pred | acceptance | load start / end "
        "| others' CPUs | TPOT within ±25 % | TPOT p95 re-planned with the acceptance (ms) | ratio "
        "| lone request's TPOT pred / obs (ms) | ratio |",
        "| --- | --- | --- | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- "
        "| ---: | ---: | --- | ---: |",
    ]
    for r in records:
        seen = r["observed"]
        accepted = seen["draft_acceptance"]
        lines.append(
            f"| {r['accelerator']} | {r['scheme']} | {r['speculative']} | {r['rate']:g} "
            f"| {r['predicted']['batch']:.1f} / {seen['running_batch_mean']:.1f} "
            f"| {_cell(r['ttft_p95'], 0)} | {_cell(r['tpot_p95'], 1)} | {r['tpot_mean']['ratio']:.2f} "
            f"| {'-' if accepted is None else f'{accepted:.2f}'} "
            f"| {r['load_average_start'][0]:.2f} / {r['load_average_end'][0]:.2f} | {r['others_cores']:.2f} "
            f"| {'yes' if within_goal(r['tpot_p95']['ratio']) else 'no'} "
            + (
                f"| {r['replanned']['tpot_ms']:.1f} | {r['tpot_p95_replanned']['ratio']:.2f} "
                if "replanned" in r
                else "| - | - "
            )
            + (
                f"| {r['lone_tpot']['predicted_ms']:.1f} / {r['lone_tpot']['observed_ms']:.1f} "
                f"| {r['lone_tpot']['ratio']:.2f} |"
                if "lone_tpot" in r  # not in runs recorded before it was
                else "| - | - |"
            )
        )
    return "\n".join(lines)


def device(args: argparse.Namespace, log_dir: Path) -> tuple[str, DeviceProfile | None, dict[str, Any]]:
    """The accelerator the cases are planned for and served on, its profile (a CPU's; a GPU is the
    catalog's) and what the report says of them."""
    if args.accelerator != CPU_TYPE:
        if args.profile:
            raise ValueError("--profile is a CPU's: a GPU is planned from the planner's catalog")
        name, memory_mib, driver = nvidia_smi("name,memory.total,driver_version")[0]
        gpu = GPUS[catalog_gpu(args.accelerator, name)]
        if find_gpu(name) is None:
            progress(f"nvidia-smi names this GPU {name!r}, which the catalog lacks: planned as {gpu.name}")
        seen = {"name": name, "memory_total_mib": float(memory_mib), "driver": driver}
        catalog = gpu.model_dump(include={"usable_memory_mib", "bandwidth_gbps", "fp16_tflops", "int8_tops", "source"})
        return gpu.name, None, {"accelerator": {"name": gpu.name, "nvidia_smi": seen, "catalog": catalog}}
    if args.profile:
        profile = load_device_profile(args.profile).model_copy(update={"name": PROFILE_NAME})
        source = f"--profile {args.profile}"
    else:
        profile = measure_profile(args.threads, log_dir / "profile.json")
        source = f"kvpilot profile, OMP_NUM_THREADS={args.threads}, measured by this run"
    if profile.threads != args.threads:
        raise ValueError(f"the profile was measured with {profile.threads} threads, the engines run {args.threads}")
    return (
        CPU_TYPE,
        profile,
        {"accelerator": {"name": CPU_TYPE}, "profile_source": source, "profile": json.loads(profile.to_json())},
    )


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": "python -m bench.plan_accuracy " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "lscpu_flags": _lscpu_flags(),
    }
    accelerator, profile, described = device(args, log_dir)
    report.update(described)
    output = Path(args.output or f"bench/plan-accuracy-{accelerator.lower()}.json")
    total = args.warmup + args.requests
    prompts = fixed_length_prompts(total + 1)
    settings = Settings(
        accelerator=accelerator,
        threads=args.threads if accelerator == CPU_TYPE else None,
        prompt_tokens=len(prompts[0]),
        output_tokens=args.output_tokens,
        slo=(args.slo_ttft_ms, args.slo_tpot_ms),
        warmup=args.warmup,
        requests=args.requests,
        seed=args.seed,
        max_load=args.max_load,
        settle_s=args.settle,
        log_dir=log_dir,
    )
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()}
    grid = cases(
        profile, _list(args.schemes), _list(args.speculative), [float(b) for b in _list(args.batches)], settings
    )
    progress(f"{len(grid)} cases, prompt {settings.prompt_tokens} tokens, output {settings.output_tokens} tokens")
    runs = []
    for case in grid:
        runs.append(run_case(case, profile, prompts, settings))
        # The cases so far, in case the run is cut short (a device lease, a timeout): they stand alone.
        write_result(output, {**report, "runs": runs, "table": _least_loaded(runs), "complete": False})
    if args.repeat_loaded:
        for record in list(runs):
            if record["others_cores"] >= args.max_others and time.monotonic() - started < args.budget:
                progress(f"{record['label']} ran beside {record['others_cores']:.2f} other busy CPUs: once more")
                again = run_case(
                    {k: record[k] for k in ("accelerator", "scheme", "speculative", "target_batch", "rate")},
                    profile,
                    prompts,
                    settings,
                )
                again["repeat_of_loaded_run"] = True
                runs.append(again)
    report["runs"] = runs
    report["table"] = _least_loaded(runs)
    report["load_average_end"] = os.getloadavg()
    report["wall_s"] = time.monotonic() - started
    report["complete"] = True
    write_result(output, report)
    table = markdown_table([runs[i] for i in report["table"]])
    print(table)
    progress(f"wrote {output} ({report['wall_s']:.0f} s)")
    return 0


def _least_loaded(runs: Sequence[dict[str, Any]]) -> list[int]:
    """Per case (scheme, mode, rate), the index of its run beside the least other work."""
    best: dict[tuple[str, str, float], int] = {}
    for i, r in enumerate(runs):
        key = (r["scheme"], r["speculative"], r["rate"])
        if key not in best or r["others_cores"] < runs[best[key]]["others_cores"]:
            best[key] = i
    return list(best.values())


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _lscpu_flags() -> list[str]:
    """The lscpu flags that decide the CPU kernels' paths."""
    from kvpilot.engine.contract.device_profile import CPU_FLAGS

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    return [flag for flag in CPU_FLAGS if flag in flags]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plan_accuracy",
        description="CPU and GPU plans' predicted p95 TTFT/TPOT beside a real engine's at the planned rate",
    )
    parser.add_argument(
        "--accelerator",
        default=CPU_TYPE,
        help="cpu (this machine's CPU, profiled), a catalog GPU (H100-80GB, H200, ...), or auto: the catalog "
        "GPU nvidia-smi names for this machine's first GPU",
    )
    parser.add_argument("--threads", type=int, default=1, help="cpu: OMP_NUM_THREADS of the profile and the engines")
    parser.add_argument(
        "--profile", help="cpu: a profile measured earlier with --threads threads (default: measure now)"
    )
    parser.add_argument("--schemes", default="none,int4")
    parser.add_argument("--speculative", default="off,ngram")
    parser.add_argument("--batches", default="1,3,6", help="planned batches of the load levels (default 1,3,6)")
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8, help="requests left out of the statistics")
    parser.add_argument("--requests", type=int, default=64, help="measured requests per case")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-load", type=float, default=1.0, help="1-minute load average a case waits to fall under")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds a case waits for the load at most")
    parser.add_argument(
        "--max-others", type=float, default=0.3, help="a case run beside more busy CPUs of others runs again"
    )
    parser.add_argument("--repeat-loaded", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--budget", type=float, default=1500.0, help="no repeats after this many seconds")
    parser.add_argument("--log-dir", default="bench/out/plan-accuracy")
    parser.add_argument("--output", help="the JSON (default bench/plan-accuracy-<accelerator>.json)")
    return parser


if __name__ == "__main__":
    try:
        sys.exit(run(build_parser().parse_args()))
    except ValueError as err:
        print(f"bench.plan_accuracy: error: {err}", file=sys.stderr)
        sys.exit(2)
