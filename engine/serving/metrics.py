"""Prometheus metrics of one engine: the latencies the operator scales on, and the engine's state.

The engine thread (the only thread that sees requests change) records almost everything; the
event loop counts 429s and serves the registry on /metrics. prometheus-client is thread-safe.

Latencies are per sequence (an n=2 request is two sequences). Under kvpilot_ names:
  queue time   arrival at the server -> first scheduled
  TTFT         arrival -> first output token
  ITL          gap between consecutive output tokens of one sequence (tokens that arrive together,
               speculative decoding, share their step's gap)
  TPOT         (finish - first token) / (output tokens - 1), for sequences with >= 2 tokens
  e2e          arrival -> finish
TTFT, queue time and ITL are observed as they happen, so a client that gives up still counts;
TPOT and e2e only for sequences that finished normally (stop or length), so an abort does not
pass for a fast answer.

Under vllm: names the meanings are vLLM's own (vllm/v1/metrics/stats.py, IterationStats, and the
output processor that feeds it, in vLLM 0.33.0), which differ:
  ITL          one observation per engine step that gave a sequence tokens after its first: the
               time since its previous such step, however many tokens the step gave
  queue time   engine queue (the engine thread took the request) -> first scheduled, observed
               when the sequence finishes
  TPOT         (last token - first token) / (output tokens - 1), 0 for a 1-token sequence,
               observed for every sequence the engine finishes, including those it aborts
  e2e, request_success
               every sequence the engine finishes (stop, length, or aborted by the engine: a
               failed request), none that the client aborted (vLLM's abort path records no stats)

With vllm_compatible, the same observations are also exported under the names vLLM's dashboards
and the Gateway API Inference Extension's endpoint picker read, with vLLM's `model_name` label.
Those names, types and labels were checked against the Prometheus exporter of vLLM 0.33.0
(PrometheusStatLogger in vllm/v1/metrics/loggers.py; the wheel's version commit is 4ba787ec9):
per-request TPOT is `vllm:request_time_per_output_token_seconds` (the old
`vllm:time_per_output_token_seconds` is gone), KV usage is `vllm:kv_cache_usage_perc` only (no
`vllm:gpu_cache_usage_perc`). vLLM also labels every series with `engine` (the index of its
engine core); kvpilot runs one engine per server and leaves that label out. vLLM's
`vllm:admission_rejections` counts 503s for its `--max-num-queued-reqs` (waiting + running), a
different limit from our 429 on the waiting queue, so our rejections have no vllm: name.

With LoRA on, `vllm:lora_requests_info` is exported whatever vllm_compatible says (it has no
kvpilot_ twin, and endpoint pickers route adapters by it), exactly as vLLM 0.33's
PrometheusStatLogger does: a gauge documented "Running stats on lora requests.", labelled
max_lora, waiting_lora_adapters and running_lora_adapters (the adapters' names joined by commas),
no model_name label, whose value is the time (set_to_current_time) the labels were last true, so
the series with the highest value is the current one. Beside it, kvpilot_lora_requests_total and
kvpilot_lora_generation_tokens_total count per adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.engine.core.request import FinishReason
from kvpilot.engine.core.scheduler import SchedulerStats
from kvpilot.engine.outputs import StepOutput

# 1 ms to 20 min, at least four buckets per decade: enough for a p95 from histogram_quantile()
# over GPU inter-token gaps of a few ms as well as CPU e2e latencies of several minutes (a long
# generation on a CPU pod). Above the top bucket a quantile only says "more than 1200 s".
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
    300.0,
    450.0,
    600.0,
    900.0,
    1200.0,
)


@dataclass(frozen=True)
class MetricSpec:
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str  # kvpilot_<name>
    vllm_name: str | None  # vllm:<name>, or None where vLLM has no equivalent
    doc: str
    labels: tuple[str, ...] = ()


SPECS = {
    "ttft": MetricSpec(
        Histogram,
        "time_to_first_token_seconds",
        "time_to_first_token_seconds",
        "Time from arrival to the first output token, per sequence.",
    ),
    "tpot": MetricSpec(
        Histogram,
        "time_per_output_token_seconds",
        "request_time_per_output_token_seconds",
        "Mean time per output token after the first, per finished sequence.",
    ),
    "itl": MetricSpec(
        Histogram,
        "inter_token_latency_seconds",
        "inter_token_latency_seconds",
        "Time between two consecutive output tokens of a sequence.",
    ),
    "e2e": MetricSpec(
        Histogram,
        "e2e_request_latency_seconds",
        "e2e_request_latency_seconds",
        "Time from arrival to finish, per finished sequence.",
    ),
    "queue": MetricSpec(
        Histogram,
        "request_queue_time_seconds",
        "request_queue_time_seconds",
        "Time from arrival to first being scheduled, per sequence.",
    ),
    "running": MetricSpec(Gauge, "num_requests_running", "num_requests_running", "Sequences in the running batch."),
    "waiting": MetricSpec(
        Gauge, "num_requests_waiting", "num_requests_waiting", "Sequences waiting to be scheduled (new or preempted)."
    ),
    "kv_usage": MetricSpec(
        Gauge,
        "kv_cache_usage_ratio",
        "kv_cache_usage_perc",
        "Fraction of KV-cache blocks held by requests (0..1); cached blocks that no request holds count as free.",
    ),
    "prompt_tokens": MetricSpec(Counter, "prompt_tokens", "prompt_tokens", "Prompt tokens of admitted sequences."),
    "generation_tokens": MetricSpec(Counter, "generation_tokens", "generation_tokens", "Output tokens generated."),
    "finished": MetricSpec(
        Counter,
        "request_success",
        "request_success",
        "Sequences finished, by reason (stop, length, abort).",
        ("finished_reason",),
    ),
    "preemptions": MetricSpec(
        Counter, "num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks (recomputed later)."
    ),
    "prefix_queries": MetricSpec(
        Counter, "prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
    ),
    "prefix_hits": MetricSpec(
        Counter, "prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache."
    ),
    "spec_drafts": MetricSpec(
        Counter,
        "spec_decode_num_drafts",
        "spec_decode_num_drafts",
        "Speculative verification steps: one per sequence and step that verified drafts.",
    ),
    "spec_draft_tokens": MetricSpec(
        Counter, "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."
    ),
    "spec_accepted": MetricSpec(
        Counter,
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted (mean accepted length: accepted / drafts).",
    ),
    "spec_accepted_per_pos": MetricSpec(
        Counter,
        "spec_decode_num_accepted_tokens_per_pos",
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        ("position",),
    ),
    "spec_emitted": MetricSpec(
        Counter,
        "spec_decode_num_emitted_tokens",
        None,
        "Tokens emitted by verification steps: accepted drafts plus one sampled token per step.",
    ),
    "rejected": MetricSpec(
        Counter, "requests_rejected", None, "HTTP requests refused with 429 because the waiting queue was full."
    ),
    # Per LoRA adapter (vLLM exports no per-adapter counters; its vllm:lora_requests_info is below).
    "lora_requests": MetricSpec(
        Counter, "lora_requests", None, "Sequences admitted, by the LoRA adapter they run with.", ("lora_name",)
    ),
    "lora_generation_tokens": MetricSpec(
        Counter, "lora_generation_tokens", None, "Output tokens generated, by LoRA adapter.", ("lora_name",)
    ),
}


class _Family:
    """One logical metric, exported under one or two names."""

    def __init__(self, children: Sequence[Counter | Gauge | Histogram]) -> None:
        self._children = children

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for child in self._children:
            child.inc(value)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)


class ServingMetrics:
    def __init__(self, model: str, vllm_compatible: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._model = model
        self._vllm_compatible = vllm_compatible
        self._metrics: dict[str, list[Counter | Gauge | Histogram]] = {}
        # Each (metric, labels) child once: prometheus_client's labels() takes a lock and builds
        # a key on every call, and the engine thread updates several metrics per request per step.
        self._families: dict[tuple[str, tuple[str, ...], int | None, int | None], _Family] = {}
        for key, spec in SPECS.items():
            names = [(f"kvpilot_{spec.name}", "model")]
            if vllm_compatible and spec.vllm_name:
                names.append((f"vllm:{spec.vllm_name}", "model_name"))
            self._metrics[key] = [self._make(spec, name, model_label) for name, model_label in names]
        # Create every series now, so that a scrape shows zeros rather than nothing.
        for key, spec in SPECS.items():
            if not spec.labels:
                self._family(key)
        for reason in FinishReason:
            self._family("finished", finished_reason=reason.value)
        # Sequence -> when a step first gave it tokens, and when one last did.
        self._token_times: dict[str, tuple[float, float]] = {}
        # The engine keeps cumulative totals; counters advance by the difference.
        self._seen: dict[tuple[str, str], int] = {}
        self._lora_info: Gauge | None = None  # vllm:lora_requests_info, once LoRA is on
        self._lora_labels: dict[str, str] = {}

    def _make(self, spec: MetricSpec, name: str, model_label: str) -> Counter | Gauge | Histogram:
        kwargs = {"registry": self.registry, "labelnames": (model_label, *spec.labels)}
        if spec.kind is Histogram:
            kwargs["buckets"] = LATENCY_BUCKETS
        return spec.kind(name, spec.doc, **kwargs)

    def _family(self, key: str, **labels: str) -> _Family:
        """Both names of a metric where they mean the same."""
        return self._side(key, slice(None), **labels)

    def _ours(self, key: str, **labels: str) -> _Family:
        """The kvpilot_ name alone, where vLLM's meaning differs."""
        return self._side(key, slice(0, 1), **labels)

    def _vllms(self, key: str, **labels: str) -> _Family:
        """The vllm: name alone (nothing without vllm_compatible)."""
        return self._side(key, slice(1, None), **labels)

    def _side(self, key: str, names: slice, **labels: str) -> _Family:
        values = tuple(labels.values())
        cache_key = (key, values, names.start, names.stop)
        family = self._families.get(cache_key)
        if family is None:
            children = self._metrics[key][names]
            family = self._families[cache_key] = _Family([m.labels(self._model, *values) for m in children])
        return family

    # ---- events, in the order a sequence meets them ----------------------------------------

    def on_admitted(self, num_prompt_tokens: int, lora_name: str | None = None) -> None:
        self._family("prompt_tokens").inc(num_prompt_tokens)
        if lora_name is not None:
            self._ours("lora_requests", lora_name=lora_name).inc()

    def on_rejected(self) -> None:
        self._family("rejected").inc()

    def on_scheduled(self, queue_seconds: float) -> None:
        self._ours("queue").observe(queue_seconds)

    def on_tokens(self, output: StepOutput, now: float) -> None:
        """A step gave the sequence tokens (`now`: when the step ended)."""
        num_tokens = len(output.new_token_ids)
        self._family("generation_tokens").inc(num_tokens)
        if output.lora_name is not None:
            self._ours("lora_generation_tokens", lora_name=output.lora_name).inc(num_tokens)
        times = self._token_times.get(output.request_id)
        if times is None:
            assert output.first_token_time is not None
            self._family("ttft").observe(output.first_token_time - output.arrival_time)
            self._token_times[output.request_id] = (now, now)
            return
        gap = now - times[1]
        self._vllms("itl").observe(gap)
        itl = self._ours("itl")
        for _ in range(num_tokens):
            itl.observe(gap / num_tokens)
        self._token_times[output.request_id] = (times[0], now)

    def on_finished(self, output: StepOutput, now: float, by_client: bool = False) -> None:
        """The sequence's last output; `by_client`: the client aborted it (a disconnect, a closed
        stream, a drain that ran out of time), not the engine."""
        token_times = self._token_times.pop(output.request_id, None)
        reason = FinishReason(output.finish_reason or FinishReason.ABORT)
        self._ours("finished", finished_reason=reason.value).inc()
        if reason is not FinishReason.ABORT:
            self._ours("e2e").observe(now - output.arrival_time)
            if output.num_output_tokens >= 2 and output.first_token_time is not None:
                self._ours("tpot").observe((now - output.first_token_time) / (output.num_output_tokens - 1))
        if not by_client:
            self._finished_as_vllm(output, reason, now, token_times)

    def _finished_as_vllm(
        self, output: StepOutput, reason: FinishReason, now: float, token_times: tuple[float, float] | None
    ) -> None:
        self._vllms("finished", finished_reason=reason.value).inc()
        self._vllms("e2e").observe(now - output.arrival_time)
        if output.queue_time is not None:
            self._vllms("queue").observe(output.queue_time)
        decode = token_times[1] - token_times[0] if token_times is not None else 0.0
        self._vllms("tpot").observe(decode / (output.num_output_tokens - 1) if output.num_output_tokens > 1 else 0.0)

    def on_engine_loaded(self, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool) -> None:
        """vLLM's `vllm:cache_config_info` (a gauge of 1 whose labels carry the KV cache's shape),
        which endpoint pickers (the Gateway API Inference Extension's) read to size their prefix
        index; vLLM labels it with its CacheConfig's fields and the engine index."""
        if not self._vllm_compatible:
            return
        info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "enable_prefix_caching": str(enable_prefix_caching),
            "engine": "0",
        }
        gauge = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info), registry=self.registry
        )
        gauge.labels(**info).set(1)

    def on_lora_enabled(self, max_loras: int) -> None:
        """Export vllm:lora_requests_info (see the module's docstring), empty until the first step."""
        self._lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._lora_labels = {"max_lora": str(max_loras), "waiting_lora_adapters": "", "running_lora_adapters": ""}
        self._lora_info.labels(**self._lora_labels).set_to_current_time()

    def _set_lora_state(self, stats: SchedulerStats) -> None:
        labels = self._lora_labels | {
            "waiting_lora_adapters": ",".join(stats.waiting_loras),
            "running_lora_adapters": ",".join(stats.running_loras),
        }
        if labels != self._lora_labels:  # the series's time says since when its labels hold
            self._lora_labels = labels
            self._lora_info.labels(**labels).set_to_current_time()  # type: ignore[union-attr]

    # ---- engine state, after every step ----------------------------------------------------

    def set_state(self, stats: SchedulerStats) -> None:
        self._family("running").set(stats.num_running)
        self._family("waiting").set(stats.num_waiting)
        self._family("kv_usage").set(stats.kv_cache_usage)
        if self._lora_info is not None:
            self._set_lora_state(stats)
        spec = stats.spec_decoding
        totals = [
            ("preemptions", "", stats.num_preemptions),
            ("prefix_queries", "", stats.prefix_cache_queries),
            ("prefix_hits", "", stats.prefix_cache_hits),
            ("spec_drafts", "", spec.num_drafts),
            ("spec_draft_tokens", "", spec.num_draft_tokens),
            ("spec_accepted", "", spec.num_accepted_tokens),
            ("spec_emitted", "", spec.num_accepted_tokens + spec.num_drafts),
        ]
        totals += [("spec_accepted_per_pos", str(pos), n) for pos, n in enumerate(spec.accepted_per_position)]
        for key, position, total in totals:
            seen = self._seen.get((key, position), 0)
            if total > seen:
                family = self._family(key, position=position) if position else self._family(key)
                family.inc(total - seen)
                self._seen[key, position] = total
