"""Reconciliation against an in-memory object store: converging, idempotence, no-fit handling,
ownership, refused writes, and the handlers that run it.

The store keys objects by (kind, namespace, name) and versions them the way the API server does
(a create fails where an object exists, an update fails unless the object is at the version
read); it tests the reconcile logic, not Kubernetes (e2e/ does that against a real API server).
"""

import asyncio
import base64
import copy
import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest

from e2e.hub_server import HubServer
from kvpilot.engine.contract.config import CAPABILITIES
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import handlers, render
from kvpilot.operator.controller.handlers import (
    ENGINE_IMAGE_ENV,
    NO_GPU_RETRY_SECONDS,
    Reconciler,
    child_handler,
    engine_image,
    pod_handler,
    reconcile_handler,
)
from kvpilot.operator.controller.reconcile import RENDERED_HASH, owned_by, reconcile, refresh
from kvpilot.operator.hub.client import HubClient
from kvpilot.operator.kube.cluster import WriteConflict, WriteRefused, describe
from kvpilot.operator.kube.indexes import index_entry
from kvpilot.operator.kube.merge_patch import merge_patch
from kvpilot.operator.planning.plan import plan

NOW = datetime(2025, 1, 1, tzinfo=UTC)
Key = tuple[str, str, str]


class FakeCluster:
    def __init__(self, gpu_products: list[str] | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.applies = 0  # writes of children: creates and updates
        self.status_patches: list[dict[str, Any]] = []
        self.products = gpu_products or []
        self.refuse: dict[str, tuple[int, str]] = {}  # kind -> (code, the API server's message)
        self.version = 100

    @staticmethod
    def key(manifest: dict[str, Any]) -> Key:
        return (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store `obj` as an object someone made (a user, another controller)."""
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"] = {"generation": 1, **stored["metadata"], "resourceVersion": str(self.version)}
        self.objects[self.key(obj)] = stored
        return stored

    def _write(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] in self.refuse:
            code, message = self.refuse[manifest["kind"]]
            raise WriteRefused(describe(manifest), code, message)
        self.applies += 1
        previous = self.objects.get(self.key(manifest), {})
        generation = previous.get("metadata", {}).get("generation", 0)
        if previous.get("spec") != manifest.get("spec"):
            generation += 1
        self.version += 1
        self.objects[self.key(manifest)] = stored = {
            **copy.deepcopy(manifest),
            "status": previous.get("status", {}),
            "metadata": {
                **copy.deepcopy(manifest["metadata"]),
                "generation": generation,
                "resourceVersion": str(self.version),
            },
        }
        return copy.deepcopy(stored)

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        self.pod_lists = getattr(self, "pod_lists", 0) + 1
        return [
            copy.deepcopy(o)
            for (kind, ns, _), o in sorted(self.objects.items())
            if kind == "Pod" and ns == namespace and labels.items() <= o.get("metadata", {}).get("labels", {}).items()
        ]

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if self.key(manifest) in self.objects:
            raise WriteConflict(f"{describe(manifest)} already exists")
        return self._write(manifest)

    def update(self, manifest: dict[str, Any], resource_version: str) -> dict[str, Any]:
        existing = self.objects.get(self.key(manifest))
        if existing is not None and existing["metadata"]["resourceVersion"] != resource_version:
            raise WriteConflict(f"{describe(manifest)} is not at version {resource_version}")
        return self._write(manifest)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)

    def post_event(self, event: dict[str, Any]) -> None:
        self.events = [*getattr(self, "events", []), event]

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> str:
        self.status_patches.append(patch)
        obj = self.objects[(kind, namespace, name)]
        obj["status"] = apply_merge_patch(obj.get("status") or {}, patch)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return str(self.version)

    def gpu_nodes(self) -> dict[str, int]:
        # Eight GPUs a node, as on the catalog's largest machines.
        return {product: 8 for product in self.products}

    def kinds(self) -> list[str]:
        return sorted(kind for kind, _, _ in self.objects if kind != "InferenceService")


def apply_merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies a merge patch."""
    result = dict(target)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = apply_merge_patch(result.get(key) if isinstance(result.get(key), dict) else {}, value)
        else:
            result[key] = value
    return result


OPERATOR_NAMESPACE = "kvpilot-system"
# What every InferenceService has, whether its spec plans or not.
SPEC_FREE_KINDS = ["NetworkPolicy", "PodDisruptionBudget", "Secret", "Service"]


def body(spec: dict[str, Any], generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": generation},
        "spec": spec,
        "status": status or {},
    }


SPEC = {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"}, "load": {"requestsPerSecond": 4}}
# What the planner gives SPEC (tests/operator/planning/test_planner.py checks its numbers): several
# replicas, so that the PodDisruptionBudget and partial readiness have something to count.
REPLICAS = plan(InferenceServiceSpec.model_validate(SPEC)).replicas
assert REPLICAS > 1


# A Deployment's status once its REPLICAS pods are all ready.
ALL_READY = {"observedGeneration": 1, "replicas": REPLICAS, "updatedReplicas": REPLICAS, "readyReplicas": REPLICAS}


class Operator:
    """The operator's handlers and its reconcile worker over `cluster`, driven one event at a time:
    `event` runs a handler, then every reconcile it queued."""

    def __init__(
        self, cluster: FakeCluster, engine_image: str = render.DEFAULT_ENGINE_IMAGE, hub: HubClient | None = None
    ) -> None:
        self.loop = asyncio.new_event_loop()
        logger = logging.getLogger("test")
        self.reconciler = Reconciler(cluster, None, logger, engine_image, OPERATOR_NAMESPACE, hub)
        self.memo = kopf.Memo(cluster=cluster, reconciler=self.reconciler)

    def event(
        self, handler: Callable[..., Any], services: Mapping[Any, Any] | None = None, **kwargs: Any
    ) -> list[tuple[str, str]]:
        """Run `handler` (kopf's services index as `services`); the keys reconciled after it."""
        self.reconciler.services = services

        async def handle() -> list[tuple[str, str]]:
            await handler(memo=self.memo, **kwargs)
            return [await self.reconciler.reconcile_next() for _ in range(self.reconciler.queue.pending())]

        return self.loop.run_until_complete(handle())

    def until(self, condition: Callable[[], bool], seconds: float = 5.0) -> bool:
        """Let a worker take what the queue holds, and what comes back into it later, until
        `condition` holds (True) or `seconds` pass (False)."""

        async def run() -> bool:
            self.reconciler.start(workers=1)
            try:
                deadline = self.loop.time() + seconds
                while not condition() and self.loop.time() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                await self.reconciler.stop()
            return condition()

        return self.loop.run_until_complete(run())

    def later(self, key: tuple[str, str]) -> float | None:
        """Seconds until `key` is reconciled again by itself, None when it is not."""

        async def later() -> float | None:
            return self.reconciler.queue.later(key)

        return self.loop.run_until_complete(later())


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_creates_deployment_service_and_pdb_and_reports_progress() -> None:
    cluster = FakeCluster()
    status = reconcile(body(SPEC), cluster, NOW)
    assert cluster.kinds() == ["Deployment", *SPEC_FREE_KINDS]
    assert status["observedGeneration"] == 1
    assert status["desiredReplicas"] == REPLICAS and status["readyReplicas"] == 0
    assert status["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvpilot-engine"
    assert status["url"] == "http://chat.ml.svc.cluster.local:8000/v1"
    assert status["plan"]["maxNumSeqs"] == 20 and status["plan"]["gpu"] == "A10G"
    assert condition(status, "Planned")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "RollingOut"
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "ReplicasNotReady",
        f"0/{REPLICAS} replicas ready",
    )


def test_ready_when_the_deployment_reports_ready_replicas() -> None:
    cluster = FakeCluster()
    first = reconcile(body(SPEC), cluster, NOW)
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    deployment["status"] = dict(ALL_READY)
    later = NOW + timedelta(minutes=3)
    second = reconcile(body(SPEC, status=first), cluster, later)
    ready = condition(second, "Ready")
    assert ready["status"] == "True" and ready["reason"] == "ReplicasReady"
    assert f"{REPLICAS}/{REPLICAS} replicas ready" in ready["message"] and "TPOT" in ready["message"]
    assert ready["lastTransitionTime"] == "2025-01-01T00:03:00Z"
    # Planned did not flip, so its transition time stays at the first reconcile.
    assert condition(second, "Planned")["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    assert condition(second, "Progressing")["status"] == "False"
    assert condition(second, "Degraded")["status"] == "False"
    assert (second["replicas"], second["readyReplicas"]) == (REPLICAS, REPLICAS)


def test_reconciling_again_creates_no_duplicates_and_recreates_deleted_children() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    snapshot = {key: dict(obj) for key, obj in cluster.objects.items()}
    reconcile(body(SPEC), cluster, NOW)  # e.g. the operator restarted (resume) or a child changed
    assert cluster.objects.keys() == snapshot.keys()
    assert all(cluster.objects[k].get("spec") == snapshot[k].get("spec") for k in snapshot)
    # The API key is made once: a reconcile never replaces it.
    assert (
        cluster.objects[("Secret", "ml", "chat-api-key")]["data"] == snapshot[("Secret", "ml", "chat-api-key")]["data"]
    )
    cluster.delete("apps/v1", "Deployment", "ml", "chat")  # deleted by hand
    reconcile(body(SPEC), cluster, NOW)
    assert ("Deployment", "ml", "chat") in cluster.objects


def test_unchanged_children_are_not_written_and_changed_ones_are() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    assert cluster.applies == len(["Deployment", *SPEC_FREE_KINDS])
    versions = {k: o["metadata"]["resourceVersion"] for k, o in cluster.objects.items()}
    reconcile(body(SPEC), cluster, NOW)
    assert cluster.applies == 5  # converged: reads only
    assert {k: o["metadata"]["resourceVersion"] for k, o in cluster.objects.items()} == versions
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    assert RENDERED_HASH in deployment["metadata"]["annotations"]

    # A field of ours edited by hand is put back.
    deployment["spec"]["replicas"] = 7
    reconcile(body(SPEC), cluster, NOW)
    assert cluster.applies == 6 and cluster.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == REPLICAS
    # A field the spec no longer asks for (a nodeSelector key) goes: the rendering changed.
    selected = {**SPEC, "nodeSelector": {"pool": "gpu"}}
    reconcile(body(selected, generation=2), cluster, NOW)
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["pool"] == "gpu"
    reconcile(body(SPEC, generation=3), cluster, NOW)
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert "pool" not in pod["nodeSelector"]
    # Fields other controllers add (status, defaults) are not a change of ours.
    cluster.objects[("Service", "ml", "chat")]["spec"]["clusterIP"] = "127.3.0.7"
    writes = cluster.applies
    reconcile(body(SPEC, generation=3), cluster, NOW)
    assert cluster.applies == writes


def test_a_plan_that_stops_fitting_keeps_the_last_good_deployment_and_says_why() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    running = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")])
    cluster.objects[("Deployment", "ml", "chat")]["status"] = running["status"] = {
        "observedGeneration": 1,
        "replicas": REPLICAS,
        "updatedReplicas": REPLICAS,
        "readyReplicas": REPLICAS,
    }
    too_big = {**SPEC, "model": {"name": "llama-3-70b"}}
    status = reconcile(body(too_big, generation=2), cluster, NOW)
    # The engines of the last plan that fit keep serving, untouched.
    assert cluster.objects[("Deployment", "ml", "chat")] == running
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "WeightsDoNotFit")
    # Even the most compressed scheme this engine runs (INT4) does not fit.
    assert "int4 weights 42.8 GiB" in planned["message"] and "19.9 GiB" in planned["message"]
    assert "last plan that fit keeps running" in planned["message"]
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ReplicasReady")
    assert condition(status, "Degraded")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "WeightsDoNotFit"
    assert status["observedGeneration"] == 2 and status["plan"]["fits"] is False
    assert (status["desiredReplicas"], status["readyReplicas"]) == (REPLICAS, REPLICAS)

    # A spec that never planned has no Deployment.
    fresh = FakeCluster()
    status = reconcile(body(too_big), fresh, NOW)
    assert fresh.kinds() == SPEC_FREE_KINDS
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WeightsDoNotFit")
    assert "42.8 GiB" in ready["message"]


def test_the_last_good_deployment_deleted_by_hand_comes_back_while_the_spec_does_not_plan() -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    operator = Operator(cluster)
    assert refresh(cluster, "ml", "chat", NOW)
    running = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")])
    # The spec stops planning (a model too big); then the Deployment is deleted by hand.
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    isvc["spec"] = {**SPEC, "model": {"name": "llama-3-70b"}, "replicas": 2}
    isvc["metadata"]["generation"] = 2
    assert refresh(cluster, "ml", "chat", NOW)
    assert cluster.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    cluster.delete("apps/v1", "Deployment", "ml", "chat")
    operator.event(child_handler, body=running)
    # It comes back as the last plan that fit rendered it, at the spec's replicas.
    back = cluster.objects[("Deployment", "ml", "chat")]
    assert back["spec"] == {**running["spec"], "replicas": 2}
    status = cluster.objects[("InferenceService", "ml", "chat")]["status"]
    assert (condition(status, "Planned")["reason"], status["desiredReplicas"]) == ("WeightsDoNotFit", 2)
    assert status["lastGoodPlan"]["spec"] == {
        # The repository our engine is given for the catalog's name (planning/sources.py).
        "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
        "accelerator": {"type": "A10G"},
        "load": {"requestsPerSecond": 4.0},
    }


def test_an_unknown_gpu_type_after_a_good_plan_keeps_the_deployment() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    running = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")])
    status = reconcile(body({**SPEC, "accelerator": {"type": "L5"}}, generation=2), cluster, NOW)
    assert cluster.objects[("Deployment", "ml", "chat")] == running
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "UnknownGPU")
    assert "'L5' is not in the catalog" in planned["message"]
    # Fixed: the new plan rolls out onto the same Deployment.
    status = reconcile(body({**SPEC, "accelerator": {"type": "L4"}}, generation=3), cluster, NOW)
    assert condition(status, "Planned")["status"] == "True"
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}


def test_pinning_what_the_engine_does_not_run_is_not_ready_and_rolls_out_nothing() -> None:
    # The CRD's enum allows w8a8; this engine build does not run it.
    pinned = {**SPEC, "serving": {"quantization": "w8a8"}}
    fresh = FakeCluster()
    status = reconcile(body(pinned), fresh, NOW)
    assert fresh.kinds() == SPEC_FREE_KINDS
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "UnsupportedByRuntime")
    assert "serving.quantization 'w8a8'" in ready["message"]
    assert f"supported: {', '.join(CAPABILITIES.quantization)}" in ready["message"]
    assert condition(status, "Planned")["reason"] == "UnsupportedByRuntime"
    assert (status["plan"]["fits"], status["desiredReplicas"]) == (False, 0)

    # Pinning it on a running service rolls out nothing: its engines keep the last good plan.
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    running = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")])
    status = reconcile(body(pinned, generation=2), cluster, NOW)
    assert cluster.objects[("Deployment", "ml", "chat")] == running
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "UnsupportedByRuntime")
    assert "serving.quantization 'w8a8'" in planned["message"]
    assert status["desiredReplicas"] == REPLICAS


