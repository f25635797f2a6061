"""Issue 43 on the real control plane: LoRA adapters of an InferenceService are loaded on its running
engine by the operator (no restart), listed in status.adapters, routed by the gateway to the pods that
hold them, and unloaded when they leave the spec; a malformed one is an error on that adapter while the
others serve.

The sample service (the embedded model) with two tiny PEFT adapters made here (absolute paths: what
"a path in the engine image" is for an engine running on this machine); kwok runs the pod, a real
`kvpilot serve` with the rendered arguments (`--enable-lora ...`) serves it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_engine import key_env, start_engine
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from e2e.procs import Process
from tests.engine.lora_fixtures import SPECS, AdapterSpec, make_adapter

NAME = "smollm2-adapters"
# The operator's adapter sync runs every autoscaler period (2 s here): a few of them.
SYNC_S = 60.0


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvpilot.engine.model.loader import embedded_model_dir

    root = tmp_path_factory.mktemp("adapters")
    specs = [*SPECS, AdapterSpec("gamma", 4, 4, ("q_proj", "v_proj"), 3)]
    made = {}
    for spec in specs:
        make_adapter(embedded_model_dir(), spec, root / spec.name)
        made[spec.name] = root / spec.name
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))  # no weights
    made["broken"] = broken
    return made


def _adapters(dirs: dict[str, Path], *names: str) -> list[dict[str, Any]]:
    return [{"name": n, "source": str(dirs[n])} for n in names]


@pytest.fixture()
def served(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: Any,
    adapter_dirs: dict[str, Path],
    tmp_path: Path,
) -> Iterator[tuple[dict[str, Any], Process, str]]:
    spec = {**kvis.sample("smollm2-135m")["spec"], "adapters": _adapters(adapter_dirs, "alpha", "beta")}
    apply_isvc(NAME, spec)
    ns = kvpilot.watch_namespaces[0]
    kvis.wait_condition(k8s, ns, NAME, "Ready", "True", timeout_s=60)
    (pod,) = kvis.running_pods(k8s, ns, NAME)
    deployment = k8s.kubectl_json("get", "deployment", NAME, "-n", ns)
    assert "--enable-lora" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    gates = deployment["spec"]["template"]["spec"]["readinessGates"]
    assert gates == [{"conditionType": "kvpilot.dev/adapters-loaded"}]
    process, url = start_engine(deployment, pod, tmp_path / "engine.log", env=key_env(k8s, ns, deployment))
    try:
        yield pod, process, url
    finally:
        assert process.stop() == 0, process.log_tail()


def _rows(k8s: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in kvis.get(k8s, ns, NAME)["status"].get("adapters", [])}


def _loaded(k8s: Cluster, ns: str, pod: str, *names: str) -> dict[str, dict[str, Any]] | None:
    rows = _rows(k8s, ns)
    return rows if all(pod in rows.get(n, {}).get("loadedOn", []) for n in names) else None


def _gate(k8s: Cluster, ns: str, pod: str) -> dict[str, Any] | None:
    """The pod's adapters-loaded condition as the operator writes it (kwok sets every readiness gate
    True itself when the pod starts, with no reason: the operator's carries one)."""
    conditions = k8s.kubectl_json("get", "pod", pod, "-n", ns)["status"].get("conditions") or []
    return next(
        (c for c in conditions if c["type"] == "kvpilot.dev/adapters-loaded" and c.get("reason") == "AdaptersLoaded"),
        None,
    )


def _complete(http: httpx.Client, url: str, key: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "prompt": "Once upon a time, in a small village,",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
    }
    return http.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_adapters_load_on_the_running_engine_route_through_the_gateway_and_unload(
    k8s: Cluster,
    kvpilot: Installation,
    gateway: LocalGateway,
    adapter_dirs: dict[str, Path],
    served: tuple[dict[str, Any], Process, str],
) -> None:
    pod, process, url = served
    ns, pod_name, pid = kvpilot.watch_namespaces[0], pod["metadata"]["name"], process.popen.pid
    poll(lambda: _loaded(k8s, ns, pod_name, "alpha", "beta"), SYNC_S, "alpha and beta loaded on the pod")
    # The readiness gate, set through pods/status with the chart's RBAC once the pod held both.
    gate = poll(lambda: _gate(k8s, ns, pod_name), SYNC_S, "the pod's readiness gate set by the operator")
    assert gate["status"] == "True" and gate["message"] == "holds 2 of 2 adapters", gate
    key = kvis.api_key(k8s, ns, NAME)
    with httpx.Client(trust_env=False, timeout=120) as http:
        # Through the gateway, by the adapter's name: the engine answers as that adapter, whose
        # delta moves the first token's log-probability off the base model's.
        first = {}
        for model in ("alpha", "beta", "SmolLM2-135M-Instruct"):
            answer = _complete(http, gateway.base_url(ns), key, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
            first[model] = answer.json()["choices"][0]["logprobs"]["token_logprobs"][0]
        assert len({round(v, 4) for v in first.values()}) == 3, first
        # A third adapter and a malformed one: loaded on the running engine, no restart.
        kvis.patch_spec(k8s, ns, NAME, {"adapters": _adapters(adapter_dirs, "alpha", "beta", "gamma", "broken")})
        rows = poll(lambda: _loaded(k8s, ns, pod_name, "gamma"), SYNC_S, "gamma loaded on the running engine")
        assert process.popen.poll() is None and process.popen.pid == pid
        assert [p["metadata"]["uid"] for p in kvis.running_pods(k8s, ns, NAME)] == [pod["metadata"]["uid"]]
        broken = poll(lambda: _rows(k8s, ns).get("broken", {}).get("error"), SYNC_S, "the malformed adapter's error")
        assert broken["pod"] == pod_name and "HTTP 4" in broken["message"], broken
        assert _complete(http, gateway.base_url(ns), key, "gamma").status_code == 200
        assert rows["alpha"]["loadedOn"] == [pod_name]  # the others serve on
        # beta leaves the spec: unloaded from the engine, and its name is no longer served.
        kvis.patch_spec(k8s, ns, NAME, {"adapters": _adapters(adapter_dirs, "alpha", "gamma")})
        poll(lambda: "beta" not in _rows(k8s, ns) or None, SYNC_S, "beta gone from status.adapters")

        def engine_models() -> list[str]:
            return [
                m["id"] for m in http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
            ]

        poll(lambda: "beta" not in engine_models() or None, SYNC_S, "beta unloaded from the engine")
        assert _complete(http, f"{url}/v1", key, "beta").status_code == 404
        assert process.popen.pid == pid
