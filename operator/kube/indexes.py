"""Reading kopf's indexes: the InferenceServices, their Deployments, ReplicaSets and engine pods as
the watches the operator runs anyway hold them, so the autoscaler, the gateway and event reconciles
read the cluster without API requests. Pure functions over index entries (`index_entry` makes them)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpilot.operator.api.names import INSTANCE_LABEL, PORT


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def containers_ready(pod: Mapping[str, Any]) -> bool:
    """Its containers pass their readiness probes, whether or not its readiness gates are set:
    the engine answers, though the pod may not be in the Service yet."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return pod_ready(pod) or any(c.get("type") == "ContainersReady" and c.get("status") == "True" for c in conditions)


def pod_urls(
    pods: Sequence[Mapping[str, Any]],
    port: Callable[[Mapping[str, Any]], int],
    ready: Callable[[Mapping[str, Any]], bool] = pod_ready,
) -> list[tuple[str, str]]:
    """(pod name, base URL on `port(pod)`) of the `ready` pods that are not going away."""
    urls = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp") or not ready(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        urls.append((pod["metadata"]["name"], f"http://{host}:{port(pod)}"))
    return sorted(urls)


def engine_urls(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, base URL) of the ready engine pods that are not going away. Pods that are not
    ready yet (starting, loading the model) are no one's load: they are the pending ones."""
    return pod_urls(pods, lambda _: PORT)


def started_engine_urls(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, base URL) of the engine pods whose engine answers, Ready or held back by a
    readiness gate (the adapters a pod must hold before it serves), that are not going away."""
    return pod_urls(pods, lambda _: PORT, containers_ready)


def current_replicas(body: Mapping[str, Any], deployment: Mapping[str, Any] | None) -> int:
    """What the scale subresource says now: spec.replicas, or (unset: the plan's count seeds the
    first rollout) what the Deployment was rendered with."""
    replicas = (body.get("spec") or {}).get("replicas")
    if replicas is not None:
        return int(replicas)
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def indexed_services(services: Mapping[Any, Any]) -> list[Mapping[str, Any]]:
    """Every InferenceService in the services index (a kopf index: key -> store of values)."""
    return [value for store in services.values() for value in store]


def indexed_service(services: Mapping[Any, Any], key: tuple[str, str]) -> Mapping[str, Any] | None:
    """The InferenceService `key` (namespace, name) in the services index, if it holds it."""
    return next(iter(services.get(key, ())), None)


def indexed_children(
    deployments: Mapping[Any, Any], replicasets: Mapping[Any, Any], pods: Mapping[Any, Any], service: Mapping[str, Any]
) -> tuple[list[Any], list[Any], list[Any]]:
    """The Deployments, ReplicaSets and engine pods the indexes hold under `service`'s key."""
    key = (service["metadata"]["namespace"], service["metadata"]["name"])
    return list(deployments.get(key, ())), list(replicasets.get(key, ())), list(pods.get(key, ()))


def _controlled_by(child: Mapping[str, Any], uids: set[str]) -> bool:
    return any(r.get("controller") and r.get("uid") in uids for r in child["metadata"].get("ownerReferences") or [])


def children(
    body: Mapping[str, Any],
    deployments: Sequence[Mapping[str, Any]],
    replicasets: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]]]:
    """The Deployment this InferenceService controls (a mixed pool's read as one: `pooled`; None:
    there is none, or only same-named ones of someone else) and its engine pods, out of one round's
    lists of the operator's children.

    Anyone who can create a pod can give it the labels the indexes select by, so a pod counts
    (its metrics, gateway traffic) only through the controller references Kubernetes keeps, by uid:
    pod -> ReplicaSet -> this Deployment. Those are indexed (the pod template's labels, managed-by
    among them, are the ReplicaSet's too) rather than matched by name (`<deployment>-<pod-template-
    hash>`): a pod chooses its owner reference's name and its labels, and nothing checks them."""
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    controlled = [
        d for d in deployments if d["metadata"].get("namespace") == namespace and _controlled_by(d, {metadata["uid"]})
    ]
    deployment = pooled(controlled)
    if deployment is None:
        return None, []
    owned = {
        rs["metadata"]["uid"]
        for rs in replicasets
        if rs["metadata"].get("namespace") == namespace
        and _controlled_by(rs, {d["metadata"]["uid"] for d in controlled})
    }
    mine = [
        p
        for p in pods
        if p["metadata"].get("namespace") == namespace
        and (p["metadata"].get("labels") or {}).get(INSTANCE_LABEL) == name
        and _controlled_by(p, owned)
    ]
    return deployment, mine


_COUNTED = ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas", "unavailableReplicas")


def pooled(deployments: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The Deployments of one InferenceService read as one: the one itself, or a mixed pool's
    (a Deployment per GPU type) with their replicas of every kind summed, their generation observed
    only once every one's is, and every condition of each (the first named). None when there are none."""
    if len(deployments) < 2:
        return deployments[0] if deployments else None

    def total(part: str, key: str) -> int:
        return sum(int((d.get(part) or {}).get(key) or 0) for d in deployments)

    current = all(
        int((d.get("status") or {}).get("observedGeneration") or 0) >= int(d["metadata"].get("generation") or 0)
        for d in deployments
    )
    return {
        "metadata": {**deployments[0]["metadata"], "generation": 1},
        "spec": {"replicas": total("spec", "replicas")},
        "status": {
            **{key: total("status", key) for key in _COUNTED},
            "observedGeneration": 1 if current else 0,
            "conditions": [c for d in deployments for c in (d.get("status") or {}).get("conditions") or []],
        },
    }


# generation: the operator reconciles from an InferenceService's entry (controller/handlers.py's
# Reconciler).
_KEPT_METADATA = (
    "name",
    "namespace",
    "uid",
    "generation",
    "resourceVersion",
    "deletionTimestamp",
    "labels",
    "ownerReferences",
)


def index_entry(body: Mapping[str, Any], key_label: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """A kopf index entry for an object the loop reads: keyed by (namespace, name), or by
    (namespace, the value of `key_label`) for ReplicaSets and pods (their InferenceService's
    instance label); the
    value a copy of what the loop uses (kopf's body is a view that later events replace)."""
    metadata = body["metadata"]
    key = metadata.get("name") if key_label is None else (metadata.get("labels") or {}).get(key_label)
    if key is None:
        return {}
    kept = {
        "metadata": copy.deepcopy({k: metadata[k] for k in _KEPT_METADATA if k in metadata}),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }
    if body.get("kind") not in ("Pod", "ReplicaSet"):  # their specs (pods, a pod template) are large and not needed
        kept["spec"] = copy.deepcopy(dict(body.get("spec") or {}))
    return {(metadata["namespace"], key): kept}