def test_invalid_spec_is_a_condition_not_a_crash() -> None:
    cluster = FakeCluster()
    status = reconcile(body({**SPEC, "autoscaling": {"minReplicas": 3, "maxReplicas": 1}}), cluster, NOW)
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "InvalidSpec")
    assert "minReplicas 3 > maxReplicas 1" in planned["message"]
    assert cluster.objects == {}


def test_unset_gpu_type_plans_for_the_nodes_gpus() -> None:
    cluster = FakeCluster(gpu_products=["NVIDIA-H100-80GB-HBM3"])
    status = reconcile(body({"model": {"name": "llama-2-7b"}}), cluster, NOW)
    assert status["plan"]["gpu"] == "H100-80GB"
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    none = reconcile(body({"model": {"name": "llama-2-7b"}}), FakeCluster(), NOW)
    assert condition(none, "Ready")["reason"] == "NoGPUType"


def test_the_gpu_chosen_for_an_unset_type_is_kept_until_the_spec_changes() -> None:
    small = {"model": {"name": "smollm2-135m"}}
    cluster = FakeCluster(gpu_products=["NVIDIA-L4", "NVIDIA-A100-SXM4-80GB"])
    first = reconcile(body(small), cluster, NOW)
    assert first["plan"]["gpu"] == "L4" and first["lastGoodPlan"]["gpu"] == "L4"
    why = first["plan"]["reasons"]["gpu"]
    assert "L4: the smallest of the nodes' GPUs" in why
    writes = cluster.applies
    template = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"])
    # A smaller GPU type appears: the same spec keeps its GPU, rolls nothing.
    cluster.products = ["Tesla-T4", *cluster.products]
    again = reconcile(body(small, status=first), cluster, NOW)
    assert again["plan"] == first["plan"] and cluster.applies == writes
    assert merge_patch(first, again) == {}
    # A scale (the autoscaler or the gateway writes spec.replicas, a new generation) keeps the plan
    # and its GPU: only the replica count changes.
    scaled = reconcile(body({**small, "replicas": 2}, generation=2, status=again), cluster, NOW)
    assert scaled["plan"]["gpu"] == "L4" and scaled["plan"]["reasons"]["gpu"] == why
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["template"] == template
    # Any other spec change plans afresh, onto the smaller GPU.
    changed = reconcile(
        body({**small, "replicas": 2, "load": {"requestsPerSecond": 2}}, generation=3, status=scaled), cluster, NOW
    )
    assert changed["plan"]["gpu"] == "T4" and changed["lastGoodPlan"]["gpu"] == "T4"
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4"}


