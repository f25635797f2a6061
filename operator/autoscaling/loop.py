"""The SLO autoscaler's loop: read the engines, step the controller, write what it decided.

Every INTERVAL_SECONDS, for each InferenceService in the operator's scope whose
`autoscaling.mode` is `slo` or `external`: read the /metrics of its ready engine pods, run
`autoscaler.step()` from the state kept in `status.autoscaler`, write the new state, the last
decision, the observed p95 latencies and how far they are from the plan's (accuracy.py) to the
status, and, in `slo` mode only, set replicas
through the scale subresource and post an Event for every change. `external` computes and shows
the same numbers but never writes replicas, so an HPA or KEDA owns them; `off` is left alone.

Beside each period, a task of its own keeps the service's LoRA adapters loaded on its ready engines
(adapter_sync.py), whatever its autoscaling mode.

It runs as an asyncio task started by a kopf startup handler (operator/process.py), not as a kopf timer
or daemon: those make kopf put a finalizer on every InferenceService, and deleting one must never
wait for a running operator.

Each service's period is an asyncio task of its own (a new one starts only when its last one has
ended), and every read has a total deadline and follows no redirect: an engine image or a
`prometheusUrl` is chosen by whoever creates an InferenceService, and one that answers a byte a
second delays only its own service, whose pods are then unknown for the period. A `prometheusUrl`
is read only under a prefix the operator allows (`kvpilot operator --prometheus-url-allow`).

What it knows of the cluster comes from kopf indexes over the watches the operator runs anyway
(InferenceServices, its Deployments and engine pods), so a period costs no API reads; and a period
that changes nothing (the same decision for the same numbers, no request counted) writes nothing,
so an idle cluster costs no API requests at all. Only the engines' /metrics are read every period,
and (`kvpilot operator --gateway-pods`) the gateways': one list of the gateway pods a round, then
each ready one's /metrics, what they hold for every service at once (gateways.py).

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
import math
import socket
import urllib.parse
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvpilot.operator.api.names import API_VERSION, KIND, SCALED_TO_ZERO_AT, VARIANT_LABEL
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus, Latency, status_of
from kvpilot.operator.autoscaling.accuracy import accuracy_patch, newest_ready_seconds
from kvpilot.operator.autoscaling.adapter_sync import AdapterSync
from kvpilot.operator.autoscaling.decisions import (
    INTERVAL_SECONDS,
    AutoscalerState,
    Decision,
    Observation,
    PodRead,
    Policy,
    step,
)
from kvpilot.operator.autoscaling.gateways import GatewayQueues, GatewayRead, GatewayView, gateway_targets
from kvpilot.operator.autoscaling.metrics import (
    SERIES_NAMES,
    MetricsError,
    exposition_of_series,
    parse,
    parse_gateway,
)
from kvpilot.operator.autoscaling.operator_metrics import OperatorMetrics
from kvpilot.operator.kube.cluster import KubeCluster, WriteConflict, WriteRefused
from kvpilot.operator.kube.events import iso, scaling_event
from kvpilot.operator.kube.indexes import children, current_replicas, engine_urls, indexed_children, indexed_services
from kvpilot.operator.kube.merge_patch import as_merge_patch

STATUS_KEY = "autoscaler"
# A /metrics (or Prometheus) read not complete within this many seconds, all of it, counts the pod
# as unknown for the period: an engine too busy to answer, or one that answers a byte at a time, is
# reported as such.
SCRAPE_TIMEOUT_SECONDS = 3.0
# An engine's exposition is ~40 KiB; anything far larger is not one.
MAX_METRICS_BYTES = 4 * 1024 * 1024
# Skip a service decided on less than this fraction of a period ago (by another replica).
_DUE_FRACTION = 0.8

log = logging.getLogger(__name__)


def metrics_targets(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, /metrics URL) of the ready engine pods that are not going away."""
    return [(name, f"{url}/metrics") for name, url in engine_urls(pods)]


def saved_state(status: InferenceServiceStatus) -> AutoscalerState:
    """The state the last period left in the status; a fresh one when there is none or it is
    not readable (written by an older operator): the controller then starts observing again."""
    saved = status.autoscaler.state if status.autoscaler else None
    if not saved:
        return AutoscalerState()
    try:
        return AutoscalerState.model_validate(saved)
    except ValidationError:
        return AutoscalerState()


def due(state: AutoscalerState, now: float, interval: float = INTERVAL_SECONDS) -> bool:
    last = state.last_decision
    return last is None or now - last.at >= _DUE_FRACTION * interval


