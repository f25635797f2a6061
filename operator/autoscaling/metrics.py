"""What one engine pod's /metrics says, and windowed quantiles from two reads of it (pure).

The operator scales on the engines' own histograms: a read gives cumulative bucket counts since
the process started, so the latencies of a window are the difference of two reads (what PromQL's
`rate()` feeds `histogram_quantile()`), and the quantile is interpolated within a bucket exactly as
`histogram_quantile` does (prometheus/promql/quantile.go, `BucketQuantile`):

- no observations in the window: no value (PromQL: NaN);
- the quantile's rank falls in the +Inf bucket: the largest finite upper bound ("more than that");
- the lowest bucket starts at 0 when its upper bound is positive; a bucket is interpolated
  linearly;
- a counter that went down (the pod's process restarted) counts its new value as the window's
  increase, as `rate()` does; the `_created` timestamp moving says the same even when the new
  process has already counted past the old values.

Names: ours (`kvpilot_*`, engine/serving/metrics.py) first, else vLLM's (`vllm:*`), so the
operator also scales vLLM-compatible pods. Samples of several label sets (vLLM's `engine` label,
one series per engine core) are summed; KV usage takes the fullest. Every sample must be finite and
in range (counts, gauges and buckets >= 0, KV usage <= 1), and a body must hold at least one of the
series read, or the read is refused (`MetricsError`) and the pod is unknown for the period: a pod's
bad number, or its silence, never reaches the others' signals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpilot.operator.api.names import GATEWAY_HELD_METRIC

# Family names (as the parser gives them: histograms without _bucket, counters without _total)
# in order of preference. vLLM before 0.9 named TPOT `vllm:time_per_output_token_seconds` (a
# per-token gap, close enough to scale on) and KV usage `vllm:gpu_cache_usage_perc` (0..1 too).
TTFT_NAMES = ("kvpilot_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
TPOT_NAMES = (
    "kvpilot_time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds",
)
WAITING_NAMES = ("kvpilot_num_requests_waiting", "vllm:num_requests_waiting")
RUNNING_NAMES = ("kvpilot_num_requests_running", "vllm:num_requests_running")
KV_USAGE_NAMES = ("kvpilot_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# Speculative decoding counters (names without _total): what the observed draft acceptance is from.
DRAFT_TOKENS_NAMES = ("kvpilot_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens")
ACCEPTED_TOKENS_NAMES = ("kvpilot_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens")
# Prompt tokens looked up in the prefix cache and served from it: the observed prefix share.
PREFIX_QUERIES_NAMES = ("kvpilot_prefix_cache_queries", "vllm:prefix_cache_queries")
PREFIX_HITS_NAMES = ("kvpilot_prefix_cache_hits", "vllm:prefix_cache_hits")
# The KV cache's shape as a gauge of 1 whose labels carry it (both runtimes export vLLM's name):
# num_gpu_blocks is the pool the engine allocated, the planner's kvBlocks measured.
CACHE_CONFIG_NAME = "vllm:cache_config_info"


class MetricsError(ValueError):
    """A /metrics body that is not a Prometheus text exposition, or lacks what the operator needs."""


class Histogram(BaseModel):
    """Cumulative bucket counts of one classic histogram. `bounds` are the finite upper bounds
    (ascending), `counts[i]` the observations <= bounds[i]; `count` is the +Inf bucket (all
    observations). Kept without the +Inf bound so that the model stays plain JSON (status)."""

    model_config = ConfigDict(frozen=True)

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float = Field(ge=0)
    # The series' _created timestamp, when the exporter gives one: a new value means a new process.
    created: float | None = None

    @model_validator(mode="after")
    def _shape(self) -> Histogram:
        if len(self.bounds) != len(self.counts):
            raise ValueError(f"{len(self.bounds)} bounds but {len(self.counts)} counts")
        if any(b >= a for a, b in zip(self.bounds[1:], self.bounds, strict=False)):
            raise ValueError("bucket bounds are not strictly ascending")
        return self


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """PromQL's `histogram_quantile(q, ...)` over one histogram's buckets; None where PromQL
    returns NaN (no observations, or no finite bucket to interpolate in)."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    # Cumulative counts can only rise with the bound; PromQL forces that before interpolating
    # (a scrape is not atomic across buckets), then the +Inf bucket is the total.
    counts: list[float] = []
    for value in (*histogram.counts, histogram.count):
        counts.append(max(value, counts[-1]) if counts else value)
    bounds = (*histogram.bounds, math.inf)
    observations = counts[-1]
    if len(bounds) < 2 or observations <= 0:
        return None
    rank = q * observations
    # The first bucket whose cumulative count reaches the rank; the +Inf bucket when none of the
    # finite ones does (sort.Search over all but the last bucket).
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, in_bucket = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        in_bucket -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / in_bucket)


