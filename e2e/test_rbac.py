"""Scenario 6: the operator acts only with the RBAC the chart grants.

Every operator in these tests runs under a token of the chart's ServiceAccount, so the other
scenarios passing already shows the grants suffice; this checks that they are also all it has.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from e2e import kvis
from e2e.chart import NAMESPACE, Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll

# (verb, resource, namespace or None for "the watched one", "" for cluster scope)
ALLOWED = [
    ("watch", "inferenceservices.kvpilot.dev", None),
    ("patch", "inferenceservices.kvpilot.dev/status", None),
    ("patch", "inferenceservices.kvpilot.dev/scale", None),  # the SLO autoscaler sets replicas
    ("patch", "deployments.apps", None),
    ("watch", "deployments.apps", None),
    ("patch", "services", None),
    ("watch", "services", None),
    ("patch", "poddisruptionbudgets.policy", None),
    ("watch", "poddisruptionbudgets.policy", None),
    ("patch", "networkpolicies.networking.k8s.io", None),
    ("watch", "networkpolicies.networking.k8s.io", None),
    ("patch", "secrets", None),  # each service's API key, made once (a server-side apply)
    ("watch", "secrets", None),
    ("patch", "kopfpeerings.kopf.dev", None),
    ("create", "events", None),
    ("watch", "pods", None),
    ("patch", "pods", None),  # the deletion cost the autoscaler sets before a scale-down
    ("patch", "pods/status", None),  # the adapters' readiness gate
    ("watch", "replicasets.apps", None),  # which pods are the service's own
    ("patch", "jobs.batch", None),  # a pvc:// checkpoint's inspection Job, made once (a server-side apply)
    ("get", "jobs.batch", None),
    ("list", "nodes", ""),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("watch", "namespaces", ""),
    ("get", "configmaps", NAMESPACE),  # CPU device profiles (accelerator.profile), in its own namespace only
]
DENIED = [
    ("get", "configmaps", None),
    ("get", "secrets", "default"),
    ("delete", "secrets", None),
    ("delete", "networkpolicies.networking.k8s.io", None),
    ("create", "pods", None),
    ("delete", "pods", None),
    ("update", "pods/status", None),
    ("delete", "inferenceservices.kvpilot.dev", None),
    ("delete", "services", None),
    # Nothing deletes a child: a plan that stops fitting keeps the last good Deployment, and
    # deleting an InferenceService leaves its children to the garbage collector.
    ("delete", "deployments.apps", None),
    ("delete", "poddisruptionbudgets.policy", None),
    ("delete", "jobs.batch", None),
    ("create", "jobs.batch", "default"),
    ("watch", "deployments.apps", "default"),
    ("create", "kopfpeerings.kopf.dev", None),
    ("patch", "deployments.apps", "default"),
    ("list", "inferenceservices.kvpilot.dev", "default"),
    ("patch", "clusterkopfpeerings.kopf.dev", ""),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("patch", "nodes", ""),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
]


def _can_i(k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str | None) -> str:
    ns = kvpilot.watch_namespaces[0] if namespace is None else namespace
    scope = ["-n", ns] if ns else []
    return k8s.kubectl("auth", "can-i", verb, resource, *scope, f"--as={kvpilot.subject}", check=False).stdout.strip()


@pytest.mark.parametrize("verb, resource, namespace", ALLOWED, ids=[f"{v}-{r}-{n}" for v, r, n in ALLOWED])
def test_chart_grants(k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str | None) -> None:
    assert _can_i(k8s, kvpilot, verb, resource, namespace) == "yes"


@pytest.mark.parametrize("verb, resource, namespace", DENIED, ids=[f"{v}-{r}-{n}" for v, r, n in DENIED])
def test_chart_denies(k8s: Cluster, kvpilot: Installation, verb: str, resource: str, namespace: str | None) -> None:
    assert _can_i(k8s, kvpilot, verb, resource, namespace) == "no"


def test_operator_runs_as_the_chart_service_account_and_is_never_refused(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator
) -> None:
    config: dict[str, Any] = yaml.safe_load(operator.kubeconfig.read_text())
    (user,) = config["users"]
    assert set(user["user"]) == {"token"}  # no client certificate, no admin fallback
    whoami = k8s.kubectl("auth", "whoami", "--kubeconfig", str(operator.kubeconfig), "-o", "json").stdout
    assert yaml.safe_load(whoami)["status"]["userInfo"]["username"] == kvpilot.subject
    # By now the other scenarios have made the operator create, patch, delete and watch; the API
    # server never refused it (kopf logs a refused request with its status code).
    log = operator.log()
    assert "Forbidden" not in log and " 403" not in log, [
        line for line in log.splitlines() if "403" in line or "Forbidden" in line
    ]


def test_inference_services_outside_the_watched_namespaces_are_left_alone(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any
) -> None:
    # One InferenceService in a namespace the chart does not grant, one in the watched namespace
    # as the witness that the operator is acting meanwhile.
    outside = "kvpilot-e2e-unwatched"
    k8s.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": outside}})
    spec = {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"}, "replicas": 1}
    k8s.apply(kvis.manifest("stray", outside, spec))
    apply_isvc("witness", spec)
    watched = kvpilot.watch_namespaces[0]
    kvis.wait_condition(k8s, watched, "witness", "Ready", "True", timeout_s=60)
    # Its children's events were handled too (they reconcile the witness again), all after the
    # stray InferenceService was made.
    handled = f"[{watched}/witness] Handler 'child_handler' succeeded"
    poll(lambda: handled in operator.log(), 60, "an event of the witness's children")
    assert "status" not in kvis.get(k8s, outside, "stray")
    assert kvis.children(k8s, outside, "stray") == []
    k8s.kubectl("delete", "namespace", outside, "--wait=false")
