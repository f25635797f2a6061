"""Issue 41's mixed pool on the real control plane, shared by its e2e tests: the embedded model over
one L4 and one H100-80GB replica at most (a Deployment per GPU type, `<name>-<variant label>`), run
by our engine (which loads the model by name), and what those tests read of it: each type's
status.variants row, each type's Deployment's replicas, and the engine behind each type's pod.
"""

from __future__ import annotations

from typing import Any

from e2e import kvis
from e2e.cluster import Cluster
from e2e.pod_runner import PodRunner
from kvpilot.operator.api.names import VARIANT_LABEL, variant, variant_deployment

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
POOL = [{"type": "L4", "maxReplicas": 1}, {"type": "H100-80GB", "maxReplicas": 1}]
GPUS = [v["type"] for v in POOL]


def pool_spec(**extra: Any) -> dict[str, Any]:
    """The pool, planned with the CRD's defaults but for `extra` (top-level spec fields); no
    speculation (alike steps on both types)."""
    return {
        "model": {"name": MODEL},
        "runtime": "kvpilot",
        "accelerator": {"variants": POOL},
        "serving": {"speculative": "off"},
        **extra,
    }


def variant_rows(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.variants by GPU type (the dict keeps the status's order: cheapest per req/s first)."""
    return {row["gpu"]: row for row in obj.get("status", {}).get("variants", [])}


def cost_per_rps_hour(row: dict[str, Any]) -> float:
    """A status.variants row's replica-hour over its capacity: what ranks the types."""
    return float(row["pricePerGpuHour"]) * int(row["gpuCount"]) / float(row["capacityRps"])


def deployment_replicas(k8s: Cluster, namespace: str, name: str) -> dict[str, int]:
    """Each GPU type's Deployment's spec.replicas."""
    found = kvis.children(k8s, namespace, name, "deployments")
    by_name = {d["metadata"]["name"]: int(d["spec"].get("replicas") or 0) for d in found}
    return {gpu: by_name[deployment] for gpu in GPUS if (deployment := variant_deployment(name, gpu)) in by_name}


def engine_urls(k8s: Cluster, namespace: str, name: str, runner: PodRunner) -> dict[str, str]:
    """GPU type -> base URL of the serving engine behind that type's Running pod (each type has one
    at most)."""
    labels = {p["metadata"]["name"]: p["metadata"]["labels"] for p in kvis.running_pods(k8s, namespace, name)}
    return {
        gpu: url
        for pod, url in runner.serving().items()
        for gpu in GPUS
        if pod in labels and labels[pod].get(VARIANT_LABEL) == variant(gpu)
    }
