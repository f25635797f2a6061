"""/metrics after a load: histogram counts and counters equal what was served; the vllm: names."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import SchedulerStats, SpecDecodingStats
from kvpilot.engine.outputs import StepOutput
from kvpilot.engine.serving.metrics import LATENCY_BUCKETS, ServingMetrics
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

    async def one(client, i: int, prompt: str) -> int:
        # Half stream, half not: both paths must report.
        extra = {"ignore_eos": True}
        if i % 2:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            chunks = [c async for c in stream]
            return chunks[-1].usage.prompt_tokens
        out = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
        )
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
        # Buckets reach 20 minutes: a multi-minute e2e on a CPU pod still lands in a finite bucket.
        assert delta(f"{histogram}_bucket", le="1200.0") == n, histogram
    assert delta("kvpilot_inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta("kvpilot_request_success_total", finished_reason="length") == n
    assert delta("kvpilot_generation_tokens_total") == n * max_tokens
    assert delta("kvpilot_prompt_tokens_total") == prompt_tokens
    assert delta("kvpilot_prefix_cache_queries_total") == prompt_tokens
    assert after[("kvpilot_num_requests_running", frozenset({"model": MODEL}.items()))] == 0


def test_every_metric_carries_the_model_label(server: Server) -> None:
    names = {name for name, _ in server.metrics()}
    assert not any(name.startswith("vllm:") for name in names), "vLLM names only with --vllm-compatible-metrics"
    for name, labels in server.metrics():
        if name.startswith("kvpilot_"):
            assert ("model", MODEL) in labels, name
    expected = {
        "kvpilot_num_requests_running",
        "kvpilot_num_requests_waiting",
        "kvpilot_kv_cache_usage_ratio",
        "kvpilot_num_preemptions_total",
        "kvpilot_prefix_cache_hits_total",
        "kvpilot_requests_rejected_total",
    }
    assert expected <= names


def test_buckets_cover_ms_to_twenty_minutes() -> None:
    assert LATENCY_BUCKETS == tuple(sorted(set(LATENCY_BUCKETS)))
    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] == 1200.0
    for value in (600.0, 900.0):  # 10 and 15 minutes are bucket edges
        assert value in LATENCY_BUCKETS
    # At least four buckets per decade from 1 ms up, so histogram_quantile() interpolates finely.
    for low, high in ((0.001, 0.01), (0.01, 0.1), (0.1, 1.0), (1.0, 10.0), (10.0, 100.0), (100.0, 1000.0)):
        assert sum(low <= b < high for b in LATENCY_BUCKETS) >= 4, low


# vLLM's own exporter, vLLM 0.33.0 (PrometheusStatLogger in vllm/v1/metrics/loggers.py): the name
# of every metric kvpilot exports under a vllm: name, its type, and its labels besides `engine`
# (the index of vLLM's engine core, which kvpilot leaves out: one engine per server).
VLLM_METRICS = {
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:request_time_per_output_token_seconds": ("histogram", {"model_name"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "vllm:num_preemptions": ("counter", {"model_name"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:spec_decode_num_drafts": ("counter", {"model_name"}),
    "vllm:spec_decode_num_draft_tokens": ("counter", {"model_name"}),
    "vllm:spec_decode_num_accepted_tokens": ("counter", {"model_name"}),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", {"model_name", "position"}),
}
# Names older vLLM releases exported and 0.33.0 does not: a dashboard must not find them here.
VLLM_REMOVED = (
    "vllm:time_per_output_token_seconds",
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
)


def scrape(metrics: ServingMetrics) -> dict[str, tuple[str, list]]:
    text = generate_latest(metrics.registry).decode()
    return {
        f.name: (f.type, f.samples) for f in text_string_to_metric_families(text) if not f.name.endswith("_created")
    }


def test_vllm_names_types_and_labels_match_vllm() -> None:
    metrics = ServingMetrics("m", vllm_compatible=True)
    # One sequence: admitted, scheduled, three tokens, finished by length; then the engine's state.
    metrics.on_admitted(7)
    metrics.on_scheduled(0.25)
    step = dict(
        request_id="r",
        text_delta="",
        num_prompt_tokens=7,
        num_cached_tokens=0,
        stop_reason=None,
        arrival_time=100.0,
        first_token_time=100.5,
        queue_time=0.25,  # queued by the engine at arrival: both queue times agree
    )
    for i, now in enumerate((100.5, 100.6, 100.7)):
        output = StepOutput(
            new_token_ids=[i], num_output_tokens=i + 1, finish_reason="length" if i == 2 else None, **step
        )
        metrics.on_tokens(output, now)
    metrics.on_finished(output, 100.7)
    # Two verification steps of 3 drafts: 2 then 3 accepted.
    spec = SpecDecodingStats().add(3, 2).add(3, 3)
    metrics.set_state(
        SchedulerStats(
            num_running=1,
            num_waiting=2,
            kv_cache_usage=0.5,
            num_preemptions=3,
            prefix_cache_queries=7,
            prefix_cache_hits=4,
            spec_decoding=spec,
        )
    )
    families = scrape(metrics)

    vllm_names = {name for name in families if name.startswith("vllm:")}
    assert vllm_names == set(VLLM_METRICS)
    for name in VLLM_REMOVED:
        assert name not in families, name
    for name, (kind, labels) in VLLM_METRICS.items():
        assert families[name][0] == kind, name
        for sample in families[name][1]:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
            assert sample.labels["model_name"] == "m", name
    # Every vllm: series carries the same value as its kvpilot_ twin (for this sequence, where
    # vLLM's meanings and ours agree: one token per step, queued at arrival, finished normally).
    ours = {
        "vllm:request_time_per_output_token_seconds": "kvpilot_time_per_output_token_seconds",
        "vllm:kv_cache_usage_perc": "kvpilot_kv_cache_usage_ratio",
    }
    for name in VLLM_METRICS:
        twin = ours.get(name, name.replace("vllm:", "kvpilot_"))
        theirs = {
            (s.name.replace(name, twin), frozenset((k, v) for k, v in s.labels.items() if k != "model_name"), s.value)
            for s in families[name][1]
        }
        mine = {
            (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model"), s.value) for s in families[twin][1]
        }
        assert theirs == mine, name

    def value(sample_name: str, **labels: str) -> float:
        family = next(f for f in families if sample_name in (f, f"{f}_total", f"{f}_count", f"{f}_sum", f"{f}_bucket"))
        return next(
            s.value for s in families[family][1] if s.name == sample_name and labels.items() <= s.labels.items()
        )

    assert value("vllm:request_time_per_output_token_seconds_count") == 1
    assert abs(value("vllm:request_time_per_output_token_seconds_sum") - 0.1) < 1e-9  # (100.7 - 100.5) / 2
    assert value("vllm:e2e_request_latency_seconds_bucket", le="1200.0") == 1
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:kv_cache_usage_perc") == 0.5
    assert value("vllm:prefix_cache_hits_total") == 4
    assert value("vllm:spec_decode_num_drafts_total") == 2
    assert value("vllm:spec_decode_num_draft_tokens_total") == 6
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 5
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)] == [2, 2, 1]
    assert value("kvpilot_spec_decode_num_emitted_tokens_total") == 7  # accepted + one sampled per step


def test_no_vllm_names_unless_asked() -> None:
    assert not any(name.startswith("vllm:") for name in scrape(ServingMetrics("m")))


def _step(
    metrics: ServingMetrics, now: float, tokens: int, total: int, finish: str | None = None, **kw: object
) -> StepOutput:
    output = StepOutput(
        request_id=kw.pop("request_id", "r"),
        new_token_ids=list(range(tokens)),
        text_delta="",
        num_prompt_tokens=7,
        num_output_tokens=total,
        num_cached_tokens=0,
        finish_reason=finish,
        stop_reason=None,
        arrival_time=100.0,
        first_token_time=kw.pop("first_token_time", 101.0),
        **kw,
    )
    metrics.on_tokens(output, now)
    return output


def _sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def test_vllm_itl_is_one_observation_per_step() -> None:
    """A verification step that gives three tokens 0.3 s after the previous step: vLLM observes
    0.3 once; ours is three gaps of 0.1."""
    metrics = ServingMetrics("m", vllm_compatible=True)
    _step(metrics, 101.0, 1, 1)
    _step(metrics, 101.3, 3, 4)
    assert _sample(metrics, "vllm:inter_token_latency_seconds_count") == 1
    assert abs(_sample(metrics, "vllm:inter_token_latency_seconds_sum") - 0.3) < 1e-9
    assert _sample(metrics, "kvpilot_inter_token_latency_seconds_count") == 3
    assert abs(_sample(metrics, "kvpilot_inter_token_latency_seconds_sum") - 0.3) < 1e-9


def test_vllm_queue_time_runs_from_the_engine_queue_to_scheduled(llm) -> None:
    """A request that reached the server 5 s before the engine queued it: vLLM's queue time leaves
    those 5 s out (observed when the sequence finishes), ours counts them (when it is scheduled)."""
    engine = llm.engine
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), arrival_time=time.monotonic() - 5.0)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = [o for o in outputs if o.request_id == request.request_id]
    assert output.queue_time is not None and 0.0 <= output.queue_time < 5.0
    assert request.first_scheduled_time - request.arrival_time >= 5.0
    metrics = ServingMetrics("m", vllm_compatible=True)
    metrics.on_scheduled(request.first_scheduled_time - request.arrival_time)
    metrics.on_tokens(output, time.monotonic())
    metrics.on_finished(output, time.monotonic())
    assert _sample(metrics, "vllm:request_queue_time_seconds_sum") == output.queue_time
    assert _sample(metrics, "kvpilot_request_queue_time_seconds_sum") >= 5.0


def test_vllm_tpot_counts_one_token_sequences_as_zero() -> None:
    metrics = ServingMetrics("m", vllm_compatible=True)
    metrics.on_finished(_step(metrics, 101.0, 1, 1, "length", queue_time=0.1), 101.0)
    assert _sample(metrics, "vllm:request_time_per_output_token_seconds_count") == 1
    assert _sample(metrics, "vllm:request_time_per_output_token_seconds_sum") == 0.0
    assert _sample(metrics, "kvpilot_time_per_output_token_seconds_count") == 0


def test_vllm_records_engine_aborts_and_not_client_aborts() -> None:
    """A sequence the engine aborts (it failed) counts in vLLM's TPOT, e2e, queue time and
    request_success like any it finishes; one the client aborts, nowhere under vllm: names (vLLM's
    abort path records no stats). Ours: neither in TPOT or e2e, both in request_success{abort}."""
    metrics = ServingMetrics("m", vllm_compatible=True)
    _step(metrics, 101.0, 1, 1, queue_time=0.1)
    metrics.on_finished(_step(metrics, 101.4, 1, 3, "abort", queue_time=0.1), 101.4)
    _step(metrics, 101.0, 1, 1, request_id="gone", queue_time=0.1)
    metrics.on_finished(_step(metrics, 101.2, 1, 2, "abort", request_id="gone", queue_time=0.1), 101.2, by_client=True)
    assert _sample(metrics, "vllm:request_time_per_output_token_seconds_count") == 1
    assert abs(_sample(metrics, "vllm:request_time_per_output_token_seconds_sum") - 0.2) < 1e-9  # 0.4 s / 2
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert _sample(metrics, "vllm:request_queue_time_seconds_count") == 1
    assert _sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert _sample(metrics, "kvpilot_time_per_output_token_seconds_count") == 0
    assert _sample(metrics, "kvpilot_e2e_request_latency_seconds_count") == 0
    assert _sample(metrics, "kvpilot_request_success_total", finished_reason="abort") == 2


def test_vllm_cache_config_info_carries_the_kv_cache_shape() -> None:
    metrics = ServingMetrics("m", vllm_compatible=True)
    metrics.on_engine_loaded(block_size=16, num_gpu_blocks=4096, enable_prefix_caching=True)
    labels = {"block_size": "16", "num_gpu_blocks": "4096", "enable_prefix_caching": "True", "engine": "0"}
    assert _sample(metrics, "vllm:cache_config_info", **labels) == 1
    plain = ServingMetrics("m")
    plain.on_engine_loaded(block_size=16, num_gpu_blocks=4096, enable_prefix_caching=True)
    assert "cache_config_info" not in generate_latest(plain.registry).decode()
