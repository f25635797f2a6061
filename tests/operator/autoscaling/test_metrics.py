"""Reading engines' /metrics and windowed quantiles, against Prometheus' documented behaviour."""

from __future__ import annotations

import json
import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

from kvpilot.engine.serving.metrics import LATENCY_BUCKETS, ServingMetrics
from kvpilot.operator.autoscaling.metrics import (
    Histogram,
    MetricsError,
    histogram_quantile,
    increase,
    merge,
    parse,
)


def histogram_of(values: list[float], bounds: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
    """What an exporter with these buckets reports after observing `values`."""
    return Histogram(
        bounds=bounds, counts=tuple(float(sum(v <= b for v in values)) for b in bounds), count=float(len(values))
    )


def exposition_of(
    values: list[float], name: str = "kvpilot_time_to_first_token_seconds", buckets: tuple[float, ...] = LATENCY_BUCKETS
) -> str:
    """prometheus_client's own text for a histogram that observed `values`."""
    registry = CollectorRegistry()
    histogram = PromHistogram(name, "test", registry=registry, buckets=buckets)
    for value in values:
        histogram.observe(value)
    return generate_latest(registry).decode()


# ---- histogram_quantile --------------------------------------------------------------------


def test_prometheus_documented_example() -> None:
    """promql/promqltest/testdata/histograms.test, series start="positive" at 50m:
    le=0.1 -> 50, le=0.2 -> 70, le=1 -> 110, le=+Inf -> 120."""
    h = Histogram(bounds=(0.1, 0.2, 1.0), counts=(50, 70, 110), count=120)
    assert histogram_quantile(0.2, h) == pytest.approx(0.048)  # in the lowest bucket, from 0
    assert histogram_quantile(0.5, h) == pytest.approx(0.15)
    assert histogram_quantile(0.8, h) == pytest.approx(0.72)
    assert histogram_quantile(0.0, h) == 0.0
    # The rank falls in the +Inf bucket: the largest finite bound.
    assert histogram_quantile(1.0, h) == 1.0


def test_rank_in_the_inf_bucket_gives_the_largest_finite_bound() -> None:
    h = histogram_of([5000.0] * 20)  # everything above the top bucket (1200 s)
    assert histogram_quantile(0.95, h) == LATENCY_BUCKETS[-1]
    h = histogram_of([0.01] * 90 + [5000.0] * 10)  # p95 among the 10 beyond
    assert histogram_quantile(0.95, h) == LATENCY_BUCKETS[-1]
    # The median is interpolated inside (0.0075, 0.01], where all 90 fast ones are: rank 50 of 90.
    assert histogram_quantile(0.5, h) == pytest.approx(0.0075 + 0.0025 * 50 / 90)


def test_empty_window_has_no_quantile() -> None:
    assert histogram_quantile(0.95, histogram_of([])) is None


def test_a_lowest_bound_at_or_below_zero_is_returned_as_is() -> None:
    h = Histogram(bounds=(0.0, 1.0), counts=(10, 10), count=10)
    assert histogram_quantile(0.5, h) == 0.0
    # A positive lowest bound interpolates from 0.
    assert histogram_quantile(0.5, Histogram(bounds=(2.0,), counts=(10,), count=10)) == pytest.approx(1.0)


def test_non_monotonic_buckets_are_made_monotonic_first() -> None:
    """A scrape is not atomic across buckets; PromQL forces cumulative counts to rise."""
    h = Histogram(bounds=(1.0, 2.0, 3.0), counts=(6, 4, 10), count=10)
    # As (6, 6, 10): rank 8 lies in (2, 3], 2 of its 4.
    assert histogram_quantile(0.8, h) == pytest.approx(2.5)


def test_quantile_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError):
        histogram_quantile(1.5, histogram_of([1.0]))


def test_uniform_distribution_is_exact_where_buckets_are_uniform() -> None:
    values = [i / 1000 for i in range(1, 1001)]  # uniform on (0, 1]
    bounds = tuple(round(0.1 * k, 1) for k in range(1, 11))
    assert histogram_quantile(0.95, histogram_of(values, bounds)) == pytest.approx(0.95)
    assert histogram_quantile(0.5, histogram_of(values, bounds)) == pytest.approx(0.5)


@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 0.99])
def test_exponential_distribution_within_its_bucket(q: float) -> None:
    """20 000 exponential latencies (mean 0.8 s) through the engine's buckets: the estimate is
    within the bucket holding the true quantile, and within 10 % of it (buckets there are
    25-50 % wide, linear interpolation does much better than that on a smooth density)."""
    rng = random.Random(7)
    values = [rng.expovariate(1 / 0.8) for _ in range(20_000)]
    true = -0.8 * math.log(1 - q)
    estimate = histogram_quantile(q, histogram_of(values))
    assert estimate is not None
    upper = next(b for b in LATENCY_BUCKETS if b >= true)
    lower = max((b for b in LATENCY_BUCKETS if b < true), default=0.0)
    assert lower <= estimate <= upper
    assert estimate == pytest.approx(true, rel=0.10)


# ---- windows: increase between reads -------------------------------------------------------


