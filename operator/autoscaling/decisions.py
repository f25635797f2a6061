"""The SLO autoscaler's decisions (pure): desired replicas from what the engines report.

One `step()` per period and InferenceService: it takes the previous `AutoscalerState` and this
period's reads of the ready pods, and returns the new state and a `Decision`. Both are plain
pydantic data, so the state lives in the InferenceService's status and survives an operator
restart; the caller does the I/O (scrape, scale subresource, Event).

Signals, each a ratio to its target (1.0 = at the target):
- p95 TTFT and p95 TPOT over the last `window_seconds` (bucket increases of every pod, summed,
  then PromQL's interpolation) against `spec.slo`, once the window holds MIN_OBSERVATIONS;
- waiting requests per reporting replica against `maxWaitingPerReplica`: TTFT only counts
  requests that got a first token, so a queue that builds shows here first. The requests the
  gateways hold for the service (waiting for a wake or for an engine with room, gateways.py) are
  waiting work too, shared among the replicas: a queue in the gateway scales up, even while the
  replicas are still loading;
- KV-cache usage against `targetKvCacheUsage`: a full cache preempts and recomputes;
- running sequences per replica against the plan's max_num_seqs x TARGET_BATCH_OCCUPANCY, each
  pod's against its own engine's limit (a mixed pool's GPU types each have theirs).
Gauges are averaged over the window's reads: one read is a sample of something that moves with
every request.

Rules (each has a test in tests/operator/autoscaling/test_decisions.py):
- the largest ratio decides; within `1 ± tolerance` nothing moves (noise);
- up: above 1 + tolerance (for `scaleUpStabilizationSeconds`), to ceil(replicas × ratio), at
  least one more, at most `maxStep` more; never while pods of the last scale-up are not ready
  (more pending pods do not help a scheduler that cannot place the first ones), and once they
  are, the window starts again (what it held was the reason for that scale-up);
- lead time (with the plan's cold start): the request rate's line over the last TREND_POINTS
  periods, when its slope is clear of the noise, grows the ratio to where it will be one cold
  start on; an up comes when that is over the band, pods of a scale-up still within one cold
  start get more while the rate rises, and a scale-down counts the grown load;
- down: each period recommends the fewest replicas n at which the observed load would still sit
  under 1 − tolerance, taking the load per replica to grow as replicas/n. That holds for the
  queue, KV and batch, and for the affine part of latency, but queueing makes latency convex in
  the load: so the controller also learns `knee`, the requests per second per replica at which
  this service went over the band (from steady windows without a backlog), and never plans a
  rate per replica past it. Replicas go down to the largest recommendation of the last
  `scaleDownStabilizationSeconds`, only once that long has passed since the last change, at
  most `maxStep` at a time;
- a window in which the engines run or queue requests but none got a first token or finished is
  overload or blindness (reads too slow, requests longer than the window), never idleness: hold,
  and the scale-down window starts again;
- a regime (the window a scale-down waits for) starts once a replica is ready, so a service
  woken from zero is not judged idle while its engine loads; an engine started since the
  last period counts what it served before its first read (its series' _created says when);
- a window entry spans at most one period: an idle service writes no state, and the requests of
  its next period are not spread over the idle hour;
- pods whose /metrics cannot be read are unknown: left out of the signals, named in the reason,
  and they do not stop the others from scaling; a gateway pod that cannot be read is unknown
  too, named in the reason, and stops any scale-down (it may hold a queue), never a scale-up;
- to zero (minReplicas 0) only after a stabilization window in which no request arrived at all
  and every pod reported: a trickle too thin for a p95 still keeps one replica, and so does an
  engine still loading for the request that woke it;
- replicas changed by someone else (the gateway scaling from zero, `kubectl scale`) start a new
  regime, as the controller's own changes do: the recommendations made for the old count go;
- min/max replicas bound everything; mode `external` and `off` never change replicas (signals are
  still computed for the status); at 0 replicas nothing reports, so nothing moves here: the
  gateway (operator/gateway/) sees the demand in front of the engines and scales from zero.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvpilot.operator.api.spec import AutoscalingSpec, InferenceServiceSpec, SLOSpec
from kvpilot.operator.autoscaling.gateways import GatewayRead
from kvpilot.operator.autoscaling.metrics import (
    EngineReading,
    Histogram,
    counter_increase,
    histogram_quantile,
    increase,
    merge,
)
from kvpilot.operator.autoscaling.variant_windows import (
    PodIncrease,
    VariantSignals,
    VariantWindow,
    period_by_variant,
    variant_signals,
)

QUANTILE = 0.95
# Running sequences per replica, as a fraction of max_num_seqs, that counts as fully used: a
# batch slot free most of the time keeps a request's wait for one short (Erlang C: 8 slots at 0.8
# wait with probability ~0.3, for a fraction of one request's service time).
TARGET_BATCH_OCCUPANCY = 0.8
# A p95 of fewer requests than this is mostly their maximum: shown, but not acted on. A service
# that slow to fill a window is not one that more replicas help; its queue would say if it were.
MIN_OBSERVATIONS = 20
# How often the operator reads the engines (`kvpilot operator --autoscale-interval`), and how far
# back a window reaches, in periods: a window spans a few reads so that a p95 rests on more than
# one period's requests.
INTERVAL_SECONDS = 15.0
WINDOW_PERIODS = 4
WINDOW_SECONDS = WINDOW_PERIODS * INTERVAL_SECONDS
# The lead time follows the request rate per replica of each period (first tokens, not the window's
# mean: periods apart are independent samples) over the last TREND_POINTS periods, and acts on a
# rise only when its slope is TREND_T standard errors above zero: a steady load's Poisson noise
# extrapolated over a cold start must not look like a ramp.
TREND_POINTS = 12
TREND_T = 4.0
# Floating-point slack for ceil(): 2 × 0.45 / 0.9 must be 1, not 1.0000000000000002 -> 2.
_EPSILON = 1e-9

Action = Literal["up", "down", "hold"]
# Why, in one word a dashboard can group by (the operator's decisions counter): an up names the
# signal over the band; a hold or down names the rule that decided.
Cause = Literal[
    "trend",
    "ttft",
    "tpot",
    "waiting",
    "kv",
    "batch",
    "under_band",
    "in_band",
    "replica_bounds",
    "scale_up_window",
    "scale_down_window",
    "max_replicas",
    "min_replicas",
    "pods_pending",
    "blind",
    "gateway_unknown",
    "few_observations",
    "would_overload",
    "recent_peak",
    "no_signal",
    "zero_replicas",
    "not_slo_mode",
]


class _Data(BaseModel):
    # camelCase in the status, like the rest of it; frozen: a step returns new state, never edits.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)


# The autoscaling settings the policy takes from the spec as they are, with the spec's own types,
# bounds and defaults (one declaration: api/spec.py's AutoscalingSpec).
_SPEC_SETTINGS = (
    "mode",
    "min_replicas",
    "max_replicas",
    "max_step",
    "tolerance",
    "max_waiting_per_replica",
    "target_kv_cache_usage",
    "scale_up_stabilization_seconds",
    "scale_down_stabilization_seconds",
)
_SpecSettings = create_model(
    "_SpecSettings",
    __base__=_Data,
    **{
        name: (AutoscalingSpec.model_fields[name].annotation, AutoscalingSpec.model_fields[name])
        for name in _SPEC_SETTINGS
    },
)


class Policy(_SpecSettings):  # type: ignore[misc, valid-type]
    """What the spec asks of the autoscaler: its autoscaling settings, the SLO in seconds, and what
    the operator adds (the window, the plan's batch limit)."""

    ttft_p95_seconds: float = Field(default=SLOSpec().ttft_p95_ms / 1000, gt=0)
    tpot_p95_seconds: float = Field(default=SLOSpec().tpot_p95_ms / 1000, gt=0)
    window_seconds: float = Field(default=WINDOW_SECONDS, gt=0)
    # The engines' batch limit (the plan's max_num_seqs); None: no occupancy signal.
    max_num_seqs: int | None = Field(default=None, gt=0)
    # A replica's predicted time to ready (the plan's): scaling to zero waits at least this long
    # without a request, since a zero pays only when idle for longer than a replica takes to return.
    cold_start_seconds: float = Field(default=0.0, ge=0)
    target_batch_occupancy: float = Field(default=TARGET_BATCH_OCCUPANCY, gt=0, le=1)
    # A mixed pool's capacity (req/s within the SLO) of each replica in the order the pool adds them
    # (cheapest per req/s first, status.variants): replicas of unequal capacity are scaled in
    # capacity, not in count. Empty: every replica alike.
    replica_capacity: tuple[float, ...] = ()

    @classmethod
    def from_spec(
        cls,
        spec: InferenceServiceSpec,
        max_num_seqs: int | None = None,
        interval_seconds: float = INTERVAL_SECONDS,
        cold_start_seconds: float = 0.0,
        replica_capacity: tuple[float, ...] = (),
    ) -> Policy:
        return cls(
            max_num_seqs=max_num_seqs,
            cold_start_seconds=cold_start_seconds,
            replica_capacity=replica_capacity,
            window_seconds=WINDOW_PERIODS * interval_seconds,
            ttft_p95_seconds=spec.slo.ttft_p95_ms / 1000,
            tpot_p95_seconds=spec.slo.tpot_p95_ms / 1000,
            **{name: getattr(spec.autoscaling, name) for name in _SPEC_SETTINGS},
        )


class PodRead(_Data):
    """One ready pod's /metrics this period: a reading, or why there is none."""

    name: str
    reading: EngineReading | None = None
    error: str | None = None
    # Its engine's batch limit where pods differ (a mixed pool: its GPU type's planned max_num_seqs);
    # None: the policy's.
    max_num_seqs: int | None = Field(default=None, gt=0)
    # Its variant's label value in a mixed pool (names.VARIANT_LABEL); None: a service of one type.
    variant: str | None = None


class Observation(_Data):
    """What the caller saw this period."""

    now: float  # seconds since the epoch
    replicas: int = Field(ge=0)  # the scale subresource's spec.replicas
    ready_replicas: int = Field(ge=0)
    pods: tuple[PodRead, ...] = ()  # the ready pods, each read once
    # What the gateways hold for this service; None: the operator reads no gateway.
    gateway: GatewayRead | None = None


# The engines' counters a window sums the increases of (EngineReading's fields of these names).
COUNTERS = ("draft_tokens", "accepted_tokens", "prefix_queries", "prefix_hits")


class Baseline(_Data):
    """A pod's last cumulative histograms and counters, the start of its next increase."""

    ttft: Histogram | None = None
    tpot: Histogram | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


class Mean(_Data):
    """Gauge values summed over pods (and periods), with how many there were."""

    total: float = 0.0
    n: int = 0

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Mean:
        known = [v for v in values if v is not None]
        return cls(total=sum(known), n=len(known))

    def __add__(self, other: Mean) -> Mean:
        return Mean(total=self.total + other.total, n=self.n + other.n)

    def value(self) -> float | None:
        return self.total / self.n if self.n else None


class WindowEntry(_Data):
    """One period ending at `at`: the increase of all pods' histograms, and the gauges read.
    Gauges are averaged over the window like the histograms: one read of `running` is a sample
    of a quantity that moves with every request."""

    at: float
    seconds: float = 0.0  # since the previous period
    ttft: Histogram | None = None
    tpot: Histogram | None = None
    # Pods whose TTFT increase covers the whole period (they had a baseline): ttft.count over
    # seconds x pods is the request rate per replica.
    pods_with_baseline: int = 0
    waiting: Mean = Mean()
    running: Mean = Mean()
    # Each pod's running sequences over its own engine's max_num_seqs.
    occupancy: Mean = Mean()
    kv_usage: Mean = Mean()
    # Requests the gateways held for the service (one sample a period, when they were read).
    held: Mean = Mean()
    # Speculative decoding: draft tokens proposed and accepted in the period, all pods; prompt
    # tokens looked up in the prefix cache and found there.
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    # A mixed pool's increases per variant (variant_windows): each type's own p95s, shown.
    variants: dict[str, VariantWindow] = Field(default_factory=dict)


class Recommendation(_Data):
    at: float
    replicas: int


class TrendPoint(_Data):
    """One period's first tokens per second per replica: a point of the trend the lead time follows."""

    at: float
    rate: float


class Signals(_Data):
    """The numbers a decision rests on (None: nothing observed)."""

    ttft_p95_seconds: float | None = None
    tpot_p95_seconds: float | None = None
    ttft_observations: int = 0  # requests in the window behind each p95
    tpot_observations: int = 0
    # The engines' queues and the gateways' (their held requests shared among the replicas).
    waiting_per_replica: float | None = None
    # Requests held in the gateways (mean over the window; None: no gateway read), and the gateway
    # pods that could not be read this period: while any is unknown, nothing scales down.
    gateway_held: float | None = None
    gateway_unknown: tuple[str, ...] = ()
    kv_cache_usage: float | None = None
    running_per_replica: float | None = None
    batch_occupancy: float | None = None  # mean of each pod's running / its max_num_seqs
    # Requests per second per replica (first tokens in the window): unlike latency, it grows in
    # exact proportion to the load per replica.
    rate_per_replica: float | None = None
    # Accepted over proposed draft tokens in the window (speculative decoding; None: no drafts):
    # the measured counterpart of the planner's assumed acceptance. Shown, not acted on.
    draft_acceptance: float | None = None
    # Prompt tokens served from the prefix cache over those looked up (None: no prompts): the
    # measured counterpart of load.prefixShare. Shown, not acted on.
    prefix_share: float | None = None
    # The fewest KV blocks a reporting engine allocated (None: none says): the measured counterpart
    # of the plan's kvBlocks. Shown, not acted on.
    kv_blocks: int | None = None
    # A mixed pool's p95s per variant (label value) over the window. Shown, not acted on.
    variants: dict[str, VariantSignals] = Field(default_factory=dict)
    reporting: int = 0
    unknown: tuple[str, ...] = ()
    # The largest ratio of a signal to its target, and which signal it is.
    ratio: float | None = None
    limiting: str | None = None


class Decision(_Data):
    at: float
    action: Action
    replicas: int  # desired: what the scale subresource should say
    previous: int
    reason: str
    # Empty in a decision an older operator stored.
    cause: Cause | Literal[""] = ""
    signals: Signals


class AutoscalerState(_Data):
    """Everything the next step needs from this one (kept in the status)."""

    baselines: dict[str, Baseline] = Field(default_factory=dict)
    window: tuple[WindowEntry, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    # When the current run of scale-down recommendations started: the last change of replicas,
    # or the first step. Scale-down waits until it is a stabilization window old.
    observed_since: float | None = None
    over_since: float | None = None  # first step of the current run above the band
    # Requests per second per replica at which the signals last went over the band in a steady
    # window, raised when a steady window is comfortable above it: where this service's latency
    # breaks, learned. Scale-down never plans a rate per replica above it.
    knee: float | None = None
    # The last read in which a pod's queue was past its target (a backlog).
    backlog_at: float | None = None
    last_scale_up: Recommendation | None = None
    last_decision: Decision | None = None
    # The last TREND_POINTS periods' ratios under these replicas (a change of replicas starts anew).
    trend: tuple[TrendPoint, ...] = ()

    # Kept in the status, written every period that changes something: compact. Every pod's
    # baseline holds two histograms whose bucket bounds are the same for all pods (1,246 bytes a
    # pod, bounds included): the dumped state lists each distinct set of bounds once, under
    # BOUNDS_KEY, and a histogram names its set by index; whole cumulative counts are written as the
    # integer count of each bucket (`deltas`: mostly zeros), the exact same numbers back on reading.
    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        table: list[list[float]] = []
        data = _share_bounds(data, table)
        return {**data, BOUNDS_KEY: table} if table else data

    @model_validator(mode="before")
    @classmethod
    def _expand(cls, data: Any) -> Any:
        if not isinstance(data, dict) or BOUNDS_KEY not in data:
            return data  # a state written before the compact form, or none
        table = data[BOUNDS_KEY]
        return _unshare_bounds({k: v for k, v in data.items() if k != BOUNDS_KEY}, table)


BOUNDS_KEY = "bucketBounds"
_HISTOGRAM_KEYS = {"bounds", "counts", "count"}


def _share_bounds(value: Any, table: list[list[float]]) -> Any:
    """`value` (a dumped state) with each histogram's bounds replaced by their index in `table`."""
    if isinstance(value, dict):
        if _HISTOGRAM_KEYS <= value.keys():
            bounds = list(value["bounds"])
            if bounds not in table:
                table.append(bounds)
            shared = {**value, "bounds": table.index(bounds)}
            counts = [value["count"], *value["counts"]]
            if all(float(c).is_integer() for c in counts):
                whole = [int(c) for c in value["counts"]]
                del shared["counts"]
                shared["deltas"] = [b - a for a, b in zip([0, *whole], whole)]
                shared["count"] = int(value["count"])
            return shared
        return {key: _share_bounds(item, table) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_share_bounds(item, table) for item in value]
    return value


def _unshare_bounds(value: Any, table: Sequence[Sequence[float]]) -> Any:
    if isinstance(value, dict):
        if isinstance(value.get("bounds"), int):
            expanded = {**value, "bounds": table[value["bounds"]]}
            if "deltas" in expanded:
                expanded["counts"] = list(itertools.accumulate(expanded.pop("deltas")))
            return expanded
        return {key: _unshare_bounds(item, table) for key, item in value.items()}
    if isinstance(value, list):
        return [_unshare_bounds(item, table) for item in value]
    return value


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:.0f} ms"


def _held_share(held: float | None, serving: int) -> float:
    """The gateways' held requests per replica: what each would take on were they sent now."""
    return (held or 0.0) / max(serving, 1)


def _signals(policy: Policy, window: Sequence[WindowEntry], obs: Observation) -> Signals:
    ttft = merge(e.ttft for e in window if e.ttft is not None)
    tpot = merge(e.tpot for e in window if e.tpot is not None)
    reads = obs.pods
    readings = [p.reading for p in reads if p.reading is not None]
    # Shared among the replicas that report, or (none yet: all loading) among those asked for.
    held = sum((e.held for e in window), Mean()).value()
    waiting = sum((e.waiting for e in window), Mean()).value()
    if held:
        waiting = (waiting or 0.0) + _held_share(held, len(readings) or obs.replicas)
    running = sum((e.running for e in window), Mean()).value()
    replica_seconds = sum(e.seconds * e.pods_with_baseline for e in window if e.ttft is not None)
    started = sum(e.ttft.count for e in window if e.ttft is not None)
    drafted = sum(e.draft_tokens for e in window)
    looked_up = sum(e.prefix_queries for e in window)
    signals = Signals(
        draft_acceptance=sum(e.accepted_tokens for e in window) / drafted if drafted > 0 else None,
        prefix_share=min(1.0, sum(e.prefix_hits for e in window) / looked_up) if looked_up > 0 else None,
        kv_blocks=min(blocks) if (blocks := [r.kv_blocks for r in readings if r.kv_blocks is not None]) else None,
        ttft_p95_seconds=histogram_quantile(QUANTILE, ttft) if ttft else None,
        tpot_p95_seconds=histogram_quantile(QUANTILE, tpot) if tpot else None,
        ttft_observations=int(ttft.count) if ttft else 0,
        tpot_observations=int(tpot.count) if tpot else 0,
        waiting_per_replica=waiting,
        gateway_held=held,
        gateway_unknown=obs.gateway.unknown if obs.gateway is not None else (),
        kv_cache_usage=sum((e.kv_usage for e in window), Mean()).value(),
        running_per_replica=running,
        batch_occupancy=sum((e.occupancy for e in window), Mean()).value(),
        rate_per_replica=started / replica_seconds if replica_seconds > 0 else None,
        variants=variant_signals((e.variants for e in window), QUANTILE),
        reporting=len(readings),
        unknown=tuple(sorted(p.name for p in reads if p.reading is None)),
    )
    known = signal_ratios(policy, signals)
    if not known or not (readings or held):
        return signals
    limiting = max(known, key=known.__getitem__)
    return signals.model_copy(update={"ratio": known[limiting], "limiting": limiting})


def signal_ratios(policy: Policy, signals: Signals) -> dict[str, float]:
    """Each known signal over its target (a p95 only of MIN_OBSERVATIONS requests or more)."""
    enough_ttft = signals.ttft_observations >= MIN_OBSERVATIONS
    enough_tpot = signals.tpot_observations >= MIN_OBSERVATIONS
    ratios = {
        "TTFT": (signals.ttft_p95_seconds if enough_ttft else None, policy.ttft_p95_seconds),
        "TPOT": (signals.tpot_p95_seconds if enough_tpot else None, policy.tpot_p95_seconds),
        "waiting": (signals.waiting_per_replica, policy.max_waiting_per_replica),
        "KV": (signals.kv_cache_usage, policy.target_kv_cache_usage),
        "batch": (signals.batch_occupancy, policy.target_batch_occupancy),
    }
    return {name: value / target for name, (value, target) in ratios.items() if value is not None}


def describe(policy: Policy, s: Signals, knee: float | None) -> str:
    """The signals as one line of numbers, for the reason of every decision."""
    kv = "none" if s.kv_cache_usage is None else f"{s.kv_cache_usage:.0%}"
    batch = (
        ""
        if s.batch_occupancy is None
        else f", batch {s.batch_occupancy:.0%} full (target {policy.target_batch_occupancy:.0%})"
    )
    waiting = "none" if s.waiting_per_replica is None else f"{s.waiting_per_replica:.1f}"
    held = "" if s.gateway_held is None else f"; {s.gateway_held:.1f} requests held in the gateway"
    text = (
        f"p95 TTFT {_ms(s.ttft_p95_seconds)} of {s.ttft_observations} (SLO {_ms(policy.ttft_p95_seconds)}), "
        f"p95 TPOT {_ms(s.tpot_p95_seconds)} of {s.tpot_observations} (SLO {_ms(policy.tpot_p95_seconds)}), "
        f"waiting {waiting}/replica (max {policy.max_waiting_per_replica:g}{held}), "
        f"KV {kv} (target {policy.target_kv_cache_usage:.0%}){batch}; pods reporting: {s.reporting}"
    )
    if s.unknown:
        text += f", unknown: {len(s.unknown)} ({', '.join(s.unknown)})"
    if s.gateway_unknown:
        text += f"; gateway pods unknown: {len(s.gateway_unknown)} ({'; '.join(s.gateway_unknown)})"
    if s.rate_per_replica is not None:
        text += f"; {s.rate_per_replica:.2f} req/s per replica"
        if knee is not None:
            text += f" (over the band at {knee:.2f})"
    if s.ratio is not None:
        text += f"; {s.limiting} at {s.ratio:.2f}x its target"
    return text


def _period_increase(before: Histogram | None, after: Histogram, since: float) -> tuple[Histogram, bool]:
    """A pod's observations in the period that began at `since`, and whether they cover all of it
    (its rate counts). A pod's first read has no baseline; but an engine started since then (its
    series' _created says so) served everything it counts in this period: the requests that woke it
    from zero, say. Counting them as nothing read as idle."""
    if before is None and after.created is not None and after.created >= since:
        return after, True
    return increase(before, after), before is not None


def _held_sample(gateway: GatewayRead | None) -> Mean:
    """This period's held requests, a sample when some gateway answered with them or all did (a
    period with every gateway unknown says nothing)."""
    if gateway is None or (gateway.unknown and not gateway.held):
        return Mean()
    return Mean.of([gateway.held])


def _occupancy(policy: Policy, pod: PodRead) -> float | None:
    """A pod's running sequences as a fraction of its own engine's batch limit: an L4 full at 24 is
    not a third full by an H100's 72."""
    limit = pod.max_num_seqs or policy.max_num_seqs
    if pod.reading is None or pod.reading.running is None or not limit:
        return None
    return pod.reading.running / limit


def _advance_window(
    policy: Policy, state: AutoscalerState, obs: Observation
) -> tuple[dict[str, Baseline], tuple[WindowEntry, ...]]:
    """New baselines and the window with this period's increases appended, old entries dropped."""
    baselines: dict[str, Baseline] = {}
    increases: list[PodIncrease] = []
    with_baseline = 0
    counted = dict.fromkeys(COUNTERS, 0.0)
    previous = state.last_decision.at if state.last_decision is not None else obs.now
    for pod in obs.pods:
        before = state.baselines.get(pod.name, Baseline())
        if pod.reading is None:
            # Keep its baseline: its next read's increase covers the periods it missed.
            baselines[pod.name] = before
            continue
        r = pod.reading
        ttft = tpot = None
        if r.ttft is not None:
            ttft, whole_period = _period_increase(before.ttft, r.ttft, previous)
            with_baseline += whole_period
        if r.tpot is not None:
            tpot = _period_increase(before.tpot, r.tpot, previous)[0]
        increases.append((pod.variant or "", ttft, tpot))
        for counter in COUNTERS:
            counted[counter] += counter_increase(getattr(before, counter), getattr(r, counter))
        baselines[pod.name] = Baseline(ttft=r.ttft, tpot=r.tpot, **{c: getattr(r, c) for c in COUNTERS})
    readings = [p.reading for p in obs.pods if p.reading is not None]
    # At most one period: an idle service writes no state, so the last decision can be an hour
    # old, while its increases (nothing counted in between, or a write would have followed) all
    # fall in the last period. Spread over the hour they read as a rate near zero.
    period = min(obs.now - previous, policy.window_seconds / WINDOW_PERIODS)
    entry = WindowEntry(
        at=obs.now,
        seconds=period,
        ttft=merge(h for _, h, _ in increases if h is not None),
        tpot=merge(h for _, _, h in increases if h is not None),
        pods_with_baseline=with_baseline,
        waiting=Mean.of([r.waiting for r in readings]),
        running=Mean.of([r.running for r in readings]),
        occupancy=Mean.of([_occupancy(policy, pod) for pod in obs.pods]),
        kv_usage=Mean.of([r.kv_usage for r in readings]),
        held=_held_sample(obs.gateway),
        variants=period_by_variant(increases),
        **counted,
    )
    window = tuple(e for e in state.window if e.at > obs.now - policy.window_seconds) + (entry,)
    return baselines, window


def _learn_knee(
    policy: Policy,
    knee: float | None,
    signals: Signals,
    window: Sequence[WindowEntry],
    backlog_at: float | None,
    steady: bool,
) -> float | None:
    """The rate per replica where the signals cross the band, from windows in which replicas did
    not change (a window that straddles a change mixes two loads per replica).

    An over-band window teaches only if no pod's queue was past its target from the read before
    it on: with a long queue the rate is whatever the pods manage to serve, and while a backlog
    drains it is lower still (a pod's queue is its own: new pods do not take over old pods'
    queues) while the TTFT of the requests that waited in it stays high for a while; neither says
    where this load per replica breaks."""
    rate, ratio = signals.rate_per_replica, signals.ratio
    if not steady or rate is None or rate <= 0 or ratio is None:
        return knee
    if ratio > 1 + policy.tolerance:
        window_start = window[0].at - window[0].seconds
        if backlog_at is not None and backlog_at >= window_start:
            return knee
        return rate if knee is None else min(knee, rate)
    if knee is not None and ratio <= 1 - policy.tolerance and rate > knee:
        return rate
    return knee


def _capacity(policy: Policy, replicas: int) -> float:
    """What `replicas` of a mixed pool serve (req/s), the pool's first ones first; past the listed
    ones, each counts as the last listed (they go where the pool puts its overflow)."""
    listed = policy.replica_capacity
    return sum(listed[:replicas]) + max(0, replicas - len(listed)) * listed[-1]


def _share_kept(policy: Policy, current: int) -> float:
    """What one replica fewer serves, as a share of what `current` serve (the last added goes first)."""
    if not policy.replica_capacity:
        return max(current - 1, 1) / current
    total = _capacity(policy, current)
    return _capacity(policy, max(current - 1, 1)) / total if total else 1.0


def scaled(policy: Policy, current: int, factor: float) -> int:
    """The fewest replicas with `factor` times what `current` replicas serve: current x factor where
    every replica is alike, else counted in the pool's order (an L4 replica added is not an H100)."""
    if not policy.replica_capacity:
        return math.ceil(current * factor - _EPSILON)
    listed, needed = policy.replica_capacity, _capacity(policy, current) * factor - _EPSILON
    bound, served = max(policy.max_replicas, current), 0.0
    # One running sum, not a sum per candidate: a pool's list is as long as its maxReplicas.
    for n in range(bound):
        if served >= needed:
            return n
        served += listed[n] if n < len(listed) else listed[-1]
    return bound


def _clamp(policy: Policy, replicas: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))


