"""InferenceServices in a live cluster: manifests, the examples, and waiting on their status."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import Cluster
from e2e.polling import poll
from kvpilot.operator.api.names import API_KEY_SECRET_KEY, API_VERSION, KIND, api_key_secret, selector

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def sample(name: str) -> dict[str, Any]:
    """A manifest from examples/ (the file name without .yaml)."""
    manifest: dict[str, Any] = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())
    return manifest


def manifest(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def get(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", "inferenceservice", name, "-n", namespace)
    return found


def api_key(cluster: Cluster, namespace: str, name: str) -> str:
    """The service's API key, from the Secret the operator made (spec.auth.apiKey), waited for."""
    secret_name = api_key_secret(name)

    def read() -> str | None:
        found = cluster.kubectl("get", "secret", secret_name, "-n", namespace, "-o", "json", check=False)
        if found.returncode != 0:
            return None
        return base64.b64decode(json.loads(found.stdout)["data"][API_KEY_SECRET_KEY]).decode()

    key: str = poll(read, timeout_s=60, what=f"Secret {namespace}/{secret_name}")
    return key


def patch_spec(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    """Merge `spec` into the InferenceService's spec, as `kubectl patch --type=merge` does."""
    cluster.kubectl(
        "patch", "inferenceservice", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec})
    )


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    """A status condition of `obj` ({} when absent)."""
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def wait_condition(
    cluster: Cluster,
    namespace: str,
    name: str,
    type_: str,
    status: str,
    timeout_s: float = 60.0,
    generation: int | None = None,
) -> dict[str, Any]:
    """Wait until condition `type_` has `status` (for `generation`, when given); return the object."""
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        nonlocal last
        last = get(cluster, namespace, name)
        seen = last.get("status", {}).get("observedGeneration")
        if generation is not None and seen != generation:
            return None
        return last if condition(last, type_).get("status") == status else None

    try:
        return poll(check, timeout_s, f"{namespace}/{name} {type_}={status}")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; status: {last.get('status')}") from None


def children(
    cluster: Cluster,
    namespace: str,
    name: str,
    kinds: str = "deployments,replicasets,pods,services,poddisruptionbudgets",
) -> list[dict[str, Any]]:
    """Every object of `kinds` carrying the engine labels of InferenceService `name`."""
    items: list[dict[str, Any]] = cluster.kubectl_json("get", kinds, "-n", namespace, "-l", selector(name))["items"]
    return items


def running_pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = children(cluster, namespace, name, "pods")
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and p["status"].get("podIP")
        and not p["metadata"].get("deletionTimestamp")
    ]


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Events about InferenceService `namespace/name` (the operator's and the gateway's)."""
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=InferenceService",
    )["items"]
    return items