def test_increase_is_the_difference_of_two_reads() -> None:
    first = [0.05] * 10
    later = first + [3.0] * 5
    window = increase(histogram_of(first), histogram_of(later))
    assert window.count == 5
    assert histogram_quantile(0.95, window) > 2.5  # only the slow ones are in the window
    assert histogram_quantile(0.95, histogram_of(later)) > 2.5
    assert histogram_quantile(0.5, histogram_of(later)) < 0.1  # the cumulative read still says fast


def test_counter_reset_takes_the_new_read_as_the_increase() -> None:
    """A restarted pod counts from zero: like rate(), the new value is the increase."""
    before = histogram_of([0.05] * 100)
    after = histogram_of([2.0] * 7)
    window = increase(before, after)
    assert window == after
    assert all(c >= 0 for c in window.counts)


def test_a_new_created_timestamp_is_a_reset_even_if_counts_grew() -> None:
    before = histogram_of([0.05] * 3).model_copy(update={"created": 1000.0})
    after = histogram_of([0.05] * 3 + [2.0] * 9).model_copy(update={"created": 2000.0})
    assert increase(before, after).count == 12
    same_process = after.model_copy(update={"created": 1000.0})
    assert increase(before, same_process).count == 9


def test_changed_buckets_are_a_reset() -> None:
    before = histogram_of([0.5] * 5, bounds=(1.0, 2.0))
    after = histogram_of([0.5] * 6, bounds=(0.5, 1.0, 2.0))
    assert increase(before, after) == after


def test_first_read_is_an_empty_window() -> None:
    window = increase(None, histogram_of([1.0] * 50))
    assert window.count == 0
    assert histogram_quantile(0.95, window) is None


def test_merge_sums_pods_and_skips_other_buckets() -> None:
    a, b = histogram_of([0.1] * 19), histogram_of([10.0] * 1)
    total = merge([a, b])
    assert total is not None and total.count == 20
    # p95 over both pods: rank 19 is the last fast one; a per-pod average of p95s would say 5 s.
    assert histogram_quantile(0.95, total) == pytest.approx(0.1)
    odd = histogram_of([50.0] * 100, bounds=(1.0, 100.0))
    assert merge([a, odd]).count == 19
    assert merge([]) is None


def test_histogram_is_plain_json_for_the_status() -> None:
    h = histogram_of([1.0, 5000.0]).model_copy(update={"created": 1.5})
    text = json.dumps(h.model_dump(mode="json"), allow_nan=False)
    assert Histogram.model_validate(json.loads(text)) == h


# ---- parsing --------------------------------------------------------------------------------


def test_parses_what_the_engine_exports() -> None:
    metrics = ServingMetrics("m")
    reading = parse(generate_latest(metrics.registry).decode())
    assert reading.ttft is not None and reading.tpot is not None
    assert reading.ttft.bounds == LATENCY_BUCKETS
    assert reading.ttft.count == 0 and reading.ttft.created is not None
    assert (reading.waiting, reading.running, reading.kv_usage) == (0, 0, 0)


