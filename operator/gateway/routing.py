"""Where the gateway sends a request: the InferenceService a namespace and model name address, the
engine among its ready pods, and whether a request may wake a service at zero. Pure functions.

A request addresses its tenant in the path, `/namespaces/<namespace>/v1/...`, and its model by the
body's `model` within that namespace only: a same-named model elsewhere is never seen, named,
woken or sent the request (and its `Authorization` header).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvpilot.operator.api.names import VARIANT_LABEL
from kvpilot.operator.api.status import status_of
from kvpilot.operator.kube.indexes import current_replicas, engine_urls

# An engine gets up to this many times its plan's max_num_seqs at once: the batch plus an equal
# queue in the engine, where the autoscaler reads it (waiting requests); beyond that a request waits
# in the gateway (held, bounded) rather than in a client pool the autoscaler cannot see.
ENGINE_QUEUE_FACTOR = 2
# Without a plan in the status (an older operator, a service not planned yet).
DEFAULT_ENGINE_CAPACITY = 256
# An engine that refused a connection or timed out connecting is passed over for this long,
# doubling with each failure in a row up to the maximum.
BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 10.0
# PrefixHash: points per engine on the hash ring (an even spread of keys), and how far above the
# mean load (requests in flight, this one included) an engine may go before its keys spill to the
# next engine on the ring (consistent hashing with bounded loads, as KubeAI's CHWBL).
VIRTUAL_NODES = 100
LOAD_FACTOR = 1.25


def served_model(service: Mapping[str, Any]) -> str | None:
    model = (service.get("spec") or {}).get("model") or {}
    return model.get("servedModelName") or model.get("name")


def adapter_names(service: Mapping[str, Any]) -> list[str]:
    """The names of its LoRA adapters (spec.adapters), each a model name of its own."""
    return [str(a["name"]) for a in (service.get("spec") or {}).get("adapters") or [] if a.get("name")]


def served_names(service: Mapping[str, Any]) -> list[str]:
    """Every model name a service answers to: its served model's, then its adapters'."""
    model = served_model(service)
    return [*([model] if model else []), *adapter_names(service)]


def served_in(namespace: str, services: Sequence[Mapping[str, Any]]) -> list[str]:
    """The model names (adapters' included) served in `namespace` (nothing of any other)."""
    return sorted(
        {
            m
            for s in services
            if s["metadata"]["namespace"] == namespace and not s["metadata"].get("deletionTimestamp")
            for m in served_names(s)
        }
    )


def route(namespace: str, model: str, services: Sequence[Mapping[str, Any]]) -> str:
    """The name of the InferenceService in `namespace` serving `model` (as its model or one of its
    adapters); LookupError with what a client can act on (in its own namespace only) when none or
    several do."""
    matches = sorted(
        s["metadata"]["name"]
        for s in services
        if s["metadata"]["namespace"] == namespace
        and model in served_names(s)
        and not s["metadata"].get("deletionTimestamp")
    )
    if not matches:
        served = ", ".join(served_in(namespace, services)) or "none"
        raise LookupError(f"The model `{model}` does not exist in namespace {namespace}; served there: {served}")
    if len(matches) > 1:
        raise LookupError(
            f"The model `{model}` is served by several InferenceServices in namespace {namespace} "
            f"({', '.join(matches)}): give them distinct servedModelName"
        )
    return matches[0]


def adapter_of(service: Mapping[str, Any], model: str) -> str | None:
    """`model` when it names one of the service's adapters (its requests go only to pods holding
    it), None for the base model."""
    return model if model != served_model(service) and model in adapter_names(service) else None


def holding(service: Mapping[str, Any], adapter: str, urls: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The engines among `urls` (pod name, URL) that hold `adapter`, as status.adapters says the
    operator last read them (autoscaling/adapter_sync.py): a pod not listed yet (just ready, still
    loading it) is sent none of its requests."""
    rows = status_of(service).adapters or []
    loaded = set(next((row.loaded_on or [] for row in rows if row.name == adapter), []))
    return [(pod, url) for pod, url in urls if pod in loaded]


def engine_capacity(service: Mapping[str, Any]) -> int:
    """Requests one engine of `service` is sent at once (see ENGINE_QUEUE_FACTOR)."""
    plan = status_of(service).plan
    return ENGINE_QUEUE_FACTOR * plan.max_num_seqs if plan and plan.max_num_seqs else DEFAULT_ENGINE_CAPACITY


@dataclass
class Engines:
    """Per InferenceService: requests in flight per engine URL, and the engines passed over after
    failures to connect (failures in a row, and until when) or a refusal (until when)."""

    in_flight: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    backoff_until: dict[str, float] = field(default_factory=dict)

    def failed(self, url: str, now: float) -> None:
        count = self.failures.get(url, 0) + 1
        self.failures[url] = count
        self.backoff_until[url] = now + min(BACKOFF_SECONDS * 2 ** (count - 1), MAX_BACKOFF_SECONDS)

    def refused(self, url: str, now: float, retry_after: float) -> None:
        """The engine answered that it cannot take requests now: passed over for the time it asked."""
        self.backoff_until[url] = now + min(retry_after, MAX_BACKOFF_SECONDS)

    def succeeded(self, url: str) -> None:
        self.failures.pop(url, None)
        self.backoff_until.pop(url, None)

    def forget_except(self, urls: Sequence[str]) -> None:
        """Drop what is kept about engines that are gone (nothing in flight there any more)."""
        keep = set(urls)
        for table in (self.failures, self.backoff_until):
            for url in [u for u in table if u not in keep]:
                del table[url]
        for url in [u for u, n in self.in_flight.items() if n == 0 and u not in keep]:
            del self.in_flight[url]

    def idle(self) -> bool:
        return not any(self.in_flight.values())


class Share(NamedTuple):
    """What one engine of a mixed pool is sent: requests at once (ENGINE_QUEUE_FACTOR x its own
    plan's max_num_seqs), and its weight among the others (its GPU type's capacity in req/s, as
    corrected by what its pods showed)."""

    capacity: int
    weight: float


# How far what a type's pods show moves its weight from its plan's capacity: a factor of four
# either way. A type twice as slow as planned serves about half the requests per second.
SPEED_BOUNDS = (0.25, 4.0)


def _speeds(service: Mapping[str, Any]) -> dict[str, float]:
    """Per variant label: predicted over observed p95 TPOT of its own pods (status.planAccuracy.variants,
    the autoscaler's window): how much faster its engines decode than its plan says. TPOT, not TTFT:
    TTFT is mostly the queue, which least-load already follows. A type re-planned with its own
    correction (status.correction.byGpu) has that factor in its capacity already: only what its pods
    show beyond it moves the weight."""
    status = status_of(service)
    accuracy, correction = status.plan_accuracy, status.correction
    applied = {row.gpu: row.tpot for row in (correction.by_gpu if correction else None) or [] if row.tpot}
    found = {}
    for row in (accuracy.variants if accuracy else None) or []:
        if row.variant and row.tpot and row.tpot.ratio:
            speed = applied.get(row.gpu, 1.0) / row.tpot.ratio
            found[row.variant] = min(max(speed, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])
    return found


def shares(service: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> dict[str, Share]:
    """Per ready engine URL of a mixed pool (status.variants): its GPU type's share, so an L4 pod is
    not sent an H100's part of the requests; the planned capacity scaled by how fast the type's pods
    decode against their plan (`_speeds`), so a type slower than planned is sent less. Empty for a
    service of one type: its engines are alike."""
    variants = {v.label: v for v in status_of(service).variants or [] if v.gpu}
    if not variants:
        return {}
    speeds = _speeds(service)
    labels = {p["metadata"]["name"]: p["metadata"].get("labels") or {} for p in pods}
    found = {}
    for name, url in engine_urls(pods):
        label = labels.get(name, {}).get(VARIANT_LABEL, "")
        row = variants.get(label)
        if row is not None and row.capacity_rps and row.max_num_seqs:
            found[url] = Share(ENGINE_QUEUE_FACTOR * row.max_num_seqs, row.capacity_rps * speeds.get(label, 1.0))
    return found


def _usable(
    urls: Sequence[tuple[str, str]], engines: Engines, capacity: int, now: float, weights: Mapping[str, Share]
) -> list[str]:
    """The engines not backed off and below their capacity (`weights`' where it has one)."""
    return [
        url
        for _, url in urls
        if engines.backoff_until.get(url, 0.0) <= now
        and engines.in_flight.get(url, 0) < (weights[url].capacity if url in weights else capacity)
    ]


def _weight(weights: Mapping[str, Share], url: str) -> float:
    return weights[url].weight if url in weights else 1.0


def choose(
    urls: Sequence[tuple[str, str]],
    engines: Engines,
    capacity: int,
    now: float,
    weights: Mapping[str, Share] | None = None,
) -> str | None:
    """The base URL with the fewest requests in flight for its weight (`weights`: a mixed pool's
    engines' shares; alike without) among the engines not backed off and below their capacity
    (None: no engine to try now)."""
    weights = weights or {}
    return min(
        _usable(urls, engines, capacity, now, weights),
        key=lambda url: (engines.in_flight.get(url, 0) + 1) / _weight(weights, url),
        default=None,
    )


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=1024)
def _ring(urls: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    return tuple(sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES)))


def choose_by_prefix(
    urls: Sequence[tuple[str, str]],
    engines: Engines,
    capacity: int,
    now: float,
    prefix: str,
    weights: Mapping[str, Share] | None = None,
) -> str | None:
    """The engine `prefix` hashes to on a ring of every ready engine, or the next one clockwise
    whose load stays within LOAD_FACTOR x its share of the load (the mean, where engines are alike;
    by weight in a mixed pool) (None: no engine to try now). An engine that comes or goes moves only
    the keys next to its points; the rest keep their engine and its cache."""
    weights = weights or {}
    usable = set(_usable(urls, engines, capacity, now, weights))
    if not usable:
        return None
    load = engines.in_flight
    total, weight = sum(load.get(url, 0) for url in usable) + 1, sum(_weight(weights, url) for url in usable)
    ring = _ring(tuple(sorted(url for _, url in urls)))
    start = bisect.bisect(ring, (_hash(prefix), ""))
    for offset in range(len(ring)):
        url = ring[(start + offset) % len(ring)][1]
        if url in usable and load.get(url, 0) + 1 <= math.ceil(LOAD_FACTOR * total * _weight(weights, url) / weight):
            return url
    return choose(urls, engines, capacity, now, weights)


def pick(
    service: Mapping[str, Any],
    urls: Sequence[tuple[str, str]],
    engines: Engines,
    now: float,
    prefix: str,
    weights: Mapping[str, Share] | None = None,
) -> str | None:
    """The engine for a request to `service` by its routing.strategy (`weights`: `shares`)."""
    capacity = engine_capacity(service)
    strategy = (((service.get("spec") or {}).get("routing")) or {}).get("strategy", "LeastLoad")
    if strategy == "PrefixHash":
        return choose_by_prefix(urls, engines, capacity, now, prefix, weights)
    return choose(urls, engines, capacity, now, weights)


def wake_refusal(service: Mapping[str, Any], deployment: Mapping[str, Any] | None) -> str | None:
    """Why a request may not scale `service` from zero (None: it may). Only a zero the SLO
    autoscaler set (mode slo, minReplicas 0, its marker in the status) is undone by traffic: never
    one of mode off or external, nor a `kubectl scale --replicas=0`."""
    spec = service.get("spec") or {}
    autoscaling = spec.get("autoscaling") or {}
    mode = autoscaling.get("mode", "slo")
    if deployment is None:
        return "it has no Deployment yet"
    if current_replicas(service, deployment) != 0:
        return "it is not at 0 replicas"
    if mode != "slo":
        return f"autoscaling.mode is {mode}: only the owner of its replicas scales it"
    if autoscaling.get("minReplicas", 1) != 0:
        return "autoscaling.minReplicas is not 0: it was scaled to zero by hand"
    autoscaler = status_of(service).autoscaler
    if autoscaler is None or not autoscaler.scaled_to_zero_at:
        return "it was scaled to zero by hand, not by the autoscaler"
    return None
