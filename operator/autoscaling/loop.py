"""The SLO autoscaler's loop: read the engines, step the controller, write what it decided.

Every INTERVAL_SECONDS, for each InferenceService in the operator's scope whose
`autoscaling.mode` is `slo` or `external`: read the /metrics of its ready engine pods, run
`autoscaler.step()` from the state kept in `status.autoscaler`, write the new state, the last
decision and the observed p95 latencies to the status, and, in `slo` mode only, set replicas
through the scale subresource and post an Event for every change. `external` computes and shows
the same numbers but never writes replicas, so an HPA or KEDA owns them; `off` is left alone.

It runs as an asyncio task started by a kopf startup handler (operator/process.py), not as a kopf timer
or daemon: those make kopf put a finalizer on every InferenceService, and deleting one must never
wait for a running operator.

What it knows of the cluster comes from kopf indexes over the watches the operator runs anyway
(InferenceServices, its Deployments and engine pods), so a period costs no API reads; and a period
that changes nothing (the same decision for the same numbers, no request counted) writes nothing,
so an idle cluster costs no API requests at all. Only the engines' /metrics are read every period.

Several operator replicas each run this loop; the status is the one state they share. A service
whose last decision is younger than most of a period is skipped, and the status is written with
the resourceVersion that was read (a conflict: another writer came first, skip this period), so
replicas neither double the pace nor act on a stale state. Replicas are written only after the
status that records the decision was.

The functions above `AutoscalingLoop` are pure (tests/operator/autoscaling/test_loop.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvpilot.operator.api.names import API_VERSION, KIND
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.autoscaling.decisions import (
    INTERVAL_SECONDS,
    AutoscalerState,
    Decision,
    Observation,
    PodRead,
    Policy,
    step,
)
from kvpilot.operator.autoscaling.metrics import (
    SERIES_NAMES,
    MetricsError,
    exposition_of_series,
    parse,
)
from kvpilot.operator.kube.cluster import KubeCluster, WriteConflict, WriteRefused
from kvpilot.operator.kube.events import iso, scaling_event
from kvpilot.operator.kube.indexes import children, current_replicas, engine_urls, indexed_children, indexed_services
from kvpilot.operator.kube.merge_patch import as_merge_patch

STATUS_KEY = "autoscaler"
# A /metrics read that takes longer than this counts the pod as unknown for the period: an engine
# too busy to answer it is reported as such rather than stalling every other service's read.
SCRAPE_TIMEOUT_SECONDS = 3.0
# An engine's exposition is ~40 KiB; anything far larger is not one.
MAX_METRICS_BYTES = 4 * 1024 * 1024
# Skip a service decided on less than this fraction of a period ago (by another replica).
_DUE_FRACTION = 0.8

log = logging.getLogger(__name__)


def metrics_targets(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, /metrics URL) of the ready engine pods that are not going away."""
    return [(name, f"{url}/metrics") for name, url in engine_urls(pods)]


def saved_state(status: Mapping[str, Any]) -> AutoscalerState:
    """The state the last period left in the status; a fresh one when there is none or it is
    not readable (written by an older operator): the controller then starts observing again."""
    saved = (status.get(STATUS_KEY) or {}).get("state")
    if not saved:
        return AutoscalerState()
    try:
        return AutoscalerState.model_validate(saved)
    except ValidationError:
        return AutoscalerState()


def due(state: AutoscalerState, now: float, interval: float = INTERVAL_SECONDS) -> bool:
    last = state.last_decision
    return last is None or now - last.at >= _DUE_FRACTION * interval


def status_patch(state: AutoscalerState, decision: Decision,
                 old_latency: Mapping[str, Any] | None) -> dict[str, Any]:
    """The status fields one period writes: the decision for people (`kubectl get -o yaml`), the
    state for the next period, and the observed p95s (and draft acceptance, when the engines
    speculate) beside the plan's predicted ones (`status.plan.predictedTtftMs`,
    `assumedDraftAcceptance`). A window without requests keeps the last observed values."""
    signals = decision.signals
    summary: dict[str, Any] = {
        "lastDecision": {"time": iso(decision.at), "action": decision.action,
                         "replicas": decision.replicas, "previous": decision.previous,
                         "reason": decision.reason},
        "unknownPods": list(signals.unknown),
        "state": state.model_dump(mode="json", by_alias=True),
    }
    patch: dict[str, Any] = {STATUS_KEY: summary}
    observed = {
        "ttftP95Ms": None if signals.ttft_p95_seconds is None else round(signals.ttft_p95_seconds * 1000, 1),
        "tpotP95Ms": None if signals.tpot_p95_seconds is None else round(signals.tpot_p95_seconds * 1000, 1),
        "draftAcceptance": None if signals.draft_acceptance is None else round(signals.draft_acceptance, 3),
    }
    fresh = {k: v for k, v in observed.items() if v is not None}
    if fresh:
        previous = (old_latency or {}) if (old_latency or {}).get("source") == "observed" else {}
        latency = {**{k: previous.get(k) for k in observed}, **fresh, "source": "observed"}
        patch["latency"] = {k: v for k, v in latency.items() if v is not None}
    return patch