class _Period(NamedTuple):
    """One period after its window advanced: what every decision of it is made from."""

    policy: Policy
    obs: Observation
    state: AutoscalerState  # the new window, baselines, knee; the last decision still the old one
    signals: Signals
    numbers: str  # the signals as a decision's reason shows them
    since: float  # when the present regime (these replicas) began to be observed
    knee: float | None

    def decide(
        self, action: Action, cause: Cause, replicas: int, why: str, **changes: object
    ) -> tuple[AutoscalerState, Decision]:
        if action != "hold":
            # A change starts a new regime: earlier recommendations were made for other replicas.
            changes.update(recommendations=(), observed_since=self.obs.now, over_since=None)
        decision = Decision(
            at=self.obs.now,
            action=action,
            replicas=replicas,
            previous=self.obs.replicas,
            reason=f"{why}: {self.numbers}",
            cause=cause,
            signals=self.signals,
        )
        return self.state.model_copy(update={**changes, "last_decision": decision}), decision


def _observe(policy: Policy, state: AutoscalerState, obs: Observation) -> _Period:
    """Advance the window by this period's reads and derive the signals from it."""
    baselines, window = _advance_window(policy, state, obs)
    current = obs.replicas
    if state.last_decision is not None and state.last_decision.replicas != current:
        state = state.model_copy(update={"recommendations": (), "observed_since": None, "over_since": None})
    since = state.observed_since if state.observed_since is not None else obs.now
    if obs.ready_replicas == 0:
        # A regime starts when a replica is ready: a service woken from zero whose engine took
        # longer to load than the scale-down window has not been idle. (Not "all ready": a pod
        # that never schedules must not hold a service at a size its load no longer needs.)
        since = obs.now
    last_up = state.last_scale_up
    if last_up is not None and obs.ready_replicas >= min(last_up.replicas, current):
        # Its pods are all ready (or replicas went below it since): nothing of it is pending any
        # more, and a pod that fails later is not "the last scale-up" holding the next one.
        last_up = None
        # What the window saw before they were ready (the queue they came to drain, the TTFT of
        # requests that waited in it) is no reason for another scale-up: start it again.
        window = window[-1:]
    signals = _signals(policy, window, obs)
    settled = obs.now - since >= policy.window_seconds
    trend, newest = state.trend, window[-1]
    if newest.at == obs.now and newest.ttft is not None and newest.seconds > 0:
        trend = (*trend, TrendPoint(at=obs.now, rate=newest.ttft.count / newest.seconds))[-TREND_POINTS:]
    backlog_at = state.backlog_at
    held_now = _held_share(obs.gateway.held if obs.gateway else None, signals.reporting or current)
    if held_now > policy.max_waiting_per_replica or any(
        (p.reading.waiting or 0) > policy.max_waiting_per_replica for p in obs.pods if p.reading
    ):
        backlog_at = obs.now
    knee = _learn_knee(
        policy,
        state.knee,
        signals,
        window,
        backlog_at,
        steady=settled and last_up is None,
    )
    state = state.model_copy(
        update={
            "baselines": baselines,
            "window": window,
            "observed_since": since,
            "last_scale_up": last_up,
            "knee": knee,
            "backlog_at": backlog_at,
            "trend": trend,
        }
    )
    return _Period(policy, obs, state, signals, describe(policy, signals, knee), since, knee)


