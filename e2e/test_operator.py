"""Scenarios 2, 4 and 5: the operator (the chart's, run locally under its ServiceAccount) turns
InferenceServices into engine Deployments, Services and PDBs on the fake GPU nodes, keeps them
converged, and says clearly when a model cannot fit."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator import render, status
from kvpilot.operator.gpu_catalog import GPUS
from kvpilot.operator.planner import plan
from kvpilot.operator.spec import InferenceServiceSpec

ApplyISVC = Callable[[str, dict[str, Any]], dict[str, Any]]
# Children come back on the operator's resync (15 s); allow for a noisy machine.
CONVERGE_S = 60.0


def _uids(k8s: Cluster, ns: str, name: str) -> dict[tuple[str, str], str]:
    return {(o["kind"], o["metadata"]["name"]): o["metadata"]["uid"] for o in kvis.children(k8s, ns, name)}


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _arg(deployment: dict[str, Any], flag: str) -> str:
    args = _engine(deployment)["args"]
    return str(args[args.index(flag) + 1])


def test_inference_service_rolls_out_its_plan_on_the_right_gpus(
        k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC) -> None:
    ns, name = kvpilot.watch_namespaces[0], "llama-3-8b-l4"
    apply_isvc(name, {"model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"},
                      "serving": {"maxContextLength": 8192}, "replicas": 2})
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)

    # The plan, recomputed here from the spec as the API server stored it (with its defaults).
    spec = InferenceServiceSpec.model_validate(obj["spec"])
    expected = plan(spec)
    assert expected.fits
    assert obj["status"]["plan"] == status.plan_summary(expected)
    assert obj["status"]["url"] == f"http://{name}.{ns}.svc.cluster.local:8000/v1"
    assert (obj["status"]["replicas"], obj["status"]["readyReplicas"]) == (2, 2)
    assert "2/2 replicas ready" in kvis.condition(obj, "Ready")["message"]

    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    wanted = render.deployment(name, ns, obj["metadata"]["uid"], spec, expected)
    assert _engine(deployment)["args"] == _engine(wanted)["args"]
    assert _arg(deployment, "--max-num-seqs") == str(obj["status"]["plan"]["maxNumSeqs"])
    assert _arg(deployment, "--max-model-len") == "8192"
    assert _arg(deployment, "--quantization") == obj["status"]["plan"]["quantization"]
    service = k8s.kubectl_json("get", "service", name, "-n", ns)
    pdb = k8s.kubectl_json("get", "poddisruptionbudget", name, "-n", ns)
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["spec"]["selector"] == render.selector_labels(name)
    assert pdb["spec"]["maxUnavailable"] == 1
    for child in (deployment, service, pdb):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", obj["metadata"]["uid"], True)

    # Two engine pods, each with one L4, scheduled by the real scheduler onto the L4 node.
    l4 = GPUS["L4"]
    pods = kvis.running_pods(k8s, ns, name)
    assert len(pods) == 2
    for pod in pods:
        node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
        assert node["metadata"]["labels"][l4.product_label] == l4.product
        assert pod["spec"]["containers"][0]["resources"]["limits"][l4.resource] == str(expected.gpu_count)
    print(k8s.kubectl("get", "kvis,deploy,svc,pdb,pods", "-n", ns, "-o", "wide").stdout)


def test_unset_gpu_type_is_planned_for_a_gpu_the_nodes_have(
        k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC) -> None:
    ns, name = kvpilot.watch_namespaces[0], "mistral-any-gpu"
    apply_isvc(name, {"model": {"name": "mistral-7b"}, "replicas": 1})
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    gpu = GPUS[obj["status"]["plan"]["gpu"]]
    assert gpu.product in {n.product for n in k8s.nodes}
    (pod,) = kvis.running_pods(k8s, ns, name)
    node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"][gpu.product_label] == gpu.product


def test_lifecycle_generation_repair_restart_and_garbage_collection(
        k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC) -> None:
    ns, name = kvpilot.watch_namespaces[0], "llama-2-7b-a10g"
    apply_isvc(name, {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"},
                      "serving": {"maxContextLength": 4096}, "replicas": 1})
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S, generation=1)
    deployment_uid = k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["uid"]

    # A spec change is a new generation; the operator re-plans, rolls the Deployment in place and
    # reports the generation it acted on.
    k8s.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                "-p", json.dumps({"spec": {"serving": {"maxContextLength": 2048}}}))
    assert kvis.get(k8s, ns, name)["metadata"]["generation"] == 2
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S, generation=2)
    assert {c["observedGeneration"] for c in obj["status"]["conditions"]} == {2}
    assert obj["status"]["plan"]["maxModelLen"] == 2048
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    assert deployment["metadata"]["uid"] == deployment_uid
    assert deployment["metadata"]["generation"] == 2 and _arg(deployment, "--max-model-len") == "2048"
    k8s.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=60s", timeout=70)

    # Children deleted by hand come back (the resync re-applies them).
    for kind in ("deployment", "service", "poddisruptionbudget"):
        k8s.kubectl("delete", kind, name, "-n", ns)
    poll(lambda: {o["kind"] for o in kvis.children(k8s, ns, name, "deployments,services,poddisruptionbudgets")}
              == {"Deployment", "Service", "PodDisruptionBudget"}, CONVERGE_S, "children recreated")
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    k8s.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=60s", timeout=70)

    # A restarted operator resumes on what exists and creates nothing new, not even a rollout.
    before = _uids(k8s, ns, name)
    generation = k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["generation"]
    restarted = operator.restart()
    poll(lambda: f"[{ns}/{name}] Resuming is processed" in restarted.log.read_text(), CONVERGE_S,
              "the restarted operator resumed the InferenceService")
    assert _uids(k8s, ns, name) == before
    assert k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["generation"] == generation
    assert kvis.condition(kvis.get(k8s, ns, name), "Ready")["status"] == "True"

    # Deleting the InferenceService garbage-collects every child (kube-controller-manager's GC).
    k8s.kubectl("delete", "inferenceservice", name, "-n", ns, "--timeout=60s", timeout=70)
    poll(lambda: kvis.children(k8s, ns, name) == [], CONVERGE_S, f"children of {name} garbage-collected")


def test_a_model_that_cannot_fit_is_not_ready_with_the_numbers(
        k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC) -> None:
    ns, name = kvpilot.watch_namespaces[0], "too-big"
    apply_isvc(name, {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "L4"}, "replicas": 1})
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)

    # Now 70B on one 24 GiB L4: even INT4 weights do not fit.
    k8s.kubectl("patch", "inferenceservice", name, "-n", ns, "--type=merge",
                "-p", json.dumps({"spec": {"model": {"name": "llama-2-70b"}}}))
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "False", timeout_s=CONVERGE_S, generation=2)
    ready = kvis.condition(obj, "Ready")
    assert ready["reason"] == "WeightsDoNotFit", ready
    numbers = re.findall(r"\d+(?:\.\d+)? GiB", ready["message"])
    assert len(numbers) >= 2, ready["message"]  # the weights and the GPU memory, at least
    assert "24" in ready["message"], ready["message"]
    assert obj["status"]["plan"]["fits"] is False
    assert kvis.condition(obj, "Planned")["status"] == "False"
    # The old engines are gone, and no Deployment comes back on the next resync either.
    poll(lambda: kvis.children(k8s, ns, name, "deployments,pods") == [], CONVERGE_S, "engines removed")
    resynced = f"[{ns}/{name}] Timer 'resync' succeeded"
    seen = operator.log().count(resynced)
    poll(lambda: operator.log().count(resynced) > seen, CONVERGE_S, "one more resync")
    assert kvis.children(k8s, ns, name, "deployments,pods") == []
    assert kvis.condition(kvis.get(k8s, ns, name), "Ready")["reason"] == "WeightsDoNotFit"