def status_patch(
    state: AutoscalerState, decision: Decision, old_latency: Latency | None, zeroed_at: str | None = None
) -> dict[str, Any]:
    """The status fields one period writes: the decision for people (`kubectl get -o yaml`), the
    state for the next period, and the observed p95s (and draft acceptance, when the engines
    speculate) beside the plan's predicted ones (`status.plan.predictedTtftMs`,
    `assumedDraftAcceptance`). A window without requests keeps the last observed values."""
    signals = decision.signals
    summary: dict[str, Any] = {
        "lastDecision": {
            "time": iso(decision.at),
            "action": decision.action,
            "replicas": decision.replicas,
            "previous": decision.previous,
            "reason": decision.reason,
        },
        "unknownPods": list(signals.unknown),
        "state": state.model_dump(mode="json", by_alias=True),
    }
    # The gateway wakes only a zero of the autoscaler's (names.SCALED_TO_ZERO_AT): set by its own
    # scale to 0, kept (`zeroed_at`, the status's) while replicas stay 0, gone with any other count.
    if decision.replicas == 0 and (decision.action == "down" or zeroed_at):
        summary[SCALED_TO_ZERO_AT] = iso(decision.at) if decision.action == "down" else zeroed_at
    patch: dict[str, Any] = {STATUS_KEY: summary}
    observed = {
        "ttftP95Ms": None if signals.ttft_p95_seconds is None else round(signals.ttft_p95_seconds * 1000, 1),
        "tpotP95Ms": None if signals.tpot_p95_seconds is None else round(signals.tpot_p95_seconds * 1000, 1),
        "draftAcceptance": None if signals.draft_acceptance is None else round(signals.draft_acceptance, 3),
        "prefixShare": None if signals.prefix_share is None else round(signals.prefix_share, 3),
    }
    fresh = {k: v for k, v in observed.items() if v is not None}
    if fresh:
        previous = old_latency.dump() if old_latency and old_latency.source == "observed" else {}
        latency = {**{k: previous.get(k) for k in observed}, **fresh, "source": "observed"}
        patch["latency"] = {k: v for k, v in latency.items() if v is not None}
    return patch


def event_manifest(body: Mapping[str, Any], decision: Decision, instance: str) -> dict[str, Any]:
    """The Event for an autoscaler decision that changes replicas."""
    return scaling_event(
        body, "ScaledUp" if decision.action == "up" else "ScaledDown", decision.reason, decision.at, instance
    )


def plan_max_num_seqs(status: InferenceServiceStatus) -> int | None:
    return status.plan.max_num_seqs if status.plan and status.plan.max_num_seqs else None


def with_variants(
    reads: Sequence[PodRead], pods: Sequence[Mapping[str, Any]], status: InferenceServiceStatus
) -> list[PodRead]:
    """Each read of a mixed pool with its pod's variant (its label) and its engine's own
    max_num_seqs: its GPU type's plan's (status.variants), where status.plan holds only the first
    type's. A service of one type: the reads as they are."""
    limits = {row.label: row.max_num_seqs for row in status.variants or [] if row.gpu}
    if not limits:
        return list(reads)
    of_pod = {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(VARIANT_LABEL, "") for p in pods}
    return [
        read.model_copy(
            update={"max_num_seqs": limits.get(of_pod.get(read.name, "")), "variant": of_pod.get(read.name) or None}
        )
        for read in reads
    ]


def replica_capacity(status: InferenceServiceStatus, max_replicas: int) -> tuple[float, ...]:
    """A mixed pool's replicas' capacities in the order its reconcile adds them (variant.fill:
    each type in turn, those that meet the SLO first, up to its maxReplicas and the replicas its
    full nodes hold); empty for a service of one GPU type, or a pool none of whose types meets it."""
    # Those that miss the SLO come after the others (variants.fill), with no capacity to count.
    rows = [row for row in status.variants or [] if row.gpu]
    if len(rows) < 2 or not any(row.capacity_rps for row in rows):
        return ()
    capacities: list[float] = []
    for row in rows:
        held = row.schedulable_replicas if row.schedulable_replicas is not None else max_replicas
        capacities += [float(row.capacity_rps or 0)] * min(row.max_replicas or max_replicas, held)
    # Past every type's maxReplicas the pool's overflow goes to its first type (fill).
    capacities += [float(rows[0].capacity_rps or 0)] * max(0, max_replicas - len(capacities))
    return tuple(capacities[:max_replicas])