def test_a_status_from_an_operator_before_last_good_plan_keeps_its_gpu_after_an_upgrade() -> None:
    small = {"model": {"name": "smollm2-135m"}}
    cluster = FakeCluster(gpu_products=["NVIDIA-L4", "NVIDIA-A100-SXM4-80GB"])
    written = reconcile(body(small, generation=4), cluster, NOW)
    older = {key: value for key, value in written.items() if key != "lastGoodPlan"}
    writes = cluster.applies
    # A smaller GPU type appears, then the upgraded operator resumes on the older status: the plan
    # of this generation stays on its GPU and nothing rolls.
    cluster.products = ["Tesla-T4", *cluster.products]
    resumed = reconcile(body(small, generation=4, status=older), cluster, NOW)
    assert resumed["plan"] == written["plan"] and cluster.applies == writes
    assert resumed["lastGoodPlan"] == written["lastGoodPlan"]
    # A status of another generation (the spec was edited while no operator ran) plans afresh.
    edited = reconcile(body(small, generation=5, status=older), cluster, NOW)
    assert edited["plan"]["gpu"] == "T4"


def test_a_scale_with_no_gpu_left_on_the_nodes_keeps_the_plan_and_applies_the_replicas() -> None:
    spec = {"model": {"name": "llama-2-7b"}, "replicas": 1}
    cluster = FakeCluster(gpu_products=["NVIDIA-L4"])
    first = reconcile(body(spec), cluster, NOW)
    template = copy.deepcopy(cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"])
    # The GPU pool is scaled to zero; then the autoscaler asks for three replicas.
    cluster.products = []
    status = reconcile(body({**spec, "replicas": 3}, generation=2, status=first), cluster, NOW)
    assert condition(status, "Planned")["status"] == "True"
    assert status["plan"]["gpu"] == "L4" and status["desiredReplicas"] == 3
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    assert deployment["spec"]["replicas"] == 3 and deployment["spec"]["template"] == template
    # A spec change other than replicas has nothing to plan for: NoGPUType, and the Deployment stays.
    running = copy.deepcopy(deployment)
    status = reconcile(
        body({**spec, "replicas": 3, "load": {"requestsPerSecond": 2}}, generation=3, status=status), cluster, NOW
    )
    assert condition(status, "Planned")["reason"] == "NoGPUType"
    assert cluster.objects[("Deployment", "ml", "chat")] == running
    assert status["lastGoodPlan"] == first["lastGoodPlan"]


def test_a_same_named_object_of_someone_else_is_left_alone() -> None:
    cluster = FakeCluster()
    theirs = cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {"ports": [{"port": 5432}], "selector": {"app": "db"}},
        }
    )
    status = reconcile(body(SPEC), cluster, NOW)
    assert cluster.objects == {("Service", "ml", "chat"): theirs}  # untouched, nothing created
    assert cluster.applies == 0
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "Service ml/chat exists and is controlled by no controller" in ready["message"]
    assert condition(status, "Progressing")["reason"] == "NameConflict"
    assert condition(status, "Planned")["status"] == "True"

    # Owned by another controller (or another InferenceService of the same name: another UID).
    other = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "chat",
            "namespace": "ml",
            "ownerReferences": [
                {
                    "apiVersion": "kvpilot.dev/v1alpha1",
                    "kind": "InferenceService",
                    "name": "chat",
                    "uid": "uid-0",
                    "controller": True,
                }
            ],
        },
        "spec": {"replicas": 1},
    }
    cluster = FakeCluster()
    theirs = cluster.put(other)
    status = reconcile(body(SPEC), cluster, NOW)
    assert cluster.objects == {("Deployment", "ml", "chat"): theirs} and cluster.applies == 0
    message = condition(status, "Ready")["message"]
    assert "Deployment ml/chat exists and is controlled by InferenceService chat" in message
    assert "uid uid-0" in message
    # Its readiness is not ours to report.
    assert status["replicas"] == 0

    # Once it is gone, the children are made.
    cluster.delete("apps/v1", "Deployment", "ml", "chat")
    status = reconcile(body(SPEC, status=status), cluster, NOW)
    assert cluster.kinds() == ["Deployment", *SPEC_FREE_KINDS]
    assert condition(status, "Ready")["reason"] == "ReplicasNotReady"


