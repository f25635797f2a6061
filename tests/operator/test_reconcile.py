"""Reconciliation against an in-memory object store: converging, idempotence, no-fit handling.

The store only keys objects by (kind, namespace, name) the way the API server does; it tests the
reconcile logic, not Kubernetes (e2e/ does that against a real API server).
"""

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf

from kvpilot.engine.config import CAPABILITIES
from kvpilot.operator import render
from kvpilot.operator.handlers import ENGINE_IMAGE_ENV, engine_image, reconcile_handler
from kvpilot.operator.reconcile import reconcile

NOW = datetime(2025, 1, 1, tzinfo=UTC)
Key = tuple[str, str, str]


class FakeCluster:
    def __init__(self, gpu_products: list[str] | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.applies = 0
        self.products = gpu_products or []

    def apply(self, manifest: dict[str, Any]) -> None:
        self.applies += 1
        key = (manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        previous = self.objects.get(key, {})
        self.objects[key] = {**manifest, "status": previous.get("status", {}),
                             "metadata": {**manifest["metadata"], "generation": 1}}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)

    def gpu_products(self) -> list[str]:
        return self.products

    def kinds(self) -> list[str]:
        return sorted(kind for kind, _, _ in self.objects)


def body(spec: dict[str, Any], generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": generation},
            "spec": spec, "status": status or {}}


SPEC = {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"}}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_creates_deployment_service_and_pdb_and_reports_progress() -> None:
    cluster = FakeCluster()
    status = reconcile(body(SPEC), cluster, NOW)
    assert cluster.kinds() == ["Deployment", "PodDisruptionBudget", "Service"]
    assert status["observedGeneration"] == 1
    assert status["desiredReplicas"] == 3 and status["readyReplicas"] == 0
    assert status["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvpilot-engine"
    assert status["url"] == "http://chat.ml.svc.cluster.local:8000/v1"
    assert status["plan"]["maxNumSeqs"] == 4 and status["plan"]["gpu"] == "A10G"
    assert condition(status, "Planned")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "RollingOut"
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == \
        ("False", "ReplicasNotReady", "0/3 replicas ready")


def test_ready_when_the_deployment_reports_ready_replicas() -> None:
    cluster = FakeCluster()
    first = reconcile(body(SPEC), cluster, NOW)
    deployment = cluster.objects[("Deployment", "ml", "chat")]
    deployment["status"] = {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3,
                            "readyReplicas": 3}
    later = NOW + timedelta(minutes=3)
    second = reconcile(body(SPEC, status=first), cluster, later)
    ready = condition(second, "Ready")
    assert ready["status"] == "True" and ready["reason"] == "ReplicasReady"
    assert "3/3 replicas ready" in ready["message"] and "TPOT" in ready["message"]
    assert ready["lastTransitionTime"] == "2025-01-01T00:03:00Z"
    # Planned did not flip, so its transition time stays at the first reconcile.
    assert condition(second, "Planned")["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    assert condition(second, "Progressing")["status"] == "False"
    assert condition(second, "Degraded")["status"] == "False"
    assert (second["replicas"], second["readyReplicas"]) == (3, 3)


def test_reconciling_again_creates_no_duplicates_and_recreates_deleted_children() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    snapshot = {key: dict(obj) for key, obj in cluster.objects.items()}
    reconcile(body(SPEC), cluster, NOW)  # e.g. the operator restarted (resume) or resynced
    assert cluster.objects.keys() == snapshot.keys()
    assert all(cluster.objects[k]["spec"] == snapshot[k]["spec"] for k in snapshot)
    cluster.delete("apps/v1", "Deployment", "ml", "chat")  # deleted by hand
    reconcile(body(SPEC), cluster, NOW)
    assert ("Deployment", "ml", "chat") in cluster.objects


def test_a_plan_that_cannot_fit_deletes_the_deployment_and_says_why() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    too_big = {**SPEC, "model": {"name": "llama-3-70b"}}
    status = reconcile(body(too_big, generation=2), cluster, NOW)
    assert ("Deployment", "ml", "chat") not in cluster.objects
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WeightsDoNotFit")
    # This engine runs no quantized scheme, so the FP16 weights are what does not fit.
    assert "131.4 GiB" in ready["message"] and "21.6 GiB" in ready["message"]
    assert condition(status, "Planned")["status"] == "False"
    assert status["observedGeneration"] == 2 and status["plan"]["fits"] is False


def test_pinning_what_the_engine_does_not_run_is_not_ready_and_rolls_out_nothing() -> None:
    # The CRD's enum allows int4 and ngram; this engine build runs neither.
    pinned = {**SPEC, "serving": {"quantization": "int4", "speculative": "ngram"}}
    fresh = FakeCluster()
    status = reconcile(body(pinned), fresh, NOW)
    assert fresh.kinds() == ["PodDisruptionBudget", "Service"]
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "UnsupportedByEngine")
    assert "serving.quantization 'int4'" in ready["message"]
    assert f"supported: {', '.join(CAPABILITIES.quantization)}" in ready["message"]
    assert "serving.speculative 'ngram'" in ready["message"]
    assert condition(status, "Planned")["reason"] == "UnsupportedByEngine"
    assert (status["plan"]["fits"], status["desiredReplicas"]) == (False, 0)

    # Pinning it on a running service removes its engines rather than rolling out a crash loop.
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    assert ("Deployment", "ml", "chat") in cluster.objects
    status = reconcile(body(pinned, generation=2), cluster, NOW)
    assert ("Deployment", "ml", "chat") not in cluster.objects
    assert condition(status, "Ready")["reason"] == "UnsupportedByEngine"


def test_invalid_spec_is_a_condition_not_a_crash() -> None:
    cluster = FakeCluster()
    status = reconcile(body({**SPEC, "autoscaling": {"minReplicas": 3, "maxReplicas": 1}}),
                       cluster, NOW)
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


def test_slo_at_risk_is_degraded_with_numbers() -> None:
    cluster = FakeCluster()
    spec = {**SPEC, "load": {"requestsPerSecond": 50}, "autoscaling": {"maxReplicas": 2}}
    status = reconcile(body(spec), cluster, NOW)
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SLOAtRisk")
    assert "maxReplicas 2" in degraded["message"] and "req/s" in degraded["message"]


def test_kopf_handler_writes_the_status_into_the_patch() -> None:
    cluster = FakeCluster()
    patch = kopf.Patch()
    memo = kopf.Memo(cluster=cluster, engine_image="mirror.example/kvpilot:1.2.3")
    reconcile_handler(body=body(SPEC), patch=patch, memo=memo, logger=logging.getLogger("test"))
    assert patch["status"]["plan"]["gpu"] == "A10G"
    assert {c["type"] for c in patch["status"]["conditions"]} == {
        "Planned", "Progressing", "Ready", "Degraded"}
    assert cluster.kinds() == ["Deployment", "PodDisruptionBudget", "Service"]
    (engine,) = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"][
        "containers"]
    assert engine["image"] == "mirror.example/kvpilot:1.2.3"


def test_spec_image_wins_over_the_operators_default() -> None:
    cluster = FakeCluster()
    reconcile(body({**SPEC, "image": "registry.example/kvpilot:pinned"}), cluster, NOW,
              default_image="mirror.example/kvpilot:1.2.3")
    (engine,) = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"][
        "containers"]
    assert engine["image"] == "registry.example/kvpilot:pinned"


def test_operator_default_engine_image_comes_from_the_environment() -> None:
    assert engine_image({ENGINE_IMAGE_ENV: "mirror.example/kvpilot:1.2.3"}) == \
        "mirror.example/kvpilot:1.2.3"
    # Unset or empty (a chart value left blank) falls back to the built-in image.
    assert engine_image({}) == engine_image({ENGINE_IMAGE_ENV: ""}) == render.DEFAULT_ENGINE_IMAGE
