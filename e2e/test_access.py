"""Issue 23 (operator side) on a real API server: each InferenceService gets an API-key Secret the
operator makes once, the digest of its key in `status.auth` (which the gateway checks) and on the
pod template, and a NetworkPolicy the API server accepts as rendered. A key rotated in the Secret
reaches the status and rolls the pods through the operator's watch of its Secrets.

The engines requiring the key, and the gateway checking it before a wake, run in test_engine.py
and test_autoscaling.py's scale-from-zero test (their clients send the Secret's key)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render

NAME = "keyed"


def _template_digest(k8s: Cluster, ns: str) -> str | None:
    deployment = k8s.kubectl_json("get", "deployment", NAME, "-n", ns)
    digest: str | None = deployment["spec"]["template"]["metadata"].get("annotations", {}).get(names.API_KEY_ANNOTATION)
    return digest


def test_a_service_gets_its_key_and_network_policy_and_a_rotated_key_rolls_its_pods(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
) -> None:
    ns = kvpilot.watch_namespaces[0]
    spec = {**kvis.sample("smollm2-135m")["spec"], "network": {"allowedNamespaces": ["monitoring"]}}
    apply_isvc(NAME, spec)
    obj = kvis.wait_condition(k8s, ns, NAME, "Ready", "True", timeout_s=60)
    key = kvis.api_key(k8s, ns, NAME)
    digest = hashlib.sha256(key.encode()).hexdigest()
    assert obj["status"]["auth"] == {"apiKeySha256": digest, "secretName": f"{NAME}-api-key"}
    assert _template_digest(k8s, ns) == digest
    secret = k8s.kubectl_json("get", "secret", f"{NAME}-api-key", "-n", ns)
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("InferenceService", NAME, obj["metadata"]["uid"])

    # The NetworkPolicy as the API server stored it: what the operator rendered, defaults aside.
    stored = k8s.kubectl_json("get", "networkpolicy", NAME, "-n", ns)
    rendered = render.network_policy(
        NAME, ns, obj["metadata"]["uid"], InferenceServiceSpec.model_validate(spec), kvpilot.namespace
    )
    assert stored["spec"]["podSelector"] == rendered["spec"]["podSelector"]
    assert stored["spec"]["ingress"] == rendered["spec"]["ingress"]
    assert stored["spec"]["policyTypes"] == ["Ingress"]

    # An admin rotates the key: the status and the pod template follow (the Secret's event).
    rotated = "rotated-" + key[:8]
    patch = {"data": {names.API_KEY_SECRET_KEY: base64.b64encode(rotated.encode()).decode()}}
    k8s.kubectl("patch", "secret", f"{NAME}-api-key", "-n", ns, "--type=merge", "-p", json.dumps(patch))
    new = hashlib.sha256(rotated.encode()).hexdigest()
    poll(
        lambda: kvis.get(k8s, ns, NAME)["status"].get("auth", {}).get("apiKeySha256") == new or None,
        30,
        "the rotated key's digest in the status",
    )
    assert _template_digest(k8s, ns) == new
    assert kvis.api_key(k8s, ns, NAME) == rotated  # the operator never wrote its own key back