def test_parses_vllm_names_alone() -> None:
    """A vLLM pod exports only vllm:* names: keep just those lines of the engine's vLLM-compatible
    output (checked against vLLM's exporter in engine/serving/metrics.py)."""
    text = generate_latest(ServingMetrics("m", vllm_compatible=True).registry).decode()
    vllm_only = (
        "\n".join(line for line in text.splitlines() if line.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:")))
        + "\n"
    )
    assert "kvpilot_" not in vllm_only
    reading = parse(vllm_only)
    assert reading.ttft is not None and reading.tpot is not None
    assert reading.waiting == 0 and reading.kv_usage == 0


def test_the_kv_blocks_our_engine_allocated_are_read_from_its_cache_config_info() -> None:
    metrics = ServingMetrics("m", vllm_compatible=True)
    assert parse(generate_latest(metrics.registry).decode()).kv_blocks is None  # not loaded yet
    metrics.on_engine_loaded(block_size=16, num_gpu_blocks=5_120, enable_prefix_caching=True)
    assert parse(generate_latest(metrics.registry).decode()).kv_blocks == 5_120
    broken = generate_latest(metrics.registry).decode().replace('num_gpu_blocks="5120"', 'num_gpu_blocks="many"')
    with pytest.raises(MetricsError, match="num_gpu_blocks is not a count"):
        parse(broken)


def test_our_names_win_over_vllm_names() -> None:
    ours = exposition_of([0.1])
    theirs = exposition_of([0.1] * 5, name="vllm:time_to_first_token_seconds")
    assert parse(ours + theirs).ttft.count == 1
    assert parse(theirs).ttft.count == 5


def test_older_vllm_names() -> None:
    text = (
        exposition_of([0.02] * 3, name="vllm:time_per_output_token_seconds")
        + '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    )
    reading = parse(text)
    assert reading.tpot is not None and reading.tpot.count == 3
    assert reading.kv_usage == 0.5


def test_label_sets_are_summed_and_kv_takes_the_fullest() -> None:
    """vLLM labels each engine core's series with `engine`."""
    text = (
        "\n".join(
            [
                "# TYPE vllm:time_to_first_token_seconds histogram",
                'vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0"} 2',
                'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 3',
                'vllm:time_to_first_token_seconds_count{engine="0"} 3',
                'vllm:time_to_first_token_seconds_sum{engine="0"} 4',
                'vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0"} 5',
                'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 5',
                'vllm:time_to_first_token_seconds_count{engine="1"} 5',
                'vllm:time_to_first_token_seconds_sum{engine="1"} 2',
                "# TYPE vllm:num_requests_waiting gauge",
                'vllm:num_requests_waiting{engine="0"} 2',
                'vllm:num_requests_waiting{engine="1"} 3',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0"} 0.25',
                'vllm:kv_cache_usage_perc{engine="1"} 0.75',
            ]
        )
        + "\n"
    )
    reading = parse(text)
    assert reading.ttft == Histogram(bounds=(1.0,), counts=(7.0,), count=8.0)
    assert reading.waiting == 5
    assert reading.kv_usage == 0.75
    assert reading.tpot is None and reading.running is None


def test_bad_bodies_are_refused() -> None:
    with pytest.raises(MetricsError):
        parse("<html>not metrics</html>\n")
    no_inf = (
        '# TYPE kvpilot_time_to_first_token_seconds histogram\nkvpilot_time_to_first_token_seconds_bucket{le="1.0"} 2\n'
    )
    with pytest.raises(MetricsError, match=r"\+Inf"):
        parse(no_inf)


@pytest.mark.parametrize(
    "body",
    [
        "",
        # What an engine that hung mid-answer had sent when its connection was closed cleanly.
        "# HELP kvpilot_num_requests_waiting Requests wa",
        # Another exporter on the engine's port.
        "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 12.5\n",
    ],
)
def test_a_body_without_any_series_the_autoscaler_reads_is_refused(body: str) -> None:
    """Parsed as a reading, such a pod counted as reporting and idle: the status named no unknown
    pod, and its deletion cost said idle (0) instead of unknown (-1)."""
    with pytest.raises(MetricsError, match="none of the series the autoscaler reads"):
        parse(body)


_TTFT = "kvpilot_time_to_first_token_seconds"


@pytest.mark.parametrize(
    "family, kind, lines, why",
    [
        ("kvpilot_num_requests_waiting", "gauge", ["kvpilot_num_requests_waiting +Inf"], "not finite"),
        ("kvpilot_num_requests_waiting", "gauge", ["kvpilot_num_requests_waiting NaN"], "not finite"),
        ("kvpilot_num_requests_waiting", "gauge", ["kvpilot_num_requests_waiting -1e6"], "below 0"),
        # A negative label set would cancel another's requests in the sum: each is checked, not the sum.
        (
            "vllm:num_requests_waiting",
            "gauge",
            ['vllm:num_requests_waiting{engine="0"} 20', 'vllm:num_requests_waiting{engine="1"} -20'],
            "below 0",
        ),
        ("kvpilot_num_requests_running", "gauge", ["kvpilot_num_requests_running -1"], "below 0"),
        ("kvpilot_kv_cache_usage_ratio", "gauge", ["kvpilot_kv_cache_usage_ratio 1.5"], "above 1"),
        ("kvpilot_kv_cache_usage_ratio", "gauge", ["kvpilot_kv_cache_usage_ratio NaN"], "not finite"),
        # prometheus_client's TYPE line names a counter with its _total.
        (
            "kvpilot_spec_decode_num_draft_tokens_total",
            "counter",
            ["kvpilot_spec_decode_num_draft_tokens_total -Inf"],
            "not finite",
        ),
        (
            "kvpilot_spec_decode_num_accepted_tokens_total",
            "counter",
            ["kvpilot_spec_decode_num_accepted_tokens_total -3"],
            "below 0",
        ),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="1.0"}} NaN', f'{_TTFT}_bucket{{le="+Inf"}} 3'], "not finite"),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="1.0"}} 1', f'{_TTFT}_bucket{{le="+Inf"}} NaN'], "not finite"),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="1.0"}} -5', f'{_TTFT}_bucket{{le="+Inf"}} 3'], "below 0"),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="1.0"}} 1', f'{_TTFT}_bucket{{le="+Inf"}} -1'], "below 0"),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="NaN"}} 1', f'{_TTFT}_bucket{{le="+Inf"}} 1'], "not finite"),
        (_TTFT, "histogram", [f'{_TTFT}_bucket{{le="+Inf"}} 1', f"{_TTFT}_created NaN"], "not finite"),
    ],
)
def test_samples_out_of_range_refuse_the_reading(family: str, kind: str, lines: list[str], why: str) -> None:
    """A number the autoscaler cannot trust makes the pod unknown (MetricsError, with the series
    and why), never a reading: +Inf waiting overflowed its arithmetic, NaN reached the status, a
    negative waiting count cancelled another pod's queue."""
    text = f"# TYPE {family} {kind}\n" + "".join(f"{line}\n" for line in lines)
    with pytest.raises(MetricsError, match=why) as refused:
        parse(text)
    assert family.split(":")[-1] in str(refused.value)