def event_manifest(body: Mapping[str, Any], decision: Decision, instance: str) -> dict[str, Any]:
    """The Event for an autoscaler decision that changes replicas."""
    return scaling_event(body, "ScaledUp" if decision.action == "up" else "ScaledDown", decision.reason,
                         decision.at, instance)


def plan_max_num_seqs(status: Mapping[str, Any]) -> int | None:
    value = (status.get("plan") or {}).get("maxNumSeqs")
    return int(value) if value else None


def prepare(body: Mapping[str, Any], deployment: Mapping[str, Any] | None, now: float,
            interval: float = INTERVAL_SECONDS) -> tuple[Policy, AutoscalerState] | None:
    """The policy and saved state of a service the autoscaler has a period to run for; None when
    it has not (mode off, an invalid spec, no Deployment of its own yet, or not due), before any
    pod is read."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return None
    status = body.get("status") or {}
    if spec.autoscaling.mode == "off" or deployment is None:
        return None
    state = saved_state(status)
    if not due(state, now, interval):
        return None
    return Policy.from_spec(spec, max_num_seqs=plan_max_num_seqs(status), interval_seconds=interval), state


def decide(body: Mapping[str, Any], deployment: Mapping[str, Any] | None, reads: Sequence[PodRead],
           now: float, interval: float = INTERVAL_SECONDS) -> tuple[Policy, AutoscalerState, Decision] | None:
    """One period for one InferenceService, from what was read (None: see `prepare`)."""
    prepared = prepare(body, deployment, now, interval)
    if prepared is None:
        return None
    policy, state = prepared
    assert deployment is not None  # prepare() said so
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    obs = Observation(now=now, replicas=current_replicas(body, deployment), ready_replicas=ready,
                      pods=tuple(reads))
    new_state, decision = step(policy, state, obs)
    return policy, new_state, decision


def read_metrics(name: str, url: str, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> PodRead:
    """One pod's /metrics, or why there is none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http to a pod IP
            body = response.read(MAX_METRICS_BYTES + 1)
        if len(body) > MAX_METRICS_BYTES:
            return PodRead(name=name, error=f"/metrics is larger than {MAX_METRICS_BYTES} bytes")
        return PodRead(name=name, reading=parse(body.decode("utf-8", errors="replace")))
    except MetricsError as error:
        return PodRead(name=name, error=str(error))
    except (OSError, ValueError) as error:  # refused, timed out, HTTP errors (URLError is an OSError)
        return PodRead(name=name, error=f"{type(error).__name__}: {error}")


def prometheus_query(namespace: str, pods: Sequence[str]) -> str:
    """The instant query for the series `parse` reads, of these pods: the labels a
    ServiceMonitor or PodMonitor gives them (`namespace`, `pod`)."""
    return (f'{{__name__=~"{"|".join(SERIES_NAMES)}",namespace="{namespace}",'
            f'pod=~"{"|".join(sorted(pods))}"}}')


