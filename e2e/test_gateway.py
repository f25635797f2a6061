"""Issue 23 on a real API server: the chart installs the gateway's own Deployment, ServiceAccount
and RBAC; `kvpilot gateway` runs with the chart's arguments and that ServiceAccount's token
(e2e/local_gateway.py), becomes ready once its watches listed, routes by namespace and model only,
and never wakes a zero it does not own.

Serving through the gateway, scale from zero included, is e2e/test_autoscaling.py's
test_an_idle_service_scales_to_zero_and_the_gateway_holds_the_next_request."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import yaml

from e2e import kvis
from e2e.chart import Installation, ensure_namespaces
from e2e.cluster import Cluster
from e2e.conftest import GATEWAY_REPLICAS
from e2e.local_gateway import LocalGateway, gateway_account
from e2e.local_operator import LocalOperator
from e2e.polling import poll

# (verb, resource, namespace): what the gateway's ServiceAccount may and may not do, anywhere.
ALLOWED = [
    ("list", "inferenceservices.kvpilot.dev", "anywhere"),
    ("watch", "inferenceservices.kvpilot.dev", "anywhere"),
    ("patch", "inferenceservices.kvpilot.dev/scale", "anywhere"),
    ("watch", "deployments.apps", "anywhere"),
    ("watch", "replicasets.apps", "anywhere"),
    ("watch", "pods", "anywhere"),
    ("create", "events", "anywhere"),
]
DENIED = [
    ("patch", "inferenceservices.kvpilot.dev", "anywhere"),
    ("patch", "inferenceservices.kvpilot.dev/status", "anywhere"),
    ("create", "inferenceservices.kvpilot.dev", "anywhere"),
    ("create", "deployments.apps", "anywhere"),
    ("patch", "deployments.apps", "anywhere"),
    ("patch", "deployments.apps/scale", "anywhere"),
    ("patch", "pods", "anywhere"),
    ("delete", "pods", "anywhere"),
    ("get", "secrets", "anywhere"),
    ("list", "services", "anywhere"),
    ("list", "nodes", ""),
]
OTHER = "gw-rival"


def _can_i(k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str) -> str:
    scope = ["-n", "kvpilot-e2e-anywhere"] if namespace else []
    subject = f"--as={gateway_account(kvpilot).subject}"
    # `kubectl auth can-i patch x/scale` would ask about the x named "scale".
    resource, _, subresource = resource.partition("/")
    sub = [f"--subresource={subresource}"] if subresource else []
    return k8s.kubectl("auth", "can-i", verb, resource, *sub, *scope, subject, check=False).stdout.strip()


@pytest.mark.parametrize("verb, resource, namespace", ALLOWED, ids=[f"{v}-{r}" for v, r, _ in ALLOWED])
def test_the_gateway_account_is_granted(
    k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str
) -> None:
    assert _can_i(k8s, kvpilot, verb, resource, namespace) == "yes"


@pytest.mark.parametrize("verb, resource, namespace", DENIED, ids=[f"{v}-{r}" for v, r, _ in DENIED])
def test_the_gateway_account_is_denied(
    k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str
) -> None:
    assert _can_i(k8s, kvpilot, verb, resource, namespace) == "no"


def test_the_chart_installs_the_gateway_deployment(k8s: Cluster, kvpilot: Installation) -> None:
    deployment = k8s.kubectl_json("get", "deployment", f"{kvpilot.fullname}-gateway", "-n", kvpilot.namespace)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == GATEWAY_REPLICAS  # the e2e value (the chart's default: 2)
    assert pod["serviceAccountName"] == f"{kvpilot.fullname}-gateway"
    assert container["args"][0] == "gateway" and "--hold-seconds=300" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
    assert pod["terminationGracePeriodSeconds"] >= 300 + 10  # the hold and the preStop, at least
    assert container["resources"]["limits"]["memory"] == "512Mi"
    service = k8s.kubectl_json("get", "service", f"{kvpilot.fullname}-gateway", "-n", kvpilot.namespace)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    operator = k8s.kubectl_json("get", "deployment", kvpilot.fullname, "-n", kvpilot.namespace)
    (operator_container,) = operator["spec"]["template"]["spec"]["containers"]
    # The operator serves no traffic: its one gateway flag says where to read the gateways' queues.
    assert [a.partition("=")[0] for a in operator_container["args"] if "gateway" in a] == ["--gateway-pods"]


def test_the_operator_watches_exactly_the_gateway_s_pods_and_may(k8s: Cluster, kvpilot: Installation) -> None:
    """The autoscaler reads the requests the gateways hold from the pods `--gateway-pods` names
    (autoscaling/gateways.py): the chart points it at the gateway Deployment's own pods, and its
    ServiceAccount may list and watch them (else every gateway is unknown and no service scales down)."""
    operator = k8s.kubectl_json("get", "deployment", kvpilot.fullname, "-n", kvpilot.namespace)
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--gateway-pods=")]
    namespace, _, selector = flag.removeprefix("--gateway-pods=").partition(":")
    gateway = k8s.kubectl_json("get", "deployment", f"{kvpilot.fullname}-gateway", "-n", kvpilot.namespace)
    labels = dict(pair.split("=", 1) for pair in selector.split(","))
    assert (namespace, labels) == (kvpilot.namespace, gateway["spec"]["selector"]["matchLabels"])
    listed = k8s.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    owners = {ref["name"] for pod in listed for ref in pod["metadata"].get("ownerReferences", [])}
    assert len(listed) == gateway["spec"]["replicas"] and all(
        o.startswith(f"{kvpilot.fullname}-gateway-") for o in owners
    )
    as_operator = f"--as={kvpilot.subject}"
    for verb in ("list", "watch"):
        assert (
            k8s.kubectl("auth", "can-i", verb, "pods", "-n", namespace, as_operator, check=False).stdout.strip()
            == "yes"
        )


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(url: str, key: str | None = None) -> tuple[int, Any]:
    with httpx.Client(trust_env=False, timeout=10, headers=_bearer(key)) as http:  # loopback only, never a proxy
        response = http.get(url)
    return response.status_code, response.json()


def _post(url: str, body: dict[str, Any], key: str | None = None) -> tuple[int, Any]:
    with httpx.Client(trust_env=False, timeout=30, headers=_bearer(key)) as http:
        response = http.post(url, json=body)
    return response.status_code, response.json()


def test_the_gateway_routes_by_namespace_and_never_wakes_a_zero_it_does_not_own(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    gateway: LocalGateway,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
) -> None:
    namespace = kvpilot.watch_namespaces[0]
    spec: dict[str, Any] = kvis.sample("smollm2-135m")["spec"]
    model = spec["model"].get("servedModelName") or spec["model"]["name"]
    off = {**spec, "replicas": 0, "autoscaling": {"mode": "off", "minReplicas": 0}}
    apply_isvc("gw-off", off)
    # A same-named model in another team's namespace (no operator there: only the gateway sees it).
    ensure_namespaces(k8s, [OTHER])
    k8s.apply(kvis.manifest("rival", OTHER, {**spec, "model": {**spec["model"], "servedModelName": model}}))
    k8s.apply(kvis.manifest("private", OTHER, {**spec, "model": {**spec["model"], "servedModelName": "their-own"}}))
    try:
        kvis.wait_condition(k8s, namespace, "gw-off", "Planned", "True", timeout_s=60)
        # gw-off's API key (the operator made it; no operator watches OTHER: its services are open).
        key = kvis.api_key(k8s, namespace, "gw-off")
        poll(lambda: kvis.get(k8s, namespace, "gw-off")["status"].get("auth") or None, 30, "gw-off's key digest")

        def listed(where: str, key: str | None = None) -> list[str]:
            return [m["id"] for m in _get(f"{gateway.base_url(where)}/models", key)[1]["data"]]

        poll(lambda: sorted(listed(OTHER)) == sorted([model, "their-own"]) or None, 30, "the rival's models listed")
        assert listed(namespace, key) == [model]
        assert listed(namespace) == []  # no key: not even the names
        status, body = _post(f"{gateway.base_url(namespace)}/completions", {"model": "their-own", "prompt": "hi"}, key)
        assert status == 404 and OTHER not in json.dumps(body)
        poll(
            lambda: k8s.kubectl_json("get", "deployment", "gw-off", "-n", namespace) or None, 60, "gw-off's Deployment"
        )
        started = time.monotonic()
        status, body = _post(f"{gateway.base_url(namespace)}/completions", {"model": model, "prompt": "hi"}, key)
        assert status == 503 and "autoscaling.mode is off" in body["error"]["message"], body
        assert time.monotonic() - started < 10
        deployment = k8s.kubectl_json("get", "deployment", "gw-off", "-n", namespace)
        assert deployment["spec"]["replicas"] == 0
        # gw-off's own: other tests' services in this namespace scale up and down (ScaledUp Events).
        reasons = [e["reason"] for e in kvis.events(k8s, namespace, "gw-off")]
        assert "ScaledUp" not in reasons
    finally:
        k8s.kubectl("delete", "namespace", OTHER, "--wait=false", check=False)
    # The gateway ran under its own ServiceAccount and was never refused.
    config = yaml.safe_load(gateway.kubeconfig.read_text())
    assert set(config["users"][0]["user"]) == {"token"}
    log = gateway.log()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]