def step(policy: Policy, state: AutoscalerState, obs: Observation) -> tuple[AutoscalerState, Decision]:
    """One period: the new state and what to do about replicas."""
    period = _observe(policy, state, obs)
    current = obs.replicas
    if policy.mode != "slo":
        return period.decide(
            "hold", "not_slo_mode", current, f"autoscaling.mode is {policy.mode}: replicas are left as they are"
        )
    if current == 0:
        # Nothing runs, so nothing reports: the gateway, which sees requests arrive, scales from
        # zero. Scaled to zero by hand, it stays there (as under an HPA) until replicas are set.
        return period.decide(
            "hold", "zero_replicas", 0, "0 replicas: no engine reports load; the gateway scales up on the next request"
        )
    bounded = _clamp(policy, current)
    if bounded != current:
        action: Action = "up" if bounded > current else "down"
        return period.decide(
            action,
            "replica_bounds",
            bounded,
            f"{current} replicas is outside [{policy.min_replicas}, {policy.max_replicas}]: {current} -> {bounded}",
        )
    if period.signals.ratio is None:
        return period.decide("hold", "no_signal", current, "no signal (no pod reported metrics)")
    # Where the load is heading one cold start on: what replicas asked for now will meet.
    # Where the load is heading one cold start on (the signals grown with the request rate): what
    # replicas asked for now will meet when they are ready.
    ahead = period.signals.ratio * (projected_growth(period.state.trend, policy.cold_start_seconds) or 1.0)
    if max(period.signals.ratio, ahead) > 1 + policy.tolerance:
        return _over_band(period, max(period.signals.ratio, ahead))
    if _blind(period.signals):
        # Neither the latency signals nor the load can be trusted to be low: hold, and restart the
        # scale-down window (what it held before this did not see the load either).
        return period.decide(
            "hold",
            "blind",
            current,
            "requests are running or waiting but none got a first token or "
            "finished in the window: overload or a window too short to see one, not idleness",
            over_since=None,
            recommendations=(),
            observed_since=obs.now,
        )
    return _at_or_under_band(period)