def increase(before: Histogram | None, after: Histogram) -> Histogram:
    """The observations between two reads of one pod's histogram. A reset (any count went down,
    the _created time moved, the buckets changed with a new engine version) makes the second read
    the whole increase, as Prometheus' `rate()` does; no earlier read means no window yet, an
    empty one."""
    if before is None:
        return Histogram(bounds=after.bounds, counts=(0.0,) * len(after.bounds), count=0.0, created=after.created)
    reset = (
        before.bounds != after.bounds
        or (before.created is not None and after.created is not None and before.created != after.created)
        or after.count < before.count
        or any(a < b for a, b in zip(after.counts, before.counts, strict=True))
    )
    if reset:
        return after
    return Histogram(
        bounds=after.bounds,
        count=after.count - before.count,
        created=after.created,
        counts=tuple(a - b for a, b in zip(after.counts, before.counts, strict=True)),
    )


def counter_increase(before: float | None, after: float | None) -> float:
    """A counter's increase between two reads, as `increase()` takes it: a value that went down
    (the process restarted) is the increase itself; no earlier read (or none now) is no window."""
    if before is None or after is None:
        return 0.0
    return after if after < before else after - before


def merge(histograms: Iterable[Histogram]) -> Histogram | None:
    """The sum of histograms with the same buckets (several pods' windows: `sum by (le)`); a
    histogram whose buckets differ from the first one's is left out rather than mis-added.
    None when there is none."""
    total: Histogram | None = None
    for histogram in histograms:
        if total is None:
            total = histogram.model_copy(update={"created": None})
        elif histogram.bounds == total.bounds:
            total = Histogram(
                bounds=total.bounds,
                count=total.count + histogram.count,
                counts=tuple(a + b for a, b in zip(total.counts, histogram.counts, strict=True)),
            )
    return total


class EngineReading(BaseModel):
    """One read of one engine's /metrics: what the autoscaler needs. A field is None when the
    engine does not export it."""

    model_config = ConfigDict(frozen=True)

    ttft: Histogram | None = None
    tpot: Histogram | None = None
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    # Cumulative draft tokens proposed and accepted (speculative decoding), and prompt tokens looked
    # up in the prefix cache and found there; None when not exported.
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    kv_blocks: int | None = None  # KV blocks the engine allocated (vllm:cache_config_info's num_gpu_blocks)


def _sample_name(sample: Sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}}" if labels else sample.name


def _checked(name: str, value: float, high: float = math.inf) -> float:
    """`value` if it is a number the autoscaler can act on: one +Inf overflowed its arithmetic
    every period, a NaN reached the status (not JSON) and hid other signals, a negative waiting
    count cancelled another pod's queue in the mean. Otherwise MetricsError, which makes the pod
    unknown for the period."""
    if not math.isfinite(value):
        raise MetricsError(f"{name} is {value}: not finite")
    if value < 0:
        raise MetricsError(f"{name} is {value}: below 0")
    if value > high:
        raise MetricsError(f"{name} is {value}: above {high:g}")
    return value


def _histogram(samples: Sequence[Sample], name: str, created: float | None) -> Histogram:
    """Sum the buckets of every label set of one histogram family."""
    by_bound: dict[float, float] = {}
    for sample in samples:
        if sample.name == f"{name}_bucket":
            try:
                bound = float(sample.labels["le"])
            except (KeyError, ValueError):
                raise MetricsError(f"{_sample_name(sample)} has no numeric le") from None
            if math.isnan(bound) or bound == -math.inf:
                raise MetricsError(f"{_sample_name(sample)}: le {bound} is not finite")
            by_bound[bound] = by_bound.get(bound, 0.0) + _checked(_sample_name(sample), sample.value)
    if math.inf not in by_bound:
        raise MetricsError(f"{name} has no +Inf bucket")
    # The +Inf bucket is the count by definition; trust it over _count, which is not read.
    count = by_bound.pop(math.inf)
    bounds = tuple(sorted(by_bound))
    return Histogram(bounds=bounds, counts=tuple(by_bound[b] for b in bounds), count=count, created=created)


def _kv_blocks(family: Metric | None) -> int | None:
    """The fewest num_gpu_blocks among the engine's cache_config_info label sets (one per engine
    core); None when it exports none."""
    blocks = []
    for sample in family.samples if family else ():
        value = sample.labels.get("num_gpu_blocks", "")
        if not value.isdigit():
            raise MetricsError(f"{_sample_name(sample)}: num_gpu_blocks is not a count")
        blocks.append(int(value))
    return min(blocks) if blocks else None