def test_a_write_the_api_server_refuses_is_in_the_status() -> None:
    cluster = FakeCluster()
    message = (
        'Deployment.apps "chat" is invalid: spec.template.spec.containers[0].resources.'
        'requests[cpu]: Invalid value: "lots": quantities must match the regular expression'
    )
    cluster.refuse["Deployment"] = (422, message)
    status = reconcile(body({**SPEC, "resources": {"requests": {"cpu": "lots"}}}), cluster, NOW)
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    assert ready["message"] == f"the API server refused Deployment ml/chat: {message}"
    assert cluster.kinds() == SPEC_FREE_KINDS  # the others are written


def test_a_write_that_races_another_is_a_conflict_not_an_adoption() -> None:
    class Racing(FakeCluster):
        def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
            if manifest["kind"] == "Service":  # someone makes it between our read and our write
                self.put({**manifest, "metadata": {"name": "chat", "namespace": "ml"}})
            return super().create(manifest)

    cluster = Racing()
    with pytest.raises(WriteConflict):
        reconcile(body(SPEC), cluster, NOW)
    assert "ownerReferences" not in cluster.objects[("Service", "ml", "chat")]["metadata"]


def test_slo_at_risk_is_degraded_with_numbers() -> None:
    cluster = FakeCluster()
    spec = {**SPEC, "load": {"requestsPerSecond": 50}, "autoscaling": {"maxReplicas": 2}}
    status = reconcile(body(spec), cluster, NOW)
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SLOAtRisk")
    assert "maxReplicas 2" in degraded["message"] and "req/s" in degraded["message"]