def prepare(
    body: Mapping[str, Any], deployment: Mapping[str, Any] | None, now: float, interval: float = INTERVAL_SECONDS
) -> tuple[Policy, AutoscalerState] | None:
    """The policy and saved state of a service the autoscaler has a period to run for; None when
    it has not (mode off, an invalid spec, no Deployment of its own yet, or not due), before any
    pod is read."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return None
    status = status_of(body)
    if spec.autoscaling.mode == "off" or deployment is None:
        return None
    state = saved_state(status)
    if not due(state, now, interval):
        return None
    cold_start = status.plan.predicted_ready_seconds if status.plan and status.plan.predicted_ready_seconds else 0.0
    policy = Policy.from_spec(
        spec,
        max_num_seqs=plan_max_num_seqs(status),
        interval_seconds=interval,
        cold_start_seconds=cold_start,
        replica_capacity=replica_capacity(status, spec.autoscaling.max_replicas),
    )
    return policy, state


def decide(
    body: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    reads: Sequence[PodRead],
    now: float,
    interval: float = INTERVAL_SECONDS,
    gateway: GatewayRead | None = None,
) -> tuple[Policy, AutoscalerState, Decision] | None:
    """One period for one InferenceService, from what was read of its pods and of the gateways
    (None: see `prepare`)."""
    prepared = prepare(body, deployment, now, interval)
    if prepared is None:
        return None
    policy, state = prepared
    assert deployment is not None  # prepare() said so
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    obs = Observation(
        now=now, replicas=current_replicas(body, deployment), ready_replicas=ready, pods=tuple(reads), gateway=gateway
    )
    new_state, decision = step(policy, state, obs)
    return policy, new_state, decision


def reading_of(name: str, body: bytes) -> PodRead:
    """One pod's reading from its /metrics body, or why there is none."""
    if len(body) > MAX_METRICS_BYTES:
        return PodRead(name=name, error=f"/metrics is larger than {MAX_METRICS_BYTES} bytes")
    try:
        return PodRead(name=name, reading=parse(body.decode("utf-8", errors="replace")))
    except MetricsError as error:
        return PodRead(name=name, error=str(error))


class ReadFailed(Exception):
    """A read that gave no body to parse, and why."""