def _over_band(period: _Period, ratio: float) -> tuple[AutoscalerState, Decision]:
    """Up by `ratio` (at most maxStep), once the scale-up window has passed and the last scale-up's
    pods are ready: the ratio now, or the one its trend reaches within one cold start (the lead
    time: pods asked for now serve when it is there)."""
    policy, obs, state = period.policy, period.obs, period.state
    current = obs.replicas
    now_over = (period.signals.ratio or 0.0) > 1 + policy.tolerance
    band = "over the SLO band" if now_over else f"heading over the SLO band ({ratio:.2f}x in one cold start)"
    over_since = state.over_since if state.over_since is not None else obs.now
    rec = Recommendation(at=obs.now, replicas=current)
    held = {"over_since": over_since, "recommendations": (*state.recommendations, rec)}
    if current >= policy.max_replicas:
        return period.decide(
            "hold", "max_replicas", current, f"{band} but at maxReplicas {policy.max_replicas}", **held
        )
    waited = obs.now - over_since
    up_window = policy.scale_up_stabilization_seconds
    if waited < up_window:
        return period.decide(
            "hold",
            "scale_up_window",
            current,
            f"{band} for {waited:.0f} s of the {up_window:.0f} s scale-up window",
            **held,
        )
    last = state.last_scale_up
    wanted = max(current + 1, scaled(policy, current, ratio))
    if last is not None:
        # Its pods were sized for the load then. While they are still within one cold start of
        # being asked for (starting, not stuck on a full node), a request rate still rising asks
        # for more: as many more as it will have grown by when they are ready. What the ready
        # pods measure meanwhile (the queue the starting ones come to drain) is no measure of it.
        starting = obs.now - last.at < policy.cold_start_seconds
        growth = projected_growth(state.trend, policy.cold_start_seconds) if starting else None
        wanted = scaled(policy, current, growth or 1.0)
        if wanted <= current:
            return period.decide(
                "hold",
                "pods_pending",
                current,
                f"{band}, but the last scale-up to {last.replicas} has {obs.ready_replicas} ready: "
                "waiting for its pods",
                **held,
            )
    desired = min(policy.max_replicas, current + policy.max_step, wanted)
    return period.decide(
        "up",
        # Over the band: some signal is the limiting one.
        _UP_CAUSES[str(period.signals.limiting)] if now_over else "trend",
        desired,
        f"{band} (> {1 + policy.tolerance:.2f}x): {current} -> {desired}",
        last_scale_up=Recommendation(at=obs.now, replicas=desired),
    )


