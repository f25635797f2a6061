"""Issue 23 (interop): the InferencePool kvpilot renders is one the real API server accepts under the
CRD of the Gateway API Inference Extension's published Go module (e2e/gie.py pins the release), as a
child of its InferenceService; and pools that break that schema are refused."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from e2e import gie, kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator.api.spec import EndpointPickerSpec
from kvpilot.operator.controller.inference_pool import inference_pool

POOL_CRD = "inferencepools.inference.networking.k8s.io"
PICKER = EndpointPickerSpec()
UID = "0b7c6e1e-0000-4000-8000-000000000003"
GC_S = 60.0


@pytest.fixture(scope="module")
def pool_crd(k8s: Cluster) -> Iterator[dict[str, Any]]:
    crd = gie.inference_pool_crd()
    assert crd["metadata"]["name"] == POOL_CRD
    k8s.apply(crd)
    k8s.kubectl("wait", "--for=condition=Established", f"crd/{POOL_CRD}", "--timeout=60s")
    yield crd
    k8s.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=false")


@pytest.fixture(scope="module")
def namespace(k8s: Cluster) -> Iterator[str]:
    """A namespace of its own: no operator watches it, so the InferenceService there only owns."""
    ns = f"gie-{secrets.token_hex(3)}"
    k8s.kubectl("create", "namespace", ns)
    yield ns
    k8s.kubectl("delete", "namespace", ns, "--wait=false")


def create(k8s: Cluster, obj: dict[str, Any], *, dry_run: bool = False) -> Any:
    argv = ["create", "-o", "json", "-f", "-", *(["--dry-run=server"] if dry_run else [])]
    return k8s.kubectl(*argv, input=yaml.safe_dump(obj), check=False)


def contains(stored: Any, rendered: Any) -> bool:
    """`stored` holds every field of `rendered` with its value (the server may add defaults)."""
    if isinstance(rendered, dict):
        return isinstance(stored, dict) and all(contains(stored.get(k), v) for k, v in rendered.items())
    if isinstance(rendered, list):
        return isinstance(stored, list) and len(stored) == len(rendered) and all(map(contains, stored, rendered))
    return bool(stored == rendered)


def test_the_crd_is_the_pinned_releases_v1(pool_crd: dict[str, Any]) -> None:
    assert pool_crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == gie.VERSION
    assert [v["name"] for v in pool_crd["spec"]["versions"] if v["served"]] == ["v1"]


def test_the_rendered_pool_is_stored_as_rendered_and_collected_with_its_inference_service(
    k8s: Cluster, kvpilot: Installation, pool_crd: dict[str, Any], namespace: str
) -> None:
    isvc = kvis.sample("smollm2-135m")
    isvc["metadata"]["namespace"] = namespace
    k8s.apply(isvc)
    name = isvc["metadata"]["name"]
    uid = kvis.get(k8s, namespace, name)["metadata"]["uid"]

    pool = inference_pool(name, namespace, uid, EndpointPickerSpec())
    result = create(k8s, pool)
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)
    # A structural schema drops unknown fields without a word: all we rendered must still be there.
    assert contains(stored, pool), json.dumps(stored, indent=1)
    # The schema's defaults were applied: the extension's CRD, not a permissive stand-in, stored it.
    assert stored["spec"]["endpointPickerRef"]["group"] == ""

    k8s.kubectl("delete", "inferenceservice", name, "-n", namespace)
    poll(
        lambda: k8s.kubectl("get", "inferencepool", name, "-n", namespace, check=False).returncode != 0,
        GC_S,
        f"InferencePool {name} garbage-collected with its InferenceService",
    )


def _without_target_ports(pool: dict[str, Any]) -> None:
    del pool["spec"]["targetPorts"]


def _picker_without_port(pool: dict[str, Any]) -> None:
    del pool["spec"]["endpointPickerRef"]["port"]


def _empty_selector(pool: dict[str, Any]) -> None:
    pool["spec"]["selector"]["matchLabels"] = {}


def _same_port_twice(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"] *= 2


# (id, how a rendered pool is broken, what the API server must say)
BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("no-target-ports", _without_target_ports, "spec.targetPorts: Required value"),
    ("picker-without-port", _picker_without_port, "port is required when kind is 'Service'"),
    ("empty-selector", _empty_selector, "spec.selector.matchLabels in body should have at least 1 properties"),
    ("duplicate-target-port", _same_port_twice, "port number must be unique"),
]


def test_the_rendered_pool_passes_the_servers_validation(
    k8s: Cluster, pool_crd: dict[str, Any], namespace: str
) -> None:
    # The control for the cases below: unbroken, the same pool is accepted.
    result = create(k8s, inference_pool("chat", namespace, UID, PICKER), dry_run=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("breaks, message", [(b, m) for _, b, m in BROKEN], ids=[i for i, _, _ in BROKEN])
def test_a_pool_that_breaks_the_schema_is_refused(
    k8s: Cluster,
    pool_crd: dict[str, Any],
    namespace: str,
    breaks: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    pool = inference_pool("chat", namespace, UID, PICKER)
    breaks(pool)
    result = create(k8s, pool, dry_run=True)
    assert result.returncode != 0, result.stdout
    assert 'The InferencePool "chat" is invalid' in result.stderr, result.stderr
    assert message in result.stderr, result.stderr


def test_the_operator_makes_the_pool_a_service_asks_for(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
    pool_crd: dict[str, Any],
) -> None:
    """The real operator, with the chart's RBAC, writes the pool (spec.inferencePool) and the API
    server stores what it rendered."""
    ns = kvpilot.watch_namespaces[0]
    apply_isvc("pooled", {**kvis.sample("smollm2-135m")["spec"], "inferencePool": {"enabled": True}})
    obj = kvis.wait_condition(k8s, ns, "pooled", "Ready", "True", timeout_s=90)
    stored = k8s.kubectl_json("get", "inferencepool", "pooled", "-n", ns)
    assert contains(stored, inference_pool("pooled", ns, obj["metadata"]["uid"], PICKER) | {"metadata": {}})
    assert stored["spec"]["endpointPickerRef"]["name"] == "pooled-epp"
    assert stored["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    labels = k8s.kubectl_json("get", "deployment", "pooled", "-n", ns)["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == "vllm"