def test_the_service_s_own_handler_queues_a_reconcile_that_writes_its_status() -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    operator = Operator(cluster, engine_image="mirror.example/kvpilot:1.2.3")
    assert operator.event(reconcile_handler, body=body(SPEC)) == [("ml", "chat")]
    status = cluster.objects[("InferenceService", "ml", "chat")]["status"]
    assert status["plan"]["gpu"] == "A10G"
    assert {c["type"] for c in status["conditions"]} == {"Planned", "Progressing", "Ready", "Degraded"}
    assert cluster.kinds() == ["Deployment", *SPEC_FREE_KINDS]
    (engine,) = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["containers"]
    assert engine["image"] == "mirror.example/kvpilot:1.2.3"


def test_a_reconcile_patches_only_what_changed_and_removes_what_is_gone() -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    operator = Operator(cluster)
    operator.event(reconcile_handler, body=body(SPEC))
    patches = len(cluster.status_patches)
    operator.event(reconcile_handler, body=body(SPEC))
    assert len(cluster.status_patches) == patches  # nothing changed: nothing to write
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    isvc["spec"], isvc["metadata"]["generation"] = {**SPEC, "model": {"name": "llama-3-70b"}}, 2
    operator.event(reconcile_handler, body=copy.deepcopy(isvc))
    patch = cluster.status_patches[-1]
    # The failed plan gives no reasons for choices it did not make: the old plan's are removed
    # (a merge patch keeps every key it does not name).
    assert patch["plan"]["reasons"]["kvCache"] is None
    assert patch["plan"]["fits"] is False


def test_a_reconcile_carries_over_what_the_operator_s_loops_wrote() -> None:
    """status.autoscaler and status.adapters are written by the autoscaler's loop and its adapter
    sync; a reconcile's status (written as a merge patch) must not remove them."""
    adapters = [{"name": "sql", "source": "pvc://adapters/sql", "loadedOn": ["chat-0"], "pods": 1}]
    saved = {"autoscaler": {"unknownPods": []}, "adapters": adapters}
    status = reconcile(body(SPEC, status=saved), FakeCluster(), NOW)
    assert status["adapters"] == adapters and status["autoscaler"] == saved["autoscaler"]
    assert "adapters" not in reconcile(body(SPEC), FakeCluster(), NOW)


def test_a_blocked_service_is_reconciled_again_later_after_writing_its_status() -> None:
    cluster = FakeCluster()
    cluster.put(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {},
        }
    )
    cluster.put(body(SPEC))
    operator = Operator(cluster)
    operator.event(reconcile_handler, body=body(SPEC))
    assert condition(cluster.objects[("InferenceService", "ml", "chat")]["status"], "Ready")["reason"] == "NameConflict"
    assert operator.later(("ml", "chat")) == pytest.approx(handlers.BLOCKED_RETRY_SECONDS, abs=1)


def test_a_service_is_planned_again_later_when_no_node_has_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FakeCluster()
    unset = {"model": {"name": "llama-2-7b"}}
    cluster.put(body(unset))
    operator = Operator(cluster)
    operator.event(reconcile_handler, body=body(unset))
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    assert condition(isvc["status"], "Ready")["reason"] == "NoGPUType"
    assert operator.later(("ml", "chat")) == pytest.approx(NO_GPU_RETRY_SECONDS, abs=1)
    # The GPU pool comes back: the retry (sooner here) plans onto it, with no event.
    monkeypatch.setattr(handlers, "NO_GPU_RETRY_SECONDS", 0.05)
    operator.event(reconcile_handler, body=body(unset))
    cluster.products = ["NVIDIA-L4"]
    assert operator.until(lambda: isvc["status"]["plan"].get("gpu") == "L4")
    assert cluster.kinds() == ["Deployment", *SPEC_FREE_KINDS]