async def fetch(session: aiohttp.ClientSession, url: str, deadline: float | None = None) -> bytes:
    """The body of a GET of `url`, up to MAX_METRICS_BYTES + 1 bytes, all of it within `deadline`
    seconds (default SCRAPE_TIMEOUT_SECONDS; a socket's timeout would bound each read, not a peer
    that sends a byte a second), and
    no redirect followed: whoever writes a spec or runs an engine image chooses what answers, and
    a redirect would make the operator request any address it can reach. ReadFailed says why not."""
    deadline = SCRAPE_TIMEOUT_SECONDS if deadline is None else deadline
    try:
        async with asyncio.timeout(deadline), session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                followed = " (a redirect, not followed)" if 300 <= response.status < 400 else ""
                raise ReadFailed(f"HTTP {response.status}{followed}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    break
            return bytes(body)
    except TimeoutError:
        raise ReadFailed(f"no complete answer within {deadline:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as error:  # refused, reset, a URL it cannot dial
        raise ReadFailed(f"{type(error).__name__}: {error}") from None


async def read_metrics(session: aiohttp.ClientSession, name: str, url: str, deadline: float | None = None) -> PodRead:
    """One pod's /metrics, or why there is none."""
    try:
        return reading_of(name, await fetch(session, url, deadline))
    except ReadFailed as error:
        return PodRead(name=name, error=str(error))


async def read_gateway(session: aiohttp.ClientSession, name: str, url: str) -> tuple[str, dict[Any, float] | str]:
    """One gateway pod's held requests per service, or why there are none."""
    try:
        body = await fetch(session, url)
        if len(body) > MAX_METRICS_BYTES:
            return name, f"/metrics is larger than {MAX_METRICS_BYTES} bytes"
        return name, parse_gateway(body.decode("utf-8", errors="replace"))
    except (ReadFailed, MetricsError) as error:
        return name, str(error)


async def read_gateways(session: aiohttp.ClientSession, gateways: GatewayView) -> GatewayQueues:
    """What every ready gateway pod holds, summed per service; every gateway is unknown while its
    pods have never been listed (no permission, the API server away)."""
    if not gateways.pods.synced:
        why = gateways.pods.failure or "not listed yet"
        return GatewayQueues(unknown=(f"the gateway pods ({gateways.where}) could not be listed: {why}",))
    targets = gateway_targets(gateways.pods.values())
    return GatewayQueues.of_reads(await asyncio.gather(*(read_gateway(session, *target) for target in targets)))


def prometheus_query(namespace: str, pods: Sequence[str]) -> str:
    """The instant query for the series `parse` reads, of these pods: the labels a
    ServiceMonitor or PodMonitor gives them (`namespace`, `pod`)."""
    return f'{{__name__=~"{"|".join(SERIES_NAMES)}",namespace="{namespace}",pod=~"{"|".join(sorted(pods))}"}}'


async def read_prometheus(
    session: aiohttp.ClientSession, url: str, namespace: str, pods: Sequence[str], deadline: float | None = None
) -> list[PodRead]:
    """Each pod's reading from the series a Prometheus at `url` holds (the same numbers as its
    /metrics, one scrape interval late); a pod without series is unknown, as is every pod when
    Prometheus cannot answer."""
    if not pods:
        return []
    query = urllib.parse.urlencode({"query": prometheus_query(namespace, pods)})
    try:
        raw = await fetch(session, f"{url.rstrip('/')}/api/v1/query?{query}", deadline)
        if len(raw) > MAX_METRICS_BYTES:
            raise ValueError(f"the answer is larger than {MAX_METRICS_BYTES} bytes")
        body = json.loads(raw)
        if body.get("status") != "success" or body["data"]["resultType"] != "vector":
            raise ValueError(f"Prometheus answered {str(body)[:200]}")
        by_pod: dict[str, list[Any]] = {}
        for one in body["data"]["result"]:
            by_pod.setdefault(one["metric"].get("pod"), []).append(one)
    except (ReadFailed, ValueError, LookupError, TypeError, AttributeError) as error:
        # Whoever answers at that URL chose what it says: a malformed answer is every pod unknown.
        why = str(error) if isinstance(error, ReadFailed) else f"{type(error).__name__}: {error}"
        return [PodRead(name=pod, error=f"Prometheus at {url}: {why}") for pod in sorted(pods)]
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
        except (LookupError, TypeError, AttributeError) as error:  # a series without a value pair
            reads.append(PodRead(name=pod, error=f"Prometheus at {url}: {type(error).__name__}: {error}"))
    return reads


def _port(url: urllib.parse.SplitResult) -> int | None:
    try:
        return url.port or {"http": 80, "https": 443}.get(url.scheme)
    except ValueError:  # not a number, or out of range
        return None


def _segments(path: str) -> list[str]:
    return [segment for segment in urllib.parse.unquote(path).split("/") if segment]


def prometheus_allowed(url: str, prefixes: Sequence[str]) -> bool:
    """Whether `url` lies under one of the operator's allowed prefixes (`--prometheus-url-allow`):
    the same scheme, host and port, and the prefix's path segments first. Compared parsed, not as
    strings: `http://prometheus:9090@evil` starts with `http://prometheus:9090` but asks `evil`."""
    target = urllib.parse.urlsplit(url)
    path = _segments(target.path)
    if (
        target.username is not None
        or target.query
        or target.fragment
        or not target.hostname
        or _port(target) is None
        or any(segment in (".", "..") for segment in path)
    ):
        return False
    for prefix in prefixes:
        allowed = urllib.parse.urlsplit(prefix)
        under = _segments(allowed.path)
        if (target.scheme, target.hostname, _port(target)) == (
            allowed.scheme,
            allowed.hostname,
            _port(allowed),
        ) and path[: len(under)] == under:
            return True
    return False


def deletion_costs(reads: Sequence[PodRead]) -> dict[str, int]:
    """controller.kubernetes.io/pod-deletion-cost per pod before a scale-down, so the ReplicaSet
    removes the pods with the least work first: a pod that could not be read (a broken engine)
    first of all, then idle ones, and the one with the most requests running and waiting last."""
    return {
        read.name: -1 if read.reading is None else math.ceil((read.reading.running or 0) + (read.reading.waiting or 0))
        for read in reads
    }


def worth_writing(old_status: InferenceServiceStatus, state: AutoscalerState, decision: Decision) -> bool:
    """False for a period that changes nothing: the same decision for the same reason (numbers
    included) as the one in the status, and no pod counted a request since (the same baselines).
    An idle service then costs no writes; the window it would have recorded was empty anyway."""
    if decision.action != "hold":
        return True
    saved = saved_state(old_status)
    last = saved.last_decision
    return (
        last is None
        or (last.action, last.replicas, last.previous, last.reason)
        != (decision.action, decision.replicas, decision.previous, decision.reason)
        or saved.baselines != state.baselines
    )


class AutoscalingLoop:
    """The loop's I/O. What it reads of the cluster comes from kopf's indexes (fed by the watches
    the operator runs anyway), so a period costs no API reads; it writes only what changed, through
    the operator's one cluster adapter. The four mappings are kopf indexes of `index_entry` values
    (key -> store of values). `prometheus_allow`: the URL prefixes under which a spec's
    `prometheusUrl` may be read (`kvpilot operator --prometheus-url-allow`). `gateways`: the gateway
    pods (`--gateway-pods`), kept by a watch and read once a round for what they hold; None: no
    gateway is read. `metrics`: the operator's own /metrics, which counts the decisions this
    process stands by (written, or the same as the status already says)."""

    def __init__(
        self,
        cluster: KubeCluster,
        services: Mapping[Any, Any],
        deployments: Mapping[Any, Any],
        replicasets: Mapping[Any, Any],
        pods: Mapping[Any, Any],
        interval: float = INTERVAL_SECONDS,
        prometheus_allow: Sequence[str] = (),
        gateways: GatewayView | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics if metrics is not None else OperatorMetrics(services)
        self.interval = interval
        self.prometheus_allow = tuple(prometheus_allow)
        self.gateways = gateways
        # This round's read of the gateways, shared by its periods (made by the first that needs it).
        self._queues: asyncio.Future[GatewayQueues] | None = None
        self._indexes = services, deployments, replicasets, pods
        self._instance = socket.gethostname()
        self._session: aiohttp.ClientSession | None = None
        # Every service's LoRA adapters, loaded on its ready engines each period (any autoscaling mode).
        self.adapters = AdapterSync(cluster, self._http)

    def _http(self) -> aiohttp.ClientSession:
        # Made on the running event loop, which it belongs to. No proxy from the environment: pod
        # IPs are dialled directly.
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._queues is not None:
            self._queues.cancel()
            self._queues = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def gateway_read(self, body: Mapping[str, Any]) -> GatewayRead | None:
        """What the gateways hold for this service, from this round's one read of them."""
        if self.gateways is None:
            return None
        if self._queues is None:
            self._queues = asyncio.ensure_future(read_gateways(self._http(), self.gateways))
        # Shielded: one period cancelled does not cancel the read the others wait for.
        queues = await asyncio.shield(self._queues)
        return queues.of(body["metadata"]["namespace"], body["metadata"]["name"])

    async def read_all(self, body: Mapping[str, Any], targets: Sequence[tuple[str, str]]) -> list[PodRead]:
        """The pods' readings: from the Prometheus the spec names (if the operator allows it), else
        from each pod's /metrics, all at once."""
        prometheus = ((body.get("spec") or {}).get("autoscaling") or {}).get("prometheusUrl")
        names = [name for name, _ in targets]
        if not prometheus:
            return list(await asyncio.gather(*(read_metrics(self._http(), *target) for target in targets)))
        if not prometheus_allowed(prometheus, self.prometheus_allow):
            why = (
                f"prometheusUrl {prometheus} is not allowed: the operator reads Prometheus only under its "
                f"--prometheus-url-allow prefixes (chart autoscaler.prometheusUrlAllow): "
                f"{', '.join(self.prometheus_allow) or 'none'}"
            )
            return [PodRead(name=name, error=why) for name in sorted(names)]
        return await read_prometheus(self._http(), prometheus, body["metadata"]["namespace"], names)

    async def one(
        self,
        body: Mapping[str, Any],
        deployments: Sequence[Mapping[str, Any]],
        replicasets: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
        now: float,
    ) -> Decision | None:
        """One period of one InferenceService; the decision, or None when nothing was written."""
        deployment, engine_pods = children(body, deployments, replicasets, pods)
        if prepare(body, deployment, now, self.interval) is None:
            return None
        reads, gateway = await asyncio.gather(
            self.read_all(body, metrics_targets(engine_pods)), self.gateway_read(body)
        )
        reads = with_variants(reads, engine_pods, status_of(body))
        outcome = decide(body, deployment, reads, now, self.interval, gateway)
        if outcome is None:
            return None
        return await asyncio.to_thread(self._write, body, reads, newest_ready_seconds(engine_pods), *outcome)

    def _write(
        self,
        body: Mapping[str, Any],
        reads: Sequence[PodRead],
        ready: tuple[str, float] | None,
        policy: Policy,
        state: AutoscalerState,
        decision: Decision,
    ) -> Decision | None:
        """The status, then (`slo` mode) the replicas a period decided; blocking client calls."""
        metadata, old = body["metadata"], status_of(body)
        if not worth_writing(old, state, decision):
            self.metrics.decided(metadata["namespace"], metadata["name"], decision)
            return None
        for read in reads:
            if read.error is not None:  # the status names the pod; why is for the operator's log
                log.info(
                    f"autoscaler: {metadata['namespace']}/{metadata['name']}: pod {read.name} is unknown: {read.error}"
                )
        zeroed_at = old.autoscaler.scaled_to_zero_at if old.autoscaler else None
        fields = {
            **status_patch(state, decision, old.latency, zeroed_at),
            **accuracy_patch(
                old, decision.signals, policy.window_seconds, decision.at, int(metadata.get("generation") or 0), ready
            ),
        }
        try:
            written = self.cluster.patch_status(
                API_VERSION,
                KIND,
                metadata["namespace"],
                metadata["name"],
                # A merge patch is a diff against the status as stored, not as the types read it.
                as_merge_patch(body.get("status") or {}, fields),
                metadata["resourceVersion"],
            )
        except WriteConflict:
            return None  # another writer (a replica of this operator, a reconcile) came first
        self.metrics.decided(metadata["namespace"], metadata["name"], decision)
        if policy.mode != "slo" or decision.replicas == decision.previous:
            return decision
        if decision.action == "down":
            self.cluster.set_deletion_costs(metadata["namespace"], deletion_costs(reads))
        self.cluster.write_replicas(body, decision.replicas, event_manifest(body, decision, self._instance), written)
        return decision

    async def period(
        self,
        body: Mapping[str, Any],
        deployments: Sequence[Mapping[str, Any]],
        replicasets: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
    ) -> None:
        """`one`, with its failure logged: a bug or an API error met by one service is its own."""
        where = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
        try:
            decision = await self.one(body, deployments, replicasets, pods, datetime.now(UTC).timestamp())
        except (WriteRefused, WriteConflict, OSError) as error:
            log.warning(f"autoscaler: {where}: {error}")
            return
        except Exception:
            log.exception(f"autoscaler: {where}")
            return
        if decision is not None and decision.action != "hold":
            log.info(f"autoscaler: {where}: {decision.reason}")

    async def adapters_period(
        self,
        body: Mapping[str, Any],
        deployments: Sequence[Mapping[str, Any]],
        replicasets: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
    ) -> None:
        """One service's adapters brought to its spec on its ready engines (adapter_sync.py), with its
        failure logged. A task of its own beside `period`: a slow load (a large adapter read, vLLM
        fetching a repository) does not hold up the service's scaling."""
        where = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
        try:
            engine_pods = children(body, deployments, replicasets, pods)[1]
            await self.adapters.sync(body, engine_pods, datetime.now(UTC).timestamp())
        except (WriteRefused, WriteConflict, OSError) as error:
            log.warning(f"adapters: {where}: {error}")
        except Exception:
            log.exception(f"adapters: {where}")

    def start_periods(self, running: dict[tuple[str, str, str], asyncio.Task[None]]) -> None:
        """A period's task and an adapters' task for every InferenceService whose last one of each
        has finished (keyed by what, namespace, name), from the indexes as they are now (taken on
        kopf's event loop, which updates them): a service whose engines answer slowly, or not at
        all, holds up only its own decisions."""
        for key in [key for key, task in running.items() if task.done()]:
            del running[key]
        self._queues = None  # a new round reads the gateways again
        services_index, deployments, replicasets, pods = self._indexes
        for body in indexed_services(services_index):
            metadata = body["metadata"]
            if metadata.get("deletionTimestamp"):
                continue
            lists = indexed_children(deployments, replicasets, pods, body)
            for what, work in (("autoscaler", self.period), ("adapters", self.adapters_period)):
                key = (what, metadata["namespace"], metadata["name"])
                if key not in running:
                    running[key] = asyncio.create_task(work(body, *lists), name=f"kvpilot-{'/'.join(key)}")

    async def run(self) -> None:
        """Periods until cancelled; the blocking client calls run in threads, off kopf's loop."""
        running: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        try:
            while True:
                try:
                    self.start_periods(running)
                except Exception:
                    log.exception("autoscaler: a round failed")
                await asyncio.sleep(self.interval)
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
            await self.close()
