"""The operator's own /metrics (`kvpilot operator --metrics HOST:PORT`): per InferenceService, what
the plan predicted beside the SLO and what the engines measured, replicas desired and ready, and
the autoscaler's decisions by action and cause; a mixed pool's replicas, capacity, cost, observed
p95s and share of the traffic per GPU type; a replica's predicted and observed time to ready.

The gauges are read at scrape time from the InferenceServices the operator's watch holds (their
spec and the status the reconcile and the autoscaler wrote), so every replica of the operator
shows the same numbers, and a service that is gone leaves no series behind. The decisions are
this process's own: a counter per (namespace, service, action, cause), forgotten with the
service. Latencies are in seconds, as Prometheus names them.

Served by aiohttp on kopf's event loop, the loop that updates the watch's index: a scrape never
reads it while it changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from kvpilot.operator.api.conditions import PLAN_ACCURATE
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus, VariantAccuracy, status_of
from kvpilot.operator.autoscaling.decisions import Decision
from kvpilot.operator.kube.indexes import indexed_services

Key = tuple[str, str]
LABELS = ["namespace", "service"]
PREFIX = "kvpilot_operator_"


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1000


def _planned(status: InferenceServiceStatus, field: str) -> float | None:
    value = getattr(status.plan, field) if status.plan else None
    return _ms(value) if value else None  # 0: the plan that does not fit predicts nothing


def _observed(status: InferenceServiceStatus, field: str) -> float | None:
    latency = status.latency
    return _ms(getattr(latency, field)) if latency and latency.source == "observed" else None


def _slo(spec: Mapping[str, Any]) -> tuple[float | None, float | None]:
    try:
        slo = InferenceServiceSpec.model_validate(spec).slo
    except ValidationError:  # the reconcile reports it; nothing to show here
        return None, None
    return slo.ttft_p95_ms / 1000, slo.tpot_p95_ms / 1000


def _accurate(status: InferenceServiceStatus) -> float | None:
    condition = status.condition(PLAN_ACCURATE)
    return {"True": 1.0, "False": 0.0}.get(condition.status if condition else "")


def _accuracy(status: InferenceServiceStatus, part: str, field: str) -> float | None:
    """planAccuracy's `field` of `part`: a signal's ratio, an assumed or observed share."""
    found = getattr(status.plan_accuracy, part) if status.plan_accuracy else None
    return getattr(found, field) if found else None


# (name, help, value from (spec, status)); a None value is no sample.
_GAUGES: tuple[tuple[str, str, Callable[[Mapping[str, Any], InferenceServiceStatus], float | None]], ...] = (
    ("predicted_ttft_p95_seconds", "The plan's predicted p95 TTFT", lambda _, s: _planned(s, "predicted_ttft_ms")),
    ("predicted_tpot_p95_seconds", "The plan's predicted p95 TPOT", lambda _, s: _planned(s, "predicted_tpot_ms")),
    ("slo_ttft_p95_seconds", "The SLO's p95 TTFT (spec.slo.ttftP95Ms)", lambda spec, _: _slo(spec)[0]),
    ("slo_tpot_p95_seconds", "The SLO's p95 TPOT (spec.slo.tpotP95Ms)", lambda spec, _: _slo(spec)[1]),
    (
        "observed_ttft_p95_seconds",
        "p95 TTFT the engines reported over the autoscaler's window",
        lambda _, s: _observed(s, "ttft_p95_ms"),
    ),
    (
        "observed_tpot_p95_seconds",
        "p95 TPOT the engines reported over the autoscaler's window",
        lambda _, s: _observed(s, "tpot_p95_ms"),
    ),
    ("ttft_observed_over_predicted", "Observed over predicted p95 TTFT", lambda _, s: _accuracy(s, "ttft", "ratio")),
    ("tpot_observed_over_predicted", "Observed over predicted p95 TPOT", lambda _, s: _accuracy(s, "tpot", "ratio")),
    (
        "assumed_draft_acceptance",
        "Draft acceptance the plan's TPOT assumes",
        lambda _, s: _accuracy(s, "draft_acceptance", "assumed"),
    ),
    (
        "observed_draft_acceptance",
        "Draft acceptance the engines reported",
        lambda _, s: _accuracy(s, "draft_acceptance", "observed"),
    ),
    (
        "assumed_prefix_share",
        "Share of prompt tokens the plan's TTFT assumes the prefix cache serves (spec.load.prefixShare)",
        lambda _, s: _accuracy(s, "prefix_share", "assumed"),
    ),
    (
        "observed_prefix_share",
        "Share of prompt tokens the engines served from the prefix cache",
        lambda _, s: _accuracy(s, "prefix_share", "observed"),
    ),
    (
        "kv_blocks_observed_over_predicted",
        "The fewest KV blocks an engine allocated over the plan's kvBlocks",
        lambda _, s: _accuracy(s, "kv_blocks", "ratio"),
    ),
    ("plan_accurate", "The PlanAccurate condition: 1 True, 0 False (no sample: Unknown)", lambda _, s: _accurate(s)),
    (
        "desired_replicas",
        "Replicas the service asks for (status.desiredReplicas)",
        lambda _, s: s.desired_replicas,
    ),
    ("replicas", "Engine pods of the service's Deployment", lambda _, s: s.replicas),
    ("ready_replicas", "Engine pods ready", lambda _, s: s.ready_replicas),
    (
        "predicted_ready_seconds",
        "The plan's time from a replica's pod starting to ready",
        lambda _, s: s.plan.predicted_ready_seconds if s.plan else None,
    ),
    (
        "observed_ready_seconds",
        "The newest ready engine pod's time from its start to ready",
        lambda _, s: _accuracy(s, "ready_seconds", "observed"),
    ),
)
# A mixed pool's GPU types (status.variants), labelled with the type and its capacity class (empty:
# none, the same series as before classes): (name, help, the row's field).
_VARIANT_GAUGES = (
    ("variant_replicas", "Replicas of one GPU type of a mixed pool", "replicas"),
    ("variant_ready_replicas", "Ready replicas of one GPU type of a mixed pool", "ready_replicas"),
    ("variant_cost_dollars_per_hour", "What one GPU type's replicas of a mixed pool cost an hour", "cost_per_hour"),
    ("variant_capacity_rps", "Requests per second one replica of the type serves within the SLO", "capacity_rps"),
)

# A mixed pool's GPU types as planAccuracy.variants shows them: (name, help, value from the row).
_VARIANT_ACCURACY_GAUGES: tuple[tuple[str, str, Callable[[VariantAccuracy], float | None]], ...] = (
    (
        "variant_observed_ttft_p95_seconds",
        "p95 TTFT of one GPU type's pods of a mixed pool over the autoscaler's window",
        lambda v: _ms(v.ttft.observed_ms) if v.ttft else None,
    ),
    (
        "variant_observed_tpot_p95_seconds",
        "p95 TPOT of one GPU type's pods of a mixed pool over the autoscaler's window",
        lambda v: _ms(v.tpot.observed_ms) if v.tpot else None,
    ),
    (
        "variant_ttft_observed_over_predicted",
        "Observed over predicted p95 TTFT of one GPU type of a mixed pool (its own plan's)",
        lambda v: v.ttft.ratio if v.ttft else None,
    ),
    (
        "variant_tpot_observed_over_predicted",
        "Observed over predicted p95 TPOT of one GPU type of a mixed pool (its own plan's)",
        lambda v: v.tpot.ratio if v.tpot else None,
    ),
    (
        "variant_observed_traffic_share",
        "One GPU type's share of the requests a mixed pool's engines started in the window",
        lambda v: v.observed_share,
    ),
    (
        "variant_planned_traffic_share",
        "One GPU type's share of a mixed pool's planned capacity (replicas x capacityRps)",
        lambda v: v.planned_share,
    ),
)


class _Collector(Collector):
    def __init__(self, services: Mapping[Any, Any], metrics: OperatorMetrics) -> None:
        self._services, self._metrics = services, metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        bodies = indexed_services(self._services)
        families = {name: GaugeMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc, _ in _GAUGES}
        variants = {
            name: GaugeMetricFamily(PREFIX + name, doc, labels=[*LABELS, "gpu", "capacity_class"])
            for name, doc, _ in (*_VARIANT_GAUGES, *_VARIANT_ACCURACY_GAUGES)
        }
        for body in sorted(bodies, key=lambda b: (b["metadata"]["namespace"], b["metadata"]["name"])):
            labels = [body["metadata"]["namespace"], body["metadata"]["name"]]
            spec, status = body.get("spec") or {}, status_of(body)
            for name, _, read in _GAUGES:
                value = read(spec, status)
                if value is not None:
                    families[name].add_metric(labels, float(value))
            for row in status.variants or []:
                for name, _, field in _VARIANT_GAUGES:
                    if (value := getattr(row, field)) is not None and row.gpu:
                        variants[name].add_metric([*labels, row.gpu, row.capacity_class or ""], float(value))
            for accuracy in (status.plan_accuracy.variants if status.plan_accuracy else None) or []:
                for name, _, read_row in _VARIANT_ACCURACY_GAUGES:
                    if (value := read_row(accuracy)) is not None and accuracy.gpu:
                        variants[name].add_metric([*labels, accuracy.gpu, accuracy.capacity_class or ""], float(value))
        yield from families.values()
        yield from variants.values()
        decisions = CounterMetricFamily(
            PREFIX + "autoscaler_decisions",
            "The SLO autoscaler's decisions made by this operator process, by action and cause",
            labels=[*LABELS, "action", "cause"],
        )
        present = {(b["metadata"]["namespace"], b["metadata"]["name"]) for b in bodies}
        for labels, count in self._metrics.decisions(present).items():
            decisions.add_metric(list(labels), count)
        yield decisions


class OperatorMetrics:
    """One registry per operator (tests run several in one process). `services`: the kopf index
    of InferenceServices (key -> store of bodies)."""

    def __init__(self, services: Mapping[Any, Any]) -> None:
        self.registry = CollectorRegistry()
        # Counted in the loop's writer threads, read on the event loop.
        self._lock = threading.Lock()
        self._decisions: dict[tuple[str, str, str, str], int] = {}
        self.registry.register(_Collector(services, self))

    def decided(self, namespace: str, name: str, decision: Decision) -> None:
        key = (namespace, name, decision.action, decision.cause or "unknown")
        with self._lock:
            self._decisions[key] = self._decisions.get(key, 0) + 1

    def decisions(self, present: set[Key]) -> dict[tuple[str, str, str, str], int]:
        """The counts of the services in `present`; those of any other service are forgotten."""
        with self._lock:
            self._decisions = {key: n for key, n in self._decisions.items() if key[:2] in present}
            return dict(sorted(self._decisions.items()))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int) -> web.AppRunner:
        """GET /metrics on host:port until the runner is cleaned up; OSError when it cannot listen."""

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        return runner