def test_a_child_event_reconciles_its_owner_and_writes_only_a_changed_status() -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    operator = Operator(cluster)
    assert refresh(cluster, "ml", "chat", NOW)
    assert cluster.kinds() == ["Deployment", *SPEC_FREE_KINDS]
    assert len(cluster.status_patches) == 1
    assert (
        condition(cluster.objects[("InferenceService", "ml", "chat")]["status"], "Ready")["reason"]
        == "ReplicasNotReady"
    )

    # The Deployment reports its pods ready: its event makes the InferenceService Ready.
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    deployment["status"] = dict(ALL_READY)
    operator.event(child_handler, body=deployment)
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    assert condition(isvc["status"], "Ready")["status"] == "True"
    assert isvc["status"]["readyReplicas"] == REPLICAS and len(cluster.status_patches) == 2
    # The same event again changes nothing and writes nothing.
    writes = cluster.applies
    operator.event(child_handler, body=deployment)
    assert len(cluster.status_patches) == 2 and cluster.applies == writes

    # Deleted by hand: the event of its deletion brings it back.
    cluster.delete("apps/v1", "Deployment", "ml", "chat")
    operator.event(child_handler, body=deployment)
    assert ("Deployment", "ml", "chat") in cluster.objects
    assert (
        condition(cluster.objects[("InferenceService", "ml", "chat")]["status"], "Ready")["status"] == "False"
    )  # its new pods are not ready yet
    patches = len(cluster.status_patches)

    # Not ours (no owner, or another kind of owner): nothing happens.
    stray = {
        "metadata": {
            "name": "x",
            "namespace": "ml",
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x", "uid": "u", "controller": True}
            ],
        }
    }
    assert operator.event(child_handler, body=stray) == []
    assert operator.event(child_handler, body={"metadata": {"name": "x", "namespace": "ml"}}) == []
    assert len(cluster.status_patches) == patches

    # An owner that is gone, or being deleted, is not reconciled (its children go by GC).
    cluster.objects[("InferenceService", "ml", "chat")]["metadata"]["deletionTimestamp"] = "now"
    assert not refresh(cluster, "ml", "chat", NOW)
    cluster.delete("kvpilot.dev/v1alpha1", "InferenceService", "ml", "chat")
    assert not refresh(cluster, "ml", "chat", NOW)


class ReadCounting(FakeCluster):
    """Counts the reads of the InferenceService: one per reconcile of a child's or pod's event."""

    owner_reads = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.owner_reads += kind == "InferenceService"
        return super().get(api_version, kind, namespace, name)


def _reconciled_chat() -> tuple[ReadCounting, Operator]:
    """A cluster where InferenceService ml/chat has been reconciled once, and its operator."""
    cluster = ReadCounting()
    cluster.put(body(SPEC))
    assert refresh(cluster, "ml", "chat", NOW)
    return cluster, Operator(cluster)


def test_a_burst_of_events_for_a_service_is_one_reconcile() -> None:
    cluster, operator = _reconciled_chat()
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    reads = cluster.owner_reads

    async def burst() -> list[tuple[str, str]]:
        for _ in range(3):
            await child_handler(body=deployment, memo=operator.memo)
        await pod_handler(body=_pod("chat-abc", phase="Pending"), memo=operator.memo)
        queue = operator.reconciler.queue
        return [await operator.reconciler.reconcile_next() for _ in range(queue.pending())]

    assert operator.loop.run_until_complete(burst()) == [("ml", "chat")]
    assert cluster.owner_reads == reads + 1
    # Once it has run, the next event reconciles again.
    operator.event(child_handler, body=deployment)
    assert cluster.owner_reads == reads + 2


def test_service_and_pdb_events_reconcile_only_when_they_differ_from_the_rendering() -> None:
    cluster, operator = _reconciled_chat()
    reads = cluster.owner_reads
    for kind in ("Service", "PodDisruptionBudget"):
        # Our own create's event, or another controller's defaults (a cluster IP): nothing to do.
        child = copy.deepcopy(cluster.objects[(kind, "ml", "chat")])
        child["spec"]["clusterIP"] = "127.0.0.7"
        assert operator.event(child_handler, body=child, type="ADDED") == []
        assert operator.event(child_handler, body=child, type="MODIFIED") == []
    assert cluster.owner_reads == reads
    # A port edited by hand is put back.
    service = cluster.objects[("Service", "ml", "chat")]
    service["spec"]["ports"][0]["port"] = 9999
    operator.event(child_handler, body=copy.deepcopy(service), type="MODIFIED")
    assert cluster.owner_reads == reads + 1
    assert cluster.objects[("Service", "ml", "chat")]["spec"]["ports"][0]["port"] == names.PORT
    # Deleted: it comes back, though the deleted object was as rendered.
    pdb = cluster.objects.pop(("PodDisruptionBudget", "ml", "chat"))
    operator.event(child_handler, body=pdb, type="DELETED")
    assert ("PodDisruptionBudget", "ml", "chat") in cluster.objects


def test_an_event_reconciles_from_the_index_when_it_holds_the_version_the_last_reconcile_left() -> None:
    cluster, operator = _reconciled_chat()

    def index() -> dict[tuple[str, str], list[dict[str, Any]]]:
        """kopf's autoscaled_services index, caught up with the cluster."""
        return {key: [entry] for key, entry in index_entry(cluster.objects[("InferenceService", "ml", "chat")]).items()}

    deployment = cluster.objects[("Deployment", "ml", "chat")]
    operator.event(child_handler, index(), body=deployment)
    assert cluster.owner_reads == 2  # no version known yet: read
    deployment["status"] = dict(ALL_READY)
    caught_up = index()
    operator.event(child_handler, caught_up, body=deployment)
    assert cluster.owner_reads == 2  # the index holds the version the last reconcile left
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    assert condition(isvc["status"], "Ready")["status"] == "True"
    # An index that has not caught up with that reconcile's status write is not used.
    deployment["status"] = {**deployment["status"], "readyReplicas": 1}
    operator.event(child_handler, caught_up, body=deployment)
    assert cluster.owner_reads == 3 and condition(isvc["status"], "Ready")["status"] == "False"
    # Someone else wrote (the autoscaler's status, a spec change): another version, read again.
    cluster.patch_status("kvpilot.dev/v1alpha1", "InferenceService", "ml", "chat", {"autoscaler": {"unknownPods": []}})
    deployment["status"] = {**deployment["status"], "readyReplicas": REPLICAS}
    operator.event(child_handler, index(), body=deployment)
    assert cluster.owner_reads == 4 and condition(isvc["status"], "Ready")["status"] == "True"
    # kopf's handler of the service's own changes writes its bookkeeping: another version, read.
    annotated = {**isvc["metadata"], "annotations": {f"{handlers.ANNOTATION_PREFIX}/last-handled-configuration": "x"}}
    cluster.put({**isvc, "metadata": annotated})
    operator.event(child_handler, index(), body=deployment)
    assert cluster.owner_reads == 5


