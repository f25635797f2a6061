"""Who may reach a service's engines: its API key (a Secret the operator makes once, the engines
require, the gateway checks by digest), its NetworkPolicy, and its optional InferencePool."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import handlers, render
from kvpilot.operator.controller.reconcile import reconcile, refresh
from kvpilot.operator.planning.plan import plan
from tests.operator.controller.test_reconcile import (
    NOW,
    OPERATOR_NAMESPACE,
    SPEC,
    FakeCluster,
    Operator,
    body,
    condition,
)

SECRET = ("Secret", "ml", "chat-api-key")


def engine(cluster: FakeCluster) -> dict[str, Any]:
    return cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["containers"][0]


def key_of(cluster: FakeCluster) -> str:
    return base64.b64decode(cluster.objects[SECRET]["data"][names.API_KEY_SECRET_KEY]).decode()


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_service_gets_a_random_key_the_engines_require_and_the_gateway_checks_by_digest() -> None:
    cluster = FakeCluster()
    status = reconcile(body(SPEC), cluster, NOW)
    key = key_of(cluster)
    assert len(key) >= 40
    owner = cluster.objects[SECRET]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceService", "chat", True)
    assert status["auth"] == {"apiKeySha256": sha256(key), "secretName": "chat-api-key"}
    env = {e["name"]: e for e in engine(cluster)["env"]}
    assert env["KVPILOT_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "chat-api-key", "key": "api-key"}}
    # Another service gets another key.
    other = FakeCluster()
    reconcile(body(SPEC), other, NOW)
    assert key_of(other) != key


def test_vllm_engines_read_the_key_from_their_own_variable() -> None:
    cluster = FakeCluster()
    reconcile(body({**SPEC, "runtime": "vllm"}), cluster, NOW)
    names_ = [e["name"] for e in engine(cluster)["env"]]
    assert "VLLM_API_KEY" in names_ and "KVPILOT_API_KEY" not in names_


def test_a_rotated_key_moves_the_status_and_rolls_the_pods_and_is_never_overwritten() -> None:
    cluster = FakeCluster()
    first = reconcile(body(SPEC), cluster, NOW)
    annotations = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations[names.API_KEY_ANNOTATION] == first["auth"]["apiKeySha256"]
    cluster.objects[SECRET]["data"] = {"api-key": base64.b64encode(b"rotated-by-an-admin").decode()}
    second = reconcile(body(SPEC, status=first), cluster, NOW)
    assert key_of(cluster) == "rotated-by-an-admin"
    assert second["auth"]["apiKeySha256"] == sha256("rotated-by-an-admin")
    template = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]
    assert template["metadata"]["annotations"][names.API_KEY_ANNOTATION] == sha256("rotated-by-an-admin")


def test_a_deleted_secret_is_made_again_with_a_new_key() -> None:
    cluster = FakeCluster()
    first = reconcile(body(SPEC), cluster, NOW)
    old = key_of(cluster)
    cluster.delete("v1", "Secret", "ml", "chat-api-key")
    second = reconcile(body(SPEC, status=first), cluster, NOW)
    assert key_of(cluster) != old and second["auth"]["apiKeySha256"] == sha256(key_of(cluster))


def test_a_secret_of_someone_else_or_without_a_key_rolls_out_nothing() -> None:
    cluster = FakeCluster()
    theirs = cluster.put(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-api-key", "namespace": "ml"}, "data": {}}
    )
    status = reconcile(body(SPEC), cluster, NOW)
    assert cluster.objects == {SECRET: theirs} and "auth" not in status
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "Secret ml/chat-api-key" in ready["message"] and "auth.apiKey: false" in ready["message"]

    emptied = FakeCluster()
    reconcile(body(SPEC), emptied, NOW)
    emptied.objects[SECRET]["data"] = {"api-key": "not base64!"}
    running = dict(emptied.objects[("Deployment", "ml", "chat")])
    status = reconcile(body(SPEC), emptied, NOW)
    assert condition(status, "Ready")["reason"] == "InvalidApiKeySecret" and "auth" not in status
    assert emptied.objects[("Deployment", "ml", "chat")] == running


def test_a_conflict_elsewhere_creates_no_secret_and_reports_no_key() -> None:
    cluster = FakeCluster()
    cluster.put({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat", "namespace": "ml"}, "spec": {}})
    status = reconcile(body(SPEC), cluster, NOW)
    assert SECRET not in cluster.objects and "auth" not in status


def test_auth_off_makes_no_secret_and_the_engines_and_gateway_ask_no_key() -> None:
    cluster = FakeCluster()
    status = reconcile(body({**SPEC, "auth": {"apiKey": False}}), cluster, NOW)
    assert SECRET not in cluster.objects and "auth" not in status
    assert not any(e["name"] == "KVPILOT_API_KEY" for e in engine(cluster)["env"])
    template = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]
    assert names.API_KEY_ANNOTATION not in template["metadata"]["annotations"]


def policy(cluster: FakeCluster) -> dict[str, Any]:
    return cluster.objects[("NetworkPolicy", "ml", "chat")]["spec"]


def test_the_engine_port_takes_only_the_gateway_the_operator_and_the_listed_namespaces() -> None:
    cluster = FakeCluster()
    reconcile(
        body({**SPEC, "network": {"allowedNamespaces": ["monitoring", "apps"]}}),
        cluster,
        NOW,
        operator_namespace=OPERATOR_NAMESPACE,
    )
    spec = policy(cluster)
    pod_labels = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"port": names.PORT, "protocol": "TCP"}]
    system, listed = rule["from"]
    assert system["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}}
    [expression] = system["podSelector"]["matchExpressions"]
    assert expression == {
        "key": "app.kubernetes.io/name",
        "operator": "In",
        "values": ["kvpilot-gateway", "kvpilot-operator"],
    }
    assert listed == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["apps", "monitoring"]}
            ]
        }
    }


def test_the_policy_names_the_pods_the_chart_runs() -> None:
    templates = Path(__file__).resolve().parents[3] / "helm" / "kvpilot" / "templates"
    text = "".join((templates / name).read_text() for name in ("_helpers.tpl", "gateway-deployment.yaml"))
    for app in (names.OPERATOR_APP, names.GATEWAY_APP):
        assert f"{names.APP_NAME_LABEL}: {app}" in text


def test_turning_the_policy_off_opens_the_port_without_deleting_anything() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    reconcile(body({**SPEC, "network": {"policy": False}}, generation=2), cluster, NOW)
    assert policy(cluster)["ingress"] == [{}]  # every source, every port


def test_an_inference_pool_only_when_asked_and_a_missing_crd_says_so() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    assert ("InferencePool", "ml", "chat") not in cluster.objects
    pooled = {**SPEC, "inferencePool": {"enabled": True, "endpointPicker": {"name": "llm-d-epp"}}}
    reconcile(body(pooled, generation=2), cluster, NOW)
    pool = cluster.objects[("InferencePool", "ml", "chat")]["spec"]
    assert pool["endpointPickerRef"]["name"] == "llm-d-epp"
    missing = FakeCluster()
    missing.refuse["InferencePool"] = (404, "the API server does not serve this kind (is its CRD installed?)")
    status = reconcile(body(pooled), missing, NOW)
    ready = condition(status, "Ready")
    assert ready["reason"] == "ApplyFailed" and "InferencePool ml/chat" in ready["message"]
    assert "CRD installed" in ready["message"]


def test_engine_pods_carry_the_engine_type_llm_d_reads() -> None:
    spec = InferenceServiceSpec.model_validate(SPEC)
    labels = render.deployment("chat", "ml", "u", spec, plan(spec))["spec"]["template"]["metadata"]["labels"]
    assert labels[names.ENGINE_TYPE_LABEL] == "vllm"


def test_a_secret_event_reconciles_its_owner() -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    assert refresh(cluster, "ml", "chat", NOW)
    before = cluster.objects[("InferenceService", "ml", "chat")]["status"]["auth"]["apiKeySha256"]
    cluster.objects[SECRET]["data"] = {"api-key": base64.b64encode(b"new").decode()}
    Operator(cluster).event(handlers.child_handler, body=dict(cluster.objects[SECRET]))
    after = cluster.objects[("InferenceService", "ml", "chat")]["status"]["auth"]["apiKeySha256"]
    assert after == sha256("new") != before


def test_a_key_of_the_users_own_in_env_is_theirs_to_check() -> None:
    own = {"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "k"}}}
    cluster = FakeCluster()
    status = reconcile(body({**SPEC, "env": [own]}), cluster, NOW)
    assert SECRET not in cluster.objects and "auth" not in status
    assert [e for e in engine(cluster)["env"] if e["name"] == "KVPILOT_API_KEY"] == [own]