def projected_growth(trend: Sequence[TrendPoint], ahead: float) -> float | None:
    """How many times today's request rate the rate will be `ahead` seconds on, on the
    least-squares line through the last TREND_POINTS periods' rates; None without a lead time, with
    fewer points, or when the rise is not clear of the noise (TREND_T)."""
    if ahead <= 0 or len(trend) < TREND_POINTS:
        return None
    now = trend[-1].at
    line = _rising_line([(p.at, p.rate) for p in trend])
    if line is None:
        return None
    at_now = line(now)
    return line(now + ahead) / at_now if at_now > 0 else None


def _rising_line(points: Sequence[tuple[float, float]]) -> Callable[[float], float] | None:
    """The least-squares line through `points`, when its slope is TREND_T standard errors above
    zero; None otherwise."""
    mean_t = sum(t for t, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if not spread or len(points) < 3:
        return None
    slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / spread
    residual = sum((r - mean_r - slope * (t - mean_t)) ** 2 for t, r in points) / (len(points) - 2)
    if slope <= TREND_T * math.sqrt(residual / spread):
        return None
    return lambda t: mean_r + slope * (t - mean_t)


# The signal over the band (Signals.limiting) as the cause of a scale-up.
_UP_CAUSES: dict[str, Cause] = {"TTFT": "ttft", "TPOT": "tpot", "waiting": "waiting", "KV": "kv", "batch": "batch"}


def _blind(signals: Signals) -> bool:
    """A window with requests in the engines and not one of them seen to start or finish: the
    engines are too slow to show latency (or their reads are), which is never idleness."""
    busy = (signals.running_per_replica or 0) > 0 or (signals.waiting_per_replica or 0) > 0
    return busy and signals.ttft_observations == 0 and signals.tpot_observations == 0


def _thin_latency_not_under(policy: Policy, s: Signals) -> str | None:
    """A p95 latency of too few requests to act on (MIN_OBSERVATIONS) that is not under the band, said
    as a reason; None where there is none. Too few to scale up on, and no ground to scale down: an
    engine overloaded on a slow CPU finishes fewer requests per window than that, and the KV and
    batch signals, the only ones left, read nearly empty there."""
    latencies = (
        ("TTFT", s.ttft_p95_seconds, s.ttft_observations, policy.ttft_p95_seconds),
        ("TPOT", s.tpot_p95_seconds, s.tpot_observations, policy.tpot_p95_seconds),
    )
    for name, p95, count, target in latencies:
        if p95 is not None and 0 < count < MIN_OBSERVATIONS and p95 / target > 1 - policy.tolerance:
            return (
                f"under the band in what it can judge, but p95 {name} of {count} requests (fewer than "
                f"{MIN_OBSERVATIONS} to act on) is {p95 / target:.2f}x its target: no scale-down"
            )
    return None


def _why_not_fewer(
    policy: Policy, current: int, ratio: float, load: float, blind_gateway: bool, thin_latency: str | None
) -> tuple[Cause, str]:
    """Why a period at or under the band recommends no fewer replicas."""
    if blind_gateway:
        return "gateway_unknown", "under the band, but what the gateway holds is unknown: no scale-down"
    if thin_latency:
        return "few_observations", thin_latency
    if ratio > 1 - policy.tolerance:
        return "in_band", "within the tolerance band"
    if current > policy.min_replicas:
        fewer = load / _share_kept(policy, current)
        return "would_overload", f"under the band, but {current - 1} replicas would not be (x{fewer:.2f})"
    return "min_replicas", f"under the band, at minReplicas {policy.min_replicas}"


def _down_window(policy: Policy, recommended: int) -> float:
    """The scale-down window; to zero, at least one cold start: a zero pays only when the service is
    idle for longer than a replica takes to come back."""
    window = policy.scale_down_stabilization_seconds
    return max(window, policy.cold_start_seconds) if recommended == 0 else window


def _load(period: _Period) -> float:
    """The largest signal ratio as a scale-down sees it: grown to where a rising request rate takes
    it within one cold start (fewer replicas now would be asked back before they could return),
    and no lower than the rate per replica over the learned knee."""
    load = (period.signals.ratio or 0.0) * (
        projected_growth(period.state.trend, period.policy.cold_start_seconds) or 1.0
    )
    if period.knee is not None and period.signals.rate_per_replica is not None:
        load = max(load, period.signals.rate_per_replica / period.knee)
    return load


def _at_or_under_band(period: _Period) -> tuple[AutoscalerState, Decision]:
    """The fewest replicas at which this load stays under 1 - tolerance, in every signal and (once
    known) in the request rate at which this service went over; down to them only when every
    recommendation of the scale-down window agrees."""
    policy, obs, state, signals = period.policy, period.obs, period.state, period.signals
    current, ratio, tol = obs.replicas, signals.ratio or 0.0, policy.tolerance
    load = _load(period)
    if load <= 1 - tol:
        fewest = scaled(policy, current, load / (1 - tol))
        if signals.ttft_observations or signals.tpot_observations or signals.waiting_per_replica or signals.unknown:
            # Requests came, or a pod could not say (an engine still loading for a request the
            # gateway holds): zero only after a window in which every pod saw none.
            fewest = max(fewest, 1)
        recommended = min(current, max(policy.min_replicas, current - policy.max_step, fewest))
    else:
        recommended = current
    # A gateway that could not say what it holds may hold a queue: never fewer replicas on that.
    blind_gateway = bool(signals.gateway_unknown) and recommended < current
    if blind_gateway:
        recommended = current
    thin_latency = _thin_latency_not_under(policy, signals) if recommended < current else None
    if thin_latency:
        recommended = current
    down_window = _down_window(policy, recommended)
    recent = tuple(r for r in state.recommendations if r.at > obs.now - down_window)
    recs = (*recent, Recommendation(at=obs.now, replicas=recommended))
    kept = {"over_since": None, "recommendations": recs}
    if recommended >= current:
        cause, why = _why_not_fewer(policy, current, ratio, load, blind_gateway, thin_latency)
        return period.decide("hold", cause, current, why, **kept)
    observed = obs.now - period.since
    if observed < down_window:
        return period.decide(
            "hold",
            "scale_down_window",
            current,
            f"under the band ({recommended} replicas would do), for "
            f"{observed:.0f} s of the {down_window:.0f} s scale-down window"
            + (" (to zero: at least one cold start)" if recommended == 0 and policy.cold_start_seconds else ""),
            **kept,
        )
    desired = max(r.replicas for r in recs)
    if desired >= current:
        return period.decide(
            "hold",
            "recent_peak",
            current,
            f"under the band now, but the last {down_window:.0f} s needed {desired} replicas",
            **kept,
        )
    return period.decide(
        "down",
        "under_band",
        desired,
        f"under the band for {down_window:.0f} s, {desired} replicas would stay "
        f"under {1 - tol:.2f}x: {current} -> {desired}",
    )