def test_no_handler_makes_kopf_add_a_finalizer() -> None:
    # kopf puts a finalizer on objects that have a timer, a daemon or a non-optional on.delete
    # handler, and then `kubectl delete` waits for a running operator.
    registry = kopf.get_default_registry()
    assert list(registry._spawning.get_all_handlers()) == []
    changing = list(registry._changing.get_all_handlers())
    assert changing and not any(h.requires_finalizer for h in changing)
    watched = {h.selector.any_name for h in registry._watching.get_all_handlers()}
    assert watched == {
        "deployments",
        "services",
        "poddisruptionbudgets",
        "networkpolicies",
        "secrets",
        "pods",
        # Their own events: a status with a new PlanAccurate verdict re-plans (controller/correction.py).
        "inferenceservices",
    }
    # Not InferencePools: kopf's whole reactor fails when a watched kind's CRD is deleted (measured:
    # "Watcher for inferencepools ... 404", then nothing reconciled), and that CRD is optional. A
    # pool is rendered again at every reconcile of its service instead.


def test_merge_patch_turns_the_old_status_into_the_new() -> None:
    old = {"a": 1, "plan": {"gpu": "L4", "fits": True}, "conditions": [{"type": "Ready"}]}
    new = {"a": 1, "plan": {"fits": False}, "conditions": [{"type": "Ready", "status": "True"}]}
    patch = merge_patch(old, new)
    assert patch == {"plan": {"gpu": None, "fits": False}, "conditions": [{"type": "Ready", "status": "True"}]}
    assert apply_merge_patch(old, patch) == new
    assert merge_patch(new, new) == {}


def test_spec_image_wins_over_the_operators_default() -> None:
    cluster = FakeCluster()
    reconcile(
        body({**SPEC, "image": "registry.example/kvpilot:pinned"}),
        cluster,
        NOW,
        default_image="mirror.example/kvpilot:1.2.3",
    )
    (engine,) = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["containers"]
    assert engine["image"] == "registry.example/kvpilot:pinned"


def test_operator_default_engine_image_comes_from_the_environment() -> None:
    assert engine_image({ENGINE_IMAGE_ENV: "mirror.example/kvpilot:1.2.3"}) == "mirror.example/kvpilot:1.2.3"
    # Unset or empty (a chart value left blank) falls back to the built-in image.
    assert engine_image({}) == engine_image({ENGINE_IMAGE_ENV: ""}) == render.DEFAULT_ENGINE_IMAGE


def _pod(name: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": names.labels("chat")},
        "status": status,
    }


@pytest.mark.parametrize(
    ("pod_status", "reason", "words"),
    [
        (
            {
                "containerStatuses": [
                    {
                        "name": "engine",
                        "state": {
                            "waiting": {
                                "reason": "CrashLoopBackOff",
                                "message": "back-off 5m0s restarting failed container",
                            }
                        },
                    }
                ]
            },
            "CrashLoopBackOff",
            "back-off 5m0s",
        ),
        (
            {
                "containerStatuses": [
                    {
                        "name": "engine",
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "typo/kvpilot"',
                            }
                        },
                    }
                ]
            },
            "ImagePullBackOff",
            "typo/kvpilot",
        ),
        (
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
            "Unschedulable",
            "Insufficient nvidia.com/gpu",
        ),
    ],
)
def test_ready_says_why_pods_are_not_ready(pod_status: dict[str, Any], reason: str, words: str) -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    cluster.put(_pod("chat-abc", **pod_status))
    ready = condition(reconcile(body(SPEC), cluster, NOW), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert words in ready["message"] and "pod chat-abc" in ready["message"] and "replicas ready" in ready["message"]


def test_progress_deadline_exceeded_is_the_reason_when_pods_say_nothing() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    deployment["status"] = {
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "chat-abc" has timed out progressing.',
            }
        ]
    }
    ready = condition(reconcile(body(SPEC), cluster, NOW), "Ready")
    assert ready["reason"] == "ProgressDeadlineExceeded" and "timed out" in ready["message"]


def test_pods_are_not_listed_while_all_replicas_are_ready() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    replicas = deployment["spec"]["replicas"]
    deployment["status"] = {
        "readyReplicas": replicas,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "observedGeneration": deployment["metadata"]["generation"],
    }
    before = getattr(cluster, "pod_lists", 0)
    assert condition(reconcile(body(SPEC), cluster, NOW), "Ready")["status"] == "True"
    assert getattr(cluster, "pod_lists", 0) == before


class Failing(ReadCounting):
    """An API server that answers `failures` reads with an error (a 500, a 429), then recovers."""

    failures = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if self.failures:
            self.failures -= 1
            raise OSError("500 Internal Server Error")
        return super().get(api_version, kind, namespace, name)


def test_an_event_reconcile_that_meets_api_errors_is_retried_until_it_succeeds() -> None:
    """Issue 24, item 9: kopf never retries an event handler, so a Deployment deleted by hand while
    the API server failed stayed deleted."""
    cluster = Failing()
    cluster.put(body(SPEC))
    assert refresh(cluster, "ml", "chat", NOW)
    operator = Operator(cluster)
    operator.reconciler.queue.first_retry_seconds = 0.02
    deployment = cluster.objects.pop(("Deployment", "ml", "chat"))
    cluster.failures = 3
    operator.event(child_handler, body=deployment, type="DELETED")
    assert ("Deployment", "ml", "chat") not in cluster.objects  # the first try met the error
    assert operator.until(lambda: ("Deployment", "ml", "chat") in cluster.objects)
    assert cluster.failures == 0