def parse(text: str) -> EngineReading:
    """An engine's /metrics body (Prometheus text format) as an EngineReading."""
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except (ValueError, TypeError, IndexError, KeyError) as error:
        raise MetricsError(f"not a Prometheus text exposition: {error}") from None

    def first(names: Sequence[str], kind: str) -> Metric | None:
        return next((families[n] for n in names if n in families and families[n].type == kind), None)

    def created_of(name: str) -> float | None:
        # The client exports _created as its own gauge family; several label sets give the newest.
        family = families.get(f"{name}_created")
        values = [_checked(_sample_name(s), s.value) for s in family.samples] if family else []
        return max(values) if values else None

    def histogram(names: Sequence[str]) -> Histogram | None:
        family = first(names, "histogram")
        return _histogram(family.samples, family.name, created_of(family.name)) if family else None

    def gauge(
        names: Sequence[str], combine: Callable[[Iterable[float]], float], kind: str = "gauge", high: float = math.inf
    ) -> float | None:
        family = first(names, kind)
        samples = [s for s in family.samples if not s.name.endswith("_created")] if family else []
        if not samples:
            return None
        # Each label set on its own: a negative one would cancel another's requests in the sum.
        return combine(_checked(_sample_name(s), s.value, high) for s in samples)

    reading = EngineReading(
        ttft=histogram(TTFT_NAMES),
        tpot=histogram(TPOT_NAMES),
        waiting=gauge(WAITING_NAMES, sum),
        running=gauge(RUNNING_NAMES, sum),
        kv_usage=gauge(KV_USAGE_NAMES, max, high=1.0),
        draft_tokens=gauge(DRAFT_TOKENS_NAMES, sum, "counter"),
        accepted_tokens=gauge(ACCEPTED_TOKENS_NAMES, sum, "counter"),
        prefix_queries=gauge(PREFIX_QUERIES_NAMES, sum, "counter"),
        prefix_hits=gauge(PREFIX_HITS_NAMES, sum, "counter"),
        kv_blocks=_kv_blocks(families.get(CACHE_CONFIG_NAME)),
    )
    if all(value is None for value in (reading.ttft, reading.tpot, reading.waiting, reading.running, reading.kv_usage)):
        # An empty 200 (an engine cut off mid-answer, another exporter on the port) says nothing
        # about load: counted as a reading, it was a reporting, idle pod (deletion cost 0, not
        # unknown), and the status named no unknown pod.
        raise MetricsError(
            "none of the series the autoscaler reads (TTFT, TPOT, waiting, running, KV usage; kvpilot_* or "
            "vllm:* names) is there: not an engine's /metrics"
        )
    return reading


def parse_gateway(text: str) -> dict[tuple[str, str], float]:
    """A gateway's /metrics body: the requests it holds per (namespace, InferenceService). The
    family must be there (empty when it holds nothing): a body without it is not a gateway's, and
    reading it as "nothing held" would let a queue go unseen."""
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except (ValueError, TypeError, IndexError, KeyError) as error:
        raise MetricsError(f"not a Prometheus text exposition: {error}") from None
    family = families.get(GATEWAY_HELD_METRIC)
    if family is None or family.type != "gauge":
        raise MetricsError(f"no {GATEWAY_HELD_METRIC} gauge: not a kvpilot gateway's /metrics")
    held: dict[tuple[str, str], float] = {}
    for sample in family.samples:
        key = (sample.labels.get("namespace", ""), sample.labels.get("service", ""))
        held[key] = held.get(key, 0.0) + _checked(_sample_name(sample), sample.value)
    return held


HISTOGRAM_NAMES = (*TTFT_NAMES, *TPOT_NAMES)
GAUGE_NAMES = (*WAITING_NAMES, *RUNNING_NAMES, *KV_USAGE_NAMES, CACHE_CONFIG_NAME)
COUNTER_NAMES = (*DRAFT_TOKENS_NAMES, *ACCEPTED_TOKENS_NAMES, *PREFIX_QUERIES_NAMES, *PREFIX_HITS_NAMES)
# The series a Prometheus holds for what `parse` reads, each with its family and the TYPE the text
# format gives it: a histogram's buckets and count, and its `_created` gauge (prometheus_client
# exports it; a new value says the process restarted); the gauges; the counters, whose TYPE line
# names them with their _total, as prometheus_client writes it.
_SERIES: dict[str, tuple[str, str]] = {
    **{
        name: family
        for h in HISTOGRAM_NAMES
        for name, family in (
            (f"{h}_bucket", (h, "histogram")),
            (f"{h}_count", (h, "histogram")),
            (f"{h}_created", (f"{h}_created", "gauge")),
        )
    },
    **{g: (g, "gauge") for g in GAUGE_NAMES},
    **{f"{c}_total": (f"{c}_total", "counter") for c in COUNTER_NAMES},
}
SERIES_NAMES = tuple(_SERIES)


def exposition_of_series(series: Iterable[Mapping[str, Any]]) -> str:
    """Series from a Prometheus instant query (`data.result` of /api/v1/query: each a `metric`
    label set with `__name__`, and a `value` [time, "number"]) as the text exposition they were
    scraped from, so that `parse` reads a pod's series from Prometheus as it reads its /metrics."""
    families: dict[str, tuple[str, list[str]]] = {}
    for one in series:
        labels = dict(one["metric"])
        name = str(labels.pop("__name__"))
        family, kind = _SERIES.get(name, (name, "gauge"))
        rendered = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
        families.setdefault(family, (kind, []))[1].append(f"{name}{{{rendered}}} {one['value'][1]}")
    # The text format wants each family's samples together, after its TYPE line.
    return "".join(
        f"# TYPE {family} {kind}\n" + "".join(f"{line}\n" for line in lines)
        for family, (kind, lines) in families.items()
    )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