def read_prometheus(url: str, namespace: str, pods: Sequence[str],
                    timeout: float = SCRAPE_TIMEOUT_SECONDS) -> list[PodRead]:
    """Each pod's reading from the series a Prometheus at `url` holds (the same numbers as its
    /metrics, one scrape interval late); a pod without series is unknown, as is every pod when
    Prometheus cannot answer."""
    if not pods:
        return []
    query = urllib.parse.urlencode({"query": prometheus_query(namespace, pods)})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{query}", timeout=timeout) as response:  # noqa: S310
            body = json.loads(response.read(MAX_METRICS_BYTES + 1))
        if body.get("status") != "success" or body["data"]["resultType"] != "vector":
            raise ValueError(f"Prometheus answered {str(body)[:200]}")
        series = body["data"]["result"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [PodRead(name=pod, error=f"Prometheus at {url}: {type(error).__name__}: {error}") for pod in sorted(pods)]
    by_pod: dict[str, list[Any]] = {}
    for one in series:
        by_pod.setdefault(one["metric"].get("pod"), []).append(one)
    reads = []
    for pod in sorted(pods):
        mine = by_pod.get(pod, [])
        if not mine:
            reads.append(PodRead(name=pod, error=f"no series for this pod in Prometheus at {url}"))
            continue
        try:
            reads.append(PodRead(name=pod, reading=parse(exposition_of_series(mine))))
        except MetricsError as error:
            reads.append(PodRead(name=pod, error=str(error)))
    return reads


def worth_writing(old_status: Mapping[str, Any], state: AutoscalerState, decision: Decision) -> bool:
    """False for a period that changes nothing: the same decision for the same reason (numbers
    included) as the one in the status, and no pod counted a request since (the same baselines).
    An idle service then costs no writes; the window it would have recorded was empty anyway."""
    if decision.action != "hold":
        return True
    saved = saved_state(old_status)
    last = saved.last_decision
    return (last is None or (last.action, last.replicas, last.previous, last.reason)
            != (decision.action, decision.replicas, decision.previous, decision.reason)
            or saved.baselines != state.baselines)


class AutoscalingLoop:
    """The loop's I/O. What it reads of the cluster comes from kopf's indexes (fed by the watches
    the operator runs anyway), so a period costs no API reads; it writes only what changed, through
    the operator's one cluster adapter. The three mappings are kopf indexes of `index_entry` values
    (key -> store of values)."""

    def __init__(self, cluster: KubeCluster, services: Mapping[Any, Any], deployments: Mapping[Any, Any],
                 pods: Mapping[Any, Any], interval: float = INTERVAL_SECONDS) -> None:
        self.cluster = cluster
        self.interval = interval
        self._indexes = services, deployments, pods
        self._instance = socket.gethostname()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvpilot-metrics")

    def read_all(self, body: Mapping[str, Any], targets: Sequence[tuple[str, str]]) -> list[PodRead]:
        """The pods' readings: from the Prometheus the spec names, else from each pod's /metrics."""
        prometheus = ((body.get("spec") or {}).get("autoscaling") or {}).get("prometheusUrl")
        if prometheus:
            return read_prometheus(prometheus, body["metadata"]["namespace"], [name for name, _ in targets])
        return list(self._pool.map(lambda target: read_metrics(*target), targets))

    def one(self, body: Mapping[str, Any], deployments: Sequence[Mapping[str, Any]],
            pods: Sequence[Mapping[str, Any]], now: float) -> Decision | None:
        """One period of one InferenceService; the decision, or None when nothing was written."""
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        deployment, engine_pods = children(body, deployments, pods)
        if prepare(body, deployment, now, self.interval) is None:
            return None
        outcome = decide(body, deployment, self.read_all(body, metrics_targets(engine_pods)), now, self.interval)
        if outcome is None:
            return None
        policy, state, decision = outcome
        old_status = body.get("status") or {}
        if not worth_writing(old_status, state, decision):
            return None
        patch = as_merge_patch(old_status, status_patch(state, decision, old_status.get("latency")))
        try:
            written = self.cluster.patch_status(API_VERSION, KIND, namespace, name, patch, metadata["resourceVersion"])
        except WriteConflict:
            return None  # another writer (a replica of this operator, a reconcile) came first
        if policy.mode != "slo" or decision.replicas == decision.previous:
            return decision
        self.cluster.write_replicas(body, decision.replicas, event_manifest(body, decision, self._instance), written)
        return decision

    def round(self, services: Sequence[Mapping[str, Any]],
              children_of: Mapping[tuple[str, str], tuple[list[Any], list[Any]]]) -> None:
        """One period over every InferenceService; one service's failure is logged and does not
        stop the others."""
        for body in services:
            metadata = body["metadata"]
            if metadata.get("deletionTimestamp"):
                continue
            deployments, pods = children_of[(metadata["namespace"], metadata["name"])]
            try:
                decision = self.one(body, deployments, pods, datetime.now(UTC).timestamp())
            except (WriteRefused, WriteConflict, OSError) as error:
                log.warning(f"autoscaler: {metadata['namespace']}/{metadata['name']}: {error}")
                continue
            except Exception:  # noqa: BLE001 - a bug met by one service must not stop all the others'
                log.exception(f"autoscaler: {metadata['namespace']}/{metadata['name']}")
                continue
            if decision is not None and decision.action != "hold":
                log.info(f"autoscaler: {metadata['namespace']}/{metadata['name']}: {decision.reason}")

    def _snapshot(self) -> tuple[list[Mapping[str, Any]], dict[tuple[str, str], tuple[list[Any], list[Any]]]]:
        """The indexes as plain lists, taken on kopf's event loop (which updates them) before the
        round runs in a thread."""
        services_index, deployments, pods = self._indexes
        services = indexed_services(services_index)
        return services, {(body["metadata"]["namespace"], body["metadata"]["name"]): indexed_children(deployments, pods, body)
                          for body in services}

    async def run(self) -> None:
        """Rounds until cancelled; the blocking client calls run in a thread, off kopf's loop."""
        while True:
            try:
                await asyncio.to_thread(self.round, *self._snapshot())
            except Exception:  # noqa: BLE001 - the task must outlive a bug, or autoscaling stops unseen
                log.exception("autoscaler: round failed")
            await asyncio.sleep(self.interval)