def test_a_conflict_met_by_an_event_reconcile_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 9: NameConflict reached through an event stayed until the next spec change;
    the object in the way carries none of our labels, so no event says when it is gone."""
    monkeypatch.setattr(handlers, "BLOCKED_RETRY_SECONDS", 0.05)
    cluster, operator = _reconciled_chat()
    ours = cluster.objects.pop(("Service", "ml", "chat"))
    cluster.put({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat", "namespace": "ml"}, "spec": {}})
    operator.event(child_handler, body=ours, type="DELETED")
    isvc = cluster.objects[("InferenceService", "ml", "chat")]
    assert condition(isvc["status"], "Ready")["reason"] == "NameConflict"
    del cluster.objects[("Service", "ml", "chat")]  # its owner deletes it
    assert operator.until(lambda: condition(isvc["status"], "Ready")["reason"] != "NameConflict")
    assert owned_by(cluster.objects[("Service", "ml", "chat")], isvc["metadata"]["uid"])


def test_last_good_plan_keeps_only_what_planning_needs_and_pods_follow_the_spec_meanwhile() -> None:
    """lastGoodPlan held a copy of the whole spec (env, placement: often its bulk), a second copy of
    it in every status. It keeps the fields a plan depends on; while the spec does not plan, the
    Deployment runs the last good plan with the rest of the spec as it is now."""
    env = [{"name": f"VAR_{i}", "value": "x" * 100} for i in range(200)]
    placed = {**SPEC, "env": env, "nodeSelector": {"pool": "a"}, "podLabels": {"team": "a"}}
    cluster = FakeCluster()
    first = reconcile(body(placed), cluster, NOW)
    assert first["lastGoodPlan"]["spec"] == {
        "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
        "accelerator": {"type": "A10G"},
        "load": {"requestsPerSecond": 4.0},
    }
    assert len(str(first["lastGoodPlan"])) < 300 < len(str(env)) // 50
    # The model becomes too big and the node selector changes: the last good model keeps running,
    # on the nodes the spec names now.
    too_big = {**placed, "model": {"name": "llama-3-70b"}, "nodeSelector": {"pool": "b"}}
    status = reconcile(body(too_big, generation=2, status=first), cluster, NOW)
    assert condition(status, "Planned")["reason"] == "WeightsDoNotFit"
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["pool"] == "b"
    assert "llama-2-7b" in str(pod["containers"][0]) and "llama-3-70b" not in str(pod["containers"][0])
    assert status["lastGoodPlan"] == first["lastGoodPlan"]


def test_a_whole_spec_kept_by_an_older_operator_still_keeps_its_gpu() -> None:
    small = {"model": {"name": "smollm2-135m"}, "env": [{"name": "A", "value": "1"}]}
    cluster = FakeCluster(gpu_products=["NVIDIA-L4", "NVIDIA-A100-SXM4-80GB"])
    written = reconcile(body(small, generation=4), cluster, NOW)
    older = {**written, "lastGoodPlan": {**written["lastGoodPlan"], "spec": small}}
    cluster.products = ["Tesla-T4", *cluster.products]
    resumed = reconcile(body(small, generation=5, status=older), cluster, NOW)
    assert resumed["plan"]["gpu"] == written["plan"]["gpu"] != "T4"


def test_a_config_json_the_hub_refuses_is_asked_again_with_backoff_until_the_token_comes(tmp_path: Path) -> None:
    """A model known only by its private repository: without its token Secret the Hub answers 401,
    the service is Ready=False with the Hub's words, and the reconcile backs off; once the Secret is
    there the next try reads the config.json and the service rolls out."""
    from tests.operator.controller.test_decide import LLAMA_3_8B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    with HubServer("acme/private-llama", tmp_path, token="hf_secret", gated=True) as stand_in:
        spec = {
            "model": {"name": "private-llama", "source": "hf://acme/private-llama", "tokenSecret": {"name": "hub"}},
            "accelerator": {"type": "L4"},
            "env": [{"name": "HF_ENDPOINT", "value": stand_in.url}],
        }
        cluster = FakeCluster()
        cluster.put(body(spec))
        operator = Operator(cluster, hub=HubClient("http://127.0.0.1:9"))
        operator.reconciler.queue.first_retry_seconds = 0.05
        operator.event(reconcile_handler, body=body(spec))
        isvc = cluster.objects[("InferenceService", "ml", "chat")]
        ready = condition(isvc["status"], "Ready")
        assert ready["reason"] == "ModelConfigUnavailable" and "401" in ready["message"]
        assert "restricted" in ready["message"] and "Secret ml/hub holds no token" in ready["message"]
        assert "Deployment" not in cluster.kinds()
        # Tried again by itself, waiting longer each time while the Hub refuses.
        # Stopped only with the next try pending: a stop during a reconcile would cancel it before it
        # queues that try, and nothing would reconcile again (seen on a loaded machine).
        queue = operator.reconciler.queue
        assert operator.until(
            lambda: len(stand_in.file_requests("config.json")) >= 3 and queue.later(("ml", "chat")) is not None, 5
        )
        token = base64.b64encode(b"hf_secret").decode()
        cluster.put(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "hub", "namespace": "ml"},
                "data": {"token": token},
            }
        )
        assert operator.until(lambda: "Deployment" in cluster.kinds(), 10)
    status = cluster.objects[("InferenceService", "ml", "chat")]["status"]
    assert condition(status, "Planned")["status"] == "True"
    assert status["plan"]["reasons"]["model"] == "the checkpoint's config.json of hf://acme/private-llama"
