"""/metrics after a load: histogram counts and counters equal what was served."""

from __future__ import annotations

import asyncio

from tests.server.conftest import MODEL, Server

HISTOGRAMS = [
    "kvpilot_time_to_first_token_seconds",
    "kvpilot_time_per_output_token_seconds",
    "kvpilot_e2e_request_latency_seconds",
    "kvpilot_request_queue_time_seconds",
]


def test_counts_equal_requests_served(server: Server) -> None:
    before = server.metrics()
    prompts = [f"Tell me fact number {i} about the sea." for i in range(6)]
    max_tokens = 4

    async def one(client, i: int, prompt: str) -> int:  # noqa: ANN001
        # Half stream, half not: both paths must report.
        extra = {"ignore_eos": True}
        if i % 2:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}, extra_body=extra)
            chunks = [c async for c in stream]
            return chunks[-1].usage.prompt_tokens
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens

    async def run_all() -> list[int]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    prompt_tokens = sum(asyncio.run(run_all()))
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset({"model": MODEL, **labels}.items()))
        return after[key] - before[key]

    n = len(prompts)
    for histogram in HISTOGRAMS:
        assert delta(f"{histogram}_count") == n, histogram
        assert delta(f"{histogram}_sum") > 0, histogram
        assert delta(f"{histogram}_bucket", le="+Inf") == n, histogram
    assert delta("kvpilot_inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta("kvpilot_request_success_total", finished_reason="length") == n
    assert delta("kvpilot_generation_tokens_total") == n * max_tokens
    assert delta("kvpilot_prompt_tokens_total") == prompt_tokens
    assert delta("kvpilot_prefix_cache_queries_total") == prompt_tokens
    assert after[("kvpilot_num_requests_running", frozenset({"model": MODEL}.items()))] == 0


def test_every_metric_carries_the_model_label(server: Server) -> None:
    names = {name for name, _ in server.metrics()}
    assert not any(name.startswith("vllm:") for name in names), "vLLM names only with --vllm-compatible-metrics"
    for (name, labels) in server.metrics():
        if name.startswith("kvpilot_"):
            assert ("model", MODEL) in labels, name
    expected = {
        "kvpilot_num_requests_running", "kvpilot_num_requests_waiting", "kvpilot_kv_cache_usage_ratio",
        "kvpilot_num_preemptions_total", "kvpilot_prefix_cache_hits_total", "kvpilot_requests_rejected_total",
    }
    assert expected <= names
