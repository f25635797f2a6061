"""Prefix-aware routing against least-load routing: prefix-cache hits and TTFT on a multi-turn chat
workload over several real engines.

    .venv/bin/python -m bench.prefix_routing [--engines 3] [--conversations 12] [--turns 4] [--think-s 2]

For each strategy, fresh `kvpilot serve` engines start on loopback ports (one torch thread each), and
the conversations run concurrently, each turn sending the whole conversation so far (a long first
user message, then the turns). Each request goes where the gateway's own routing functions send it
(operator/gateway/routing.py: `choose` for LeastLoad, `choose_by_prefix` for PrefixHash, keyed by
gateway/body.py's prefix of the first user message), with the requests in flight counted as the
gateway counts them. Measured: the engines' prefix-cache hit rate (their `kvpilot_prefix_cache_*`
counters) and the clients' TTFT. Each strategy gets new conversations on new engines, so no cache
carries over. Results go to bench/out/prefix_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.machine import machine, write_result
from e2e.procs import LOOPBACK, Process, free_port, serve_argv, start_http
from kvpilot.operator.gateway.body import read_body
from kvpilot.operator.gateway.routing import Engines, choose, choose_by_prefix

MODEL = "SmolLM2-135M-Instruct"
# The gateway's per-engine bound (2 x maxNumSeqs) never binds here: the engines queue what they get.
CAPACITY = 10**6
TOPICS = ("rollout plan", "incident review", "hiring loop", "budget", "launch checklist", "on-call rota")


def _first_message(conversation: int, strategy: str) -> str:
    """A long, distinct opening per conversation (and per strategy, so no engine has seen it)."""
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(f"Item {i} of the {topic} for team {conversation} ({strategy}) is on track." for i in range(24))
    return f"Conversation {conversation} in {strategy}: notes on the {topic}. {facts} Summarise them."


def _start_engines(count: int, log_dir: Path) -> list[tuple[str, Process]]:
    engines = []
    for index in range(count):
        port = free_port()
        url = f"http://{LOOPBACK}:{port}"
        argv = serve_argv(port)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        engines.append((url, start_http(argv, log_dir / f"engine-{index}.log", f"{url}/ready", 180, env)))
    return engines


def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(queries, hits) in tokens, summed over the engines."""
    queries = hits = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:  # noqa: S310 - loopback only
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvpilot_prefix_cache_queries_total":
                    queries += sample.value
                elif sample.name == "kvpilot_prefix_cache_hits_total":
                    hits += sample.value
    return queries, hits


async def _turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """One streamed chat turn: its TTFT and the answer's text."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, first, text = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter()
            text.append(delta)
    return (first or time.perf_counter()) - started, "".join(text)


async def _run(strategy: str, urls: list[str], args: argparse.Namespace) -> list[float]:
    engines, ttfts = Engines(), []
    ready = [(url, url) for url in urls]

    thinking = random.Random(args.seed)

    async def conversation(index: int) -> None:
        messages = [{"role": "user", "content": _first_message(index, strategy)}]
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            for turn in range(args.turns):
                prefix = read_body(json.dumps({"model": MODEL, "messages": messages}).encode()).prefix
                now = time.monotonic()
                url = (
                    choose_by_prefix(ready, engines, CAPACITY, now, prefix)
                    if strategy == "PrefixHash"
                    else choose(ready, engines, CAPACITY, now)
                )
                assert url is not None
                engines.in_flight[url] = engines.in_flight.get(url, 0) + 1
                try:
                    ttft, answer = await _turn(client, url, messages, args.max_tokens)
                finally:
                    engines.in_flight[url] -= 1
                ttfts.append(ttft)
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"And point {turn}?"},
                ]
                # A person reads the answer before the next turn: the others' requests move the loads.
                await asyncio.sleep(thinking.uniform(0, args.think_s))

    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    return ttfts


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.0, help="up to this long between a conversation's turns")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for strategy in ("LeastLoad", "PrefixHash"):
            print(f"[prefix-routing] {strategy}: starting {args.engines} engines", flush=True)
            started = _start_engines(args.engines, Path(logs))
            urls = [url for url, _ in started]
            try:
                before = _prefix_counters(urls)
                ttfts = asyncio.run(_run(strategy, urls, args))
                after = _prefix_counters(urls)
            finally:
                for _, process in started:
                    process.stop()
            queries, hits = after[0] - before[0], after[1] - before[1]
            results[strategy] = {
                "requests": len(ttfts),
                "prefix_cache_hit_rate": round(hits / queries, 3) if queries else None,
                "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                "ttft_p95_ms": round(_pct(ttfts, 0.95) * 1000, 1),
            }
            print(f"[prefix-routing] {strategy}: {results[strategy]}", flush=True)
    write_result(
        Path(__file__).with_name("out") / "prefix_routing.json",
        {"machine": machine(), "args": vars(args), "results": results},
    )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
