"""The chart's optional ValidatingAdmissionPolicy, enforced by the real API server: images only under
the allowed prefixes, Secrets and HF_ENDPOINT only in namespaces labelled for them (docs/security.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e import kvis
from e2e.chart import CHART_DIR, Installation, ensure_namespaces
from e2e.cluster import Cluster

OPEN, CLOSED = "vap-open", "vap-closed"
GOOD: dict[str, Any] = {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"}}
SECRET_ENV = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]


@pytest.fixture(scope="module")
def policy(k8s: Cluster, kvpilot: Installation) -> Iterator[list[dict[str, Any]]]:
    """The chart's policy and binding, rendered with an image allowlist and applied; removed after."""
    rendered = k8s.helm(
        "template",
        "vap",
        str(CHART_DIR),
        "--set",
        "admissionPolicy.enabled=true",
        "--set",
        "admissionPolicy.allowedImagePrefixes={registry.example/kvpilot/}",
        "--show-only",
        "templates/admission-policy.yaml",
    ).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    assert [o["kind"] for o in objects] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    ensure_namespaces(k8s, [OPEN, CLOSED])
    k8s.kubectl(
        "label",
        "namespace",
        OPEN,
        "--overwrite",
        "kvpilot.dev/allow-secrets=true",
        "kvpilot.dev/allow-hf-endpoint=true",
    )
    k8s.apply(*objects)
    yield objects
    for obj in reversed(objects):
        k8s.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


def _create(k8s: Cluster, namespace: str, spec: dict[str, Any]) -> str:
    """'' when a dry-run create is accepted, else the API server's refusal."""
    result = k8s.kubectl(
        "create",
        "--dry-run=server",
        "-f",
        "-",
        check=False,
        input=yaml.safe_dump(kvis.manifest("guarded", namespace, spec)),
    )
    return "" if result.returncode == 0 else result.stderr


def _refused(k8s: Cluster, namespace: str, spec: dict[str, Any], words: str, seconds: float = 30.0) -> str:
    """The refusal, waiting for the policy to take effect (the API server compiles it asynchronously)."""
    deadline = time.monotonic() + seconds
    answer = _create(k8s, namespace, spec)
    while words not in answer and time.monotonic() < deadline:
        time.sleep(0.5)
        answer = _create(k8s, namespace, spec)
    return answer


@pytest.mark.parametrize(
    "spec, words",
    [
        ({**GOOD, "image": "evil.example/miner:1"}, "spec.image evil.example/miner:1 is not under an allowed prefix"),
        ({**GOOD, "env": SECRET_ENV}, "may not read Secrets"),
        ({**GOOD, "envFrom": [{"secretRef": {"name": "s"}}]}, "may not read Secrets"),
        (
            {
                "model": {
                    "name": "llama-2-7b",
                    "source": "hf://meta-llama/Llama-2-7b-hf",
                    "tokenSecret": {"name": "hf"},
                },
                "accelerator": {"type": "A10G"},
            },
            "may not read Secrets",
        ),
        ({**GOOD, "env": [{"name": "HF_ENDPOINT", "value": "http://attacker.example"}]}, "may not set HF_ENDPOINT"),
    ],
)
def test_the_policy_refuses_what_the_namespace_is_not_allowed(
    k8s: Cluster, policy: list[dict[str, Any]], spec: dict[str, Any], words: str
) -> None:
    assert words in _refused(k8s, CLOSED, spec, words)


def test_the_policy_admits_what_the_namespace_is_allowed(k8s: Cluster, policy: list[dict[str, Any]]) -> None:
    # Wait until the policy is in force (an image outside the list is refused), then check.
    assert "not under an allowed prefix" in _refused(
        k8s, OPEN, {**GOOD, "image": "evil.example/x:1"}, "not under an allowed prefix"
    )
    assert _create(k8s, CLOSED, GOOD) == ""
    assert _create(k8s, CLOSED, {**GOOD, "image": "registry.example/kvpilot/engine:1"}) == ""
    allowed = {
        **GOOD,
        "env": [*SECRET_ENV, {"name": "HF_ENDPOINT", "value": "http://hub.internal"}],
        "envFrom": [{"secretRef": {"name": "s"}}],
    }
    assert _create(k8s, OPEN, allowed) == ""
