"""A server with limits: API key, bounded waiting queue (429 + Retry-After), vLLM metric names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, Server, start_server, wait_until

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One running sequence and two waiting ones at most: the fourth concurrent request is refused.
    srv = start_server(
        tmp_path_factory.mktemp("limited"),
        "--api-key",
        KEY,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
        "--vllm-compatible-metrics",
        api_key=KEY,
    )
    yield srv
    code = srv.terminate()
    assert code == 0, f"kvpilot serve exited with {code}:\n{srv.log()}"


def test_api_key_is_required_on_v1(limited: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = limited.http.post("/v1/completions", json={"model": MODEL, "prompt": "a"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert limited.client().models.list().data[0].id == MODEL
    # Probes and scrapes carry no credentials.
    for path in ("/health", "/ready", "/metrics"):
        assert limited.http.get(path).status_code == 200, path


def test_queue_full_gets_429_with_retry_after(limited: Server) -> None:
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    rejected_before = limited.metric("kvpilot_requests_rejected_total")
    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(base_url=limited.base_url, headers=headers, timeout=60))

        def open_stream() -> None:
            response = stack.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert response.status_code == 200

        open_stream()
        wait_until(lambda: limited.metric("kvpilot_num_requests_running") == 1, 30, "the first request to run")
        open_stream()
        open_stream()
        wait_until(lambda: limited.metric("kvpilot_num_requests_waiting") == 2, 30, "two requests to wait")

        refused = http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            limited.client(max_retries=0).completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert limited.metric("kvpilot_requests_rejected_total") == rejected_before + 2
    # All three streams closed: the queue drains and new work is admitted again.
    wait_until(lambda: limited.metric("kvpilot_num_requests_running") == 0, 30, "running to return to 0")
    assert limited.metric("kvpilot_num_requests_waiting") == 0
    assert limited.metric("kvpilot_kv_cache_usage_ratio") == 0
    assert limited.client().completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1


def test_vllm_compatible_metric_names(limited: Server) -> None:
    limited.client().completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, extra_body={"ignore_eos": True}
    )
    samples = limited.metrics()
    pairs = {
        "vllm:num_requests_running": "kvpilot_num_requests_running",
        "vllm:num_requests_waiting": "kvpilot_num_requests_waiting",
        "vllm:kv_cache_usage_perc": "kvpilot_kv_cache_usage_ratio",
        "vllm:time_to_first_token_seconds_count": "kvpilot_time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count": "kvpilot_inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count": "kvpilot_e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total": "kvpilot_prompt_tokens_total",
        "vllm:generation_tokens_total": "kvpilot_generation_tokens_total",
        "vllm:num_preemptions_total": "kvpilot_num_preemptions_total",
        "vllm:prefix_cache_queries_total": "kvpilot_prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total": "kvpilot_prefix_cache_hits_total",
    }
    # TPOT and queue time are left out: vLLM counts 1-token sequences in TPOT and observes queue
    # time only for sequences the engine finished, so the streams the previous test closed and its
    # 1-token request count differently (test_metrics.py checks each meaning).
    for vllm_name, ours in pairs.items():
        theirs = samples[(vllm_name, frozenset({"model_name": MODEL}.items()))]
        assert theirs == samples[(ours, frozenset({"model": MODEL}.items()))], vllm_name
    assert samples[("vllm:time_to_first_token_seconds_count", frozenset({"model_name": MODEL}.items()))] >= 1
    success = ("vllm:request_success_total", frozenset({"model_name": MODEL, "finished_reason": "length"}.items()))
    assert samples[success] >= 1
    # The KV cache's shape, as vLLM labels it, for endpoint pickers.
    (info,) = [labels for name, labels in samples if name == "vllm:cache_config_info"]
    shape = dict(info)
    assert shape["block_size"] == "16" and int(shape["num_gpu_blocks"]) > 0 and shape["engine"] == "0"
