"""Scenario 10: `runtime: vllm` on the real control plane. A 70B model on the fake H100 nodes (8 GPUs
each) is planned with tensor parallelism, rolls out `vllm serve` pods requesting that many GPUs
(with no model.source, downloading the catalog model's Hub repository before vLLM starts), becomes
Ready from its pods' readiness, is what `kvpilot render` prints, and is scaled by the autoscaler from
what vLLM's own metrics code reports.

kwok runs no containers: each pod's /metrics is served on its loopback address by a stand-in whose
body vLLM 0.33's PrometheusStatLogger wrote (tests/vllm/exposition.py) after steps with a queue far
over `maxWaitingPerReplica`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from e2e import kvis
from e2e.aio_server import AioServer
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import plan
from tests.vllm import env
from tests.vllm.model_configs import config_json

SPEC: dict[str, Any] = {
    "runtime": "vllm",
    "model": {"name": "llama-3-70b"},
    "accelerator": {"type": "H100-80GB"},
    "serving": {"quantization": "none"},
    "autoscaling": {"mode": "slo", "minReplicas": 1, "maxReplicas": 2, "maxStep": 1},
}
# An engine step with 24 requests waiting and 8 running: 24 per replica against the default max of 4.
BUSY = [{"running": 8, "waiting": 24, "kv_usage": 0.5, "ttfts": [0.2, 0.3], "itls": [0.02]}]


# The KV blocks each vLLM pod says it allocated (vllm:cache_config_info), set beside the plan's.
ALLOCATED_BLOCKS = 4321


def _vllm_exposition(steps: list[dict[str, Any]]) -> str:
    case = {
        "argv": ["--tensor-parallel-size=2"],
        "config": config_json(MODELS["llama-3-70b"]),
        "steps": steps,
        "num_gpu_blocks": ALLOCATED_BLOCKS,
    }
    return env.run("exposition", json.dumps(case), timeout_s=600)


class VllmPods:
    """A /metrics stand-in on every Running pod's address, all serving `exposition`."""

    def __init__(self, k8s: Cluster, namespace: str, name: str, exposition: str) -> None:
        self.k8s, self.namespace, self.name, self.exposition = k8s, namespace, name, exposition
        self.stack = ExitStack()
        self.served: dict[str, AioServer] = {}

    def sync(self) -> None:
        for pod in kvis.running_pods(self.k8s, self.namespace, self.name):
            ip = pod["status"]["podIP"]
            if ip not in self.served:
                app = web.Application()
                app.router.add_get("/metrics", self._metrics)
                app.router.add_get("/health", self._ok)
                self.served[ip] = self.stack.enter_context(AioServer(f"vllm-{ip}", app, ip, names.PORT))

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.exposition, content_type="text/plain")

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    def __enter__(self) -> VllmPods:
        return self

    def __exit__(self, *_: object) -> None:
        self.stack.close()


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _rendered_by_the_cli(obj: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    manifest = tmp_path / "isvc.yaml"
    manifest.write_text(yaml.safe_dump(obj))
    run = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "render", "-f", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    rendered: dict[str, Any] = next(o for o in yaml.safe_load_all(run.stdout) if o["kind"] == "Deployment")
    return rendered


def test_a_vllm_service_is_split_over_gpus_rolls_out_and_is_scaled_on_vllm_metrics(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
    tmp_path: Path,
) -> None:
    namespace, name = kvpilot.watch_namespaces[0], "llama-70b-vllm"
    exposition = _vllm_exposition(BUSY)  # before the service: the first autoscaler period reads it
    apply_isvc(name, SPEC)
    obj = kvis.wait_condition(k8s, namespace, name, "Ready", "True", timeout_s=120)
    expected = plan(InferenceServiceSpec.model_validate(obj["spec"]))
    assert expected.fits and expected.gpu_count > 1, expected.reason
    assert obj["status"]["plan"]["runtime"] == "vllm" and obj["status"]["plan"]["gpuCount"] == expected.gpu_count

    deployment = k8s.kubectl_json("get", "deployment", name, "-n", namespace)
    engine = _engine(deployment)
    assert engine["command"] == ["vllm", "serve"] and engine["image"].startswith("vllm/vllm-openai:")
    assert f"--tensor-parallel-size={expected.gpu_count}" in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(expected.gpu_count)
    # No model.source: vLLM, offline in the pod, loads the catalog model's repository, which an init
    # container downloads first (kwok runs neither).
    assert engine["args"][0] == "/model-cache/hf/meta-llama/Meta-Llama-3-70B@main"
    assert deployment["spec"]["template"]["spec"]["initContainers"][0]["args"][0] == "meta-llama/Meta-Llama-3-70B"
    # What `kvpilot render -f` prints for the stored object is what the operator applied.
    assert _engine(_rendered_by_the_cli(obj, tmp_path))["args"] == engine["args"]
    # The scheduler placed it on an H100 node, whose 8 GPUs hold the pod's share.
    (pod,) = kvis.running_pods(k8s, namespace, name)
    node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"

    with VllmPods(k8s, namespace, name, exposition) as pods:

        def scaled() -> bool | None:
            pods.sync()
            return int(k8s.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"]) == 2 or None

        poll(scaled, 120, "the autoscaler's scale-up to 2 on vLLM's queue", interval_s=1.0)

        def blocks_compared() -> dict[str, Any] | None:
            pods.sync()
            status = kvis.get(k8s, namespace, name).get("status", {})
            return (status.get("planAccuracy") or {}).get("kvBlocks")

        compared = poll(blocks_compared, 120, "planAccuracy.kvBlocks from vLLM's cache_config_info", interval_s=1.0)
    assert compared["observed"] == ALLOCATED_BLOCKS and compared["predicted"] == expected.kv_blocks, compared
    events = [e for e in kvis.events(k8s, namespace, name) if e["reason"] == "ScaledUp"]
    assert any("1 -> 2" in e["message"] and "waiting 24.0/replica" in e["message"] for e in events), [
        e["message"] for e in events
    ]
