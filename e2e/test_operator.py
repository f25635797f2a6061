"""Scenarios 2, 4 and 5: the operator (the chart's, run locally under its ServiceAccount) turns
InferenceServices into engine Deployments, Services and PDBs on the fake GPU nodes, keeps them
converged, and says clearly when a model cannot fit; and (issue #12) it never takes over an
object it does not own, keeps the last good Deployment when a spec stops planning, reports
refused writes, puts no finalizer on InferenceServices and costs nothing while idle."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster, default_gpu_nodes, node_manifest
from e2e.conftest import CAPACITY_LABEL, SPOT_L40S_PRICE
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render, status
from kvpilot.operator.planning.gpus import GPUS, LIST_PRICE_PER_GPU_HOUR
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.planning.sources import with_model_source

ApplyISVC = Callable[[str, dict[str, Any]], dict[str, Any]]
# Children come back on the events of their deletion, Ready follows the Deployment's events:
# seconds, but allow for a noisy machine.
CONVERGE_S = 60.0
# How soon Ready must follow the pods once they are ready (watch-driven, not a resync period).
READY_FOLLOWS_S = 10.0


def _spec(
    model: str, gpu: str | None = None, replicas: int = 1, context: int | None = None, **extra: Any
) -> dict[str, Any]:
    """An InferenceService spec: `replicas` of `model` on `gpu` (None: any GPU the nodes have), at
    `context` tokens when given, with the `extra` fields as they are."""
    spec: dict[str, Any] = {"model": {"name": model}, "replicas": replicas, **extra}
    if gpu is not None:
        spec["accelerator"] = {"type": gpu}
    if context is not None:
        spec["serving"] = {"maxContextLength": context}
    return spec


def _uids(k8s: Cluster, ns: str, name: str) -> dict[tuple[str, str], str]:
    return {(o["kind"], o["metadata"]["name"]): o["metadata"]["uid"] for o in kvis.children(k8s, ns, name)}


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _arg(deployment: dict[str, Any], flag: str) -> str:
    args = _engine(deployment)["args"]
    return str(args[args.index(flag) + 1])


def test_inference_service_rolls_out_its_plan_on_the_right_gpus(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "llama-3-8b-l4"
    apply_isvc(name, _spec("llama-3-8b", "L4", replicas=2, context=8192))
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)

    # The plan, recomputed here from the spec as the API server stored it (with its defaults), read
    # as the operator reads it: with no model.source, the engine is given the catalog's repository.
    spec = with_model_source(InferenceServiceSpec.model_validate(obj["spec"]))
    assert spec.model.source == "hf://meta-llama/Meta-Llama-3-8B"
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
    assert service["spec"]["selector"] == names.selector_labels(name)
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
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "mistral-any-gpu"
    apply_isvc(name, _spec("mistral-7b"))
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    gpu = GPUS[obj["status"]["plan"]["gpu"]]
    assert gpu.product in {n.product for n in k8s.nodes}
    (pod,) = kvis.running_pods(k8s, ns, name)
    node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"][gpu.product_label] == gpu.product


# Node indexes (their loopback IPs and pod CIDRs) past the session's fleet.
OWN_NODE_INDEX = 60
OWN_FLEET = (("L40S", 8), ("A100-40GB", 8))


@contextlib.contextmanager
def _own_gpu_nodes(
    k8s: Cluster,
    suffix: str,
    fleet: tuple[tuple[str, int], ...] = OWN_FLEET,
    labels: tuple[Mapping[str, str], ...] = (),
) -> Iterator[None]:
    """Fresh kwok nodes, one per (GPU type, GPUs), of types the session's fleet lacks (L40S,
    A100-40GB): a mixed pool's pods find these GPUs free, whatever earlier tests' pods still hold.
    `labels`, when given: each node's own extra labels, in the fleet's order (a capacity class's).
    Deleted (waited for) at the end, so the next test's pods cannot land on them."""
    extra = labels or tuple({} for _ in fleet)
    specs = [
        replace(n, name=f"{n.name}-{suffix}", extra_labels=own)
        for n, own in zip(default_gpu_nodes(fleet), extra, strict=True)
    ]
    k8s.apply(*(node_manifest(n, OWN_NODE_INDEX + i) for i, n in enumerate(specs)))

    def ready(node: str) -> bool:
        conditions = k8s.kubectl_json("get", "node", node)["status"].get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # Ready before the pods come: a pod the scheduler tried while they were not would hold its type full.
    poll(lambda: all(ready(n.name) for n in specs) or None, CONVERGE_S, "the test's own GPU nodes Ready")
    try:
        yield
    finally:
        k8s.kubectl("delete", "node", *(n.name for n in specs), "--wait=true", timeout=CONVERGE_S)


POOL = [{"type": "L40S", "maxReplicas": 2}, {"type": "A100-40GB", "maxReplicas": 2}]


def test_a_mixed_pool_gets_a_deployment_per_gpu_type_filled_cheapest_first(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    """Issue 41: one InferenceService over two GPU types, at most 2 replicas of each; each type's
    pods on its own nodes, the replicas on the cheaper type per req/s first, and the dearer type's
    pods the first to go when the service scales down."""
    ns, name = kvpilot.watch_namespaces[0], "mixed-pool"
    with _own_gpu_nodes(k8s, "mixed"):
        apply_isvc(name, _spec("llama-3-8b", replicas=3, accelerator={"variants": POOL}))
        # Three pods of two Deployments through the scheduler and kwok: twice the usual wait.
        obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=2 * CONVERGE_S)
        rows = obj["status"]["variants"]
        assert {row["gpu"] for row in rows} == {"L40S", "A100-40GB"}
        # Cheapest per req/s first: it is full (2) before the other takes the third replica.
        per_rps = [row["pricePerGpuHour"] * row["gpuCount"] / row["capacityRps"] for row in rows]
        assert per_rps == sorted(per_rps)
        assert [row["replicas"] for row in rows] == [2, 1]
        assert (obj["status"]["replicas"], obj["status"]["readyReplicas"]) == (3, 3)
        running = kvis.running_pods(k8s, ns, name)
        for row in rows:
            gpu = GPUS[row["gpu"]]
            deployment = k8s.kubectl_json("get", "deployment", row["deployment"], "-n", ns)
            assert deployment["spec"]["replicas"] == row["replicas"]
            pods = [
                p
                for p in running
                if p["metadata"]["labels"].get(names.VARIANT_LABEL)
                == names.variant(row["gpu"], row.get("capacityClass"))
            ]
            assert len(pods) == row["replicas"]
            for pod in pods:
                node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
                assert node["metadata"]["labels"][gpu.product_label] == gpu.product
        # Each type's change is an Event naming the type and why (the API server took them).
        events = k8s.kubectl_json(
            "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason=VariantScaled"
        )["items"]
        said = " | ".join(e["message"] for e in events)
        assert f"{name}-l40s: 0 -> 2 replicas: L40S is type 1 of 2" in said, said
        # Down to one replica: the dearer type's goes, the cheaper keeps one.
        k8s.kubectl("scale", "inferenceservice", name, "-n", ns, "--replicas=1")
        poll(
            lambda: [r["replicas"] for r in kvis.get(k8s, ns, name)["status"].get("variants", [])] == [1, 0] or None,
            CONVERGE_S,
            "the mixed pool scaled down to one replica of its cheaper type",
        )
        print(k8s.kubectl("get", "kvis,deploy,pods", "-n", ns, "-o", "wide").stdout)


def test_replicas_a_full_gpu_type_cannot_place_go_to_the_next_type(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    """Issue 41: seven replicas, the cheaper type per req/s first; its one node has 4 GPUs, so the
    pods beyond them stay Pending, and the operator gives those replicas to the other type."""
    ns, name = kvpilot.watch_namespaces[0], "full-pool"
    variants = [{"type": t, "maxReplicas": 20} for t, _ in OWN_FLEET]
    autoscaling = {"mode": "off", "maxReplicas": 20}
    with _own_gpu_nodes(k8s, "full", (("L40S", 4), ("A100-40GB", 8))):
        spec = _spec("llama-3-8b", replicas=7, accelerator={"variants": variants}, autoscaling=autoscaling)
        apply_isvc(name, spec)
        obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=2 * CONVERGE_S)
        first, second = obj["status"]["variants"]
        # The first type's node is full: it keeps what the scheduler placed, the rest run on the second
        # type (the scheduler may have bound fewer than 4 when it first refused one: never more).
        assert first["gpu"] == "L40S" and first["fullSince"]
        assert first["schedulableReplicas"] == first["replicas"] <= 4
        assert second["replicas"] == 7 - first["replicas"] >= 3
        assert obj["status"]["readyReplicas"] == 7
        pending = [p for p in kvis.children(k8s, ns, name, "pods") if p["status"].get("phase") == "Pending"]
        assert pending == []


# Issue 41's capacity classes (the session chart's, conftest.CAPACITY_CLASSES): an L40S node of each
# class, so that only a class's node labels tell its pods where to go. The spec names on-demand
# first: spot coming first in the status is the operator's ranking by price, not the spec's order.
CLASS_FLEET = (("L40S", 2), ("L40S", 2))
CLASS_NODE_LABELS = ({CAPACITY_LABEL: "spot"}, {CAPACITY_LABEL: "on-demand"})
CLASS_POOL = [
    {"type": "L40S", "capacityClass": "on-demand", "maxReplicas": 2},
    {"type": "L40S", "capacityClass": "spot", "maxReplicas": 1},
]


def test_capacity_classes_of_one_gpu_type_get_their_own_deployments_nodes_and_prices(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    """Issue 41: one GPU type on two capacity classes of nodes, spot (at the chart's own lower
    price) and on-demand (no price of its own: the list price). Two replicas, autoscaling off: the
    cheaper spot's one (its maxReplicas) first, on-demand's one next; a Deployment per class, named
    for it, whose pod selects and lands on that class's node; the cost at each class's price."""
    ns, name = kvpilot.watch_namespaces[0], "spot-pool"
    prices = {"spot": SPOT_L40S_PRICE, "on-demand": LIST_PRICE_PER_GPU_HOUR["L40S"]}
    with _own_gpu_nodes(k8s, "class", CLASS_FLEET, CLASS_NODE_LABELS):
        spec = _spec("llama-3-8b", replicas=2, accelerator={"variants": CLASS_POOL}, autoscaling={"mode": "off"})
        apply_isvc(name, spec)
        obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=2 * CONVERGE_S)
        rows = obj["status"]["variants"]
        assert [(r["gpu"], r.get("capacityClass"), r["replicas"]) for r in rows] == [
            ("L40S", "spot", 1),
            ("L40S", "on-demand", 1),
        ]
        assert [r["deployment"] for r in rows] == [f"{name}-l40s-spot", f"{name}-l40s-on-demand"]
        assert [r["pricePerGpuHour"] for r in rows] == [prices["spot"], prices["on-demand"]]
        cost = sum(r["replicas"] * r["gpuCount"] * prices[r["capacityClass"]] for r in rows)
        assert obj["status"]["costPerHour"] == pytest.approx(cost, abs=0.01)
        assert (obj["status"]["replicas"], obj["status"]["readyReplicas"]) == (2, 2)
        running = kvis.running_pods(k8s, ns, name)
        for row in rows:
            klass = row["capacityClass"]
            deployment = k8s.kubectl_json("get", "deployment", row["deployment"], "-n", ns)
            assert deployment["spec"]["replicas"] == 1
            # The selector itself, not only where the pod went: the scheduler could pick the right node by chance.
            assert deployment["spec"]["template"]["spec"]["nodeSelector"][CAPACITY_LABEL] == klass
            (pod,) = [
                p for p in running if p["metadata"]["labels"].get(names.VARIANT_LABEL) == names.variant("L40S", klass)
            ]
            node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
            assert node["metadata"]["labels"][CAPACITY_LABEL] == klass
        # Events name the variant with its class: both are L40S, and only the class tells them apart.
        said = " | ".join(e["message"] for e in kvis.events(k8s, ns, name) if e.get("reason") == "VariantScaled")
        assert f"{name}-l40s-spot: 0 -> 1 replicas: L40S@spot is type 1 of 2" in said, said
        assert f"{name}-l40s-on-demand: 0 -> 1 replicas: L40S@on-demand is type 2 of 2" in said, said


def test_lifecycle_generation_repair_restart_and_garbage_collection(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "llama-2-7b-a10g"
    apply_isvc(name, _spec("llama-2-7b", "A10G", context=4096))
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S, generation=1)
    deployment_uid = k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["uid"]

    # A spec change is a new generation; the operator re-plans, rolls the Deployment in place and
    # reports the generation it acted on.
    kvis.patch_spec(k8s, ns, name, {"serving": {"maxContextLength": 2048}})
    assert kvis.get(k8s, ns, name)["metadata"]["generation"] == 2
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S, generation=2)
    assert {c["observedGeneration"] for c in obj["status"]["conditions"]} == {2}
    assert obj["status"]["plan"]["maxModelLen"] == 2048
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    assert deployment["metadata"]["uid"] == deployment_uid
    assert deployment["metadata"]["generation"] == 2 and _arg(deployment, "--max-model-len") == "2048"
    k8s.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=60s", timeout=70)

    # Children deleted by hand come back (the events of their deletion reconcile the owner).
    for kind in ("deployment", "service", "poddisruptionbudget"):
        k8s.kubectl("delete", kind, name, "-n", ns)
    deleted = time.monotonic()
    poll(
        lambda: (
            {o["kind"] for o in kvis.children(k8s, ns, name, "deployments,services,poddisruptionbudgets")}
            == {"Deployment", "Service", "PodDisruptionBudget"}
        ),
        CONVERGE_S,
        "children recreated",
    )
    print(f"children back {time.monotonic() - deleted:.1f} s after their deletion")
    # Ready follows the new Deployment's pods by its events, within seconds: no resync period
    # (it was 15 s) stands between the rollout completing and the status saying so.
    k8s.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=60s", timeout=70)
    rolled_out = time.monotonic()
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=READY_FOLLOWS_S)
    print(f"Ready=True {time.monotonic() - rolled_out:.1f} s after the rollout completed")

    # A restarted operator resumes on what exists and creates nothing new, not even a rollout.
    before = _uids(k8s, ns, name)
    generation = k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["generation"]
    restarted = operator.restart()
    poll(
        lambda: f"[{ns}/{name}] Resuming is processed" in restarted.log.read_text(),
        CONVERGE_S,
        "the restarted operator resumed the InferenceService",
    )
    assert _uids(k8s, ns, name) == before
    assert k8s.kubectl_json("get", "deployment", name, "-n", ns)["metadata"]["generation"] == generation
    assert kvis.condition(kvis.get(k8s, ns, name), "Ready")["status"] == "True"

    # Deleting the InferenceService garbage-collects every child (kube-controller-manager's GC).
    k8s.kubectl("delete", "inferenceservice", name, "-n", ns, "--timeout=60s", timeout=70)
    poll(lambda: kvis.children(k8s, ns, name) == [], CONVERGE_S, f"children of {name} garbage-collected")


def _rolled_out(k8s: Cluster, apply_isvc: ApplyISVC, ns: str, name: str, gpu: str) -> None:
    """A one-replica llama-2-7b service on `gpu`, Ready and its rollout complete."""
    apply_isvc(name, _spec("llama-2-7b", gpu))
    kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    k8s.kubectl("rollout", "status", f"deployment/{name}", "-n", ns, "--timeout=60s", timeout=70)


def test_a_spec_that_stops_planning_keeps_the_last_good_deployment_with_the_numbers(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "too-big"
    _rolled_out(k8s, apply_isvc, ns, name, "L4")
    running = k8s.kubectl_json("get", "deployment", name, "-n", ns)

    def unchanged() -> None:
        deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
        assert deployment["metadata"]["uid"] == running["metadata"]["uid"]
        assert deployment["metadata"]["generation"] == running["metadata"]["generation"]
        assert _engine(deployment)["args"] == _engine(running)["args"]
        assert len(kvis.running_pods(k8s, ns, name)) == 1

    # Now 70B on one L4 (24 GiB marketed, 22.0 GiB reported): even INT4 weights do not fit.
    kvis.patch_spec(k8s, ns, name, {"model": {"name": "llama-2-70b"}})
    obj = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S, generation=2)
    planned = kvis.condition(obj, "Planned")
    assert planned["reason"] == "WeightsDoNotFit", planned
    numbers = re.findall(r"\d+(?:\.\d+)? GiB", planned["message"])
    assert len(numbers) >= 2, planned["message"]  # the weights and the GPU memory, at least
    assert "22.0 GiB L4 reports" in planned["message"], planned["message"]
    assert obj["status"]["plan"]["fits"] is False
    # The engines of the last good plan keep serving, untouched.
    unchanged()
    assert kvis.condition(obj, "Ready")["status"] == "True"
    assert kvis.condition(obj, "Degraded")["reason"] == "WeightsDoNotFit"

    # A GPU type that does not exist: the same.
    kvis.patch_spec(k8s, ns, name, {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "L5"}})
    obj = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S, generation=3)
    assert kvis.condition(obj, "Planned")["reason"] == "UnknownGPU"
    unchanged()

    # A spec that never planned has no Deployment.
    never = "too-big-from-the-start"
    apply_isvc(never, _spec("llama-2-70b", "L4"))
    obj = kvis.wait_condition(k8s, ns, never, "Ready", "False", timeout_s=CONVERGE_S)
    assert kvis.condition(obj, "Ready")["reason"] == "WeightsDoNotFit"
    assert kvis.children(k8s, ns, never, "deployments,pods") == []


def test_a_same_named_object_of_someone_else_is_never_adopted(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "db"
    k8s.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"app": "postgres"}, "ports": [{"port": 5432}]},
        }
    )
    theirs = k8s.kubectl_json("get", "service", name, "-n", ns)
    apply_isvc(name, _spec("llama-2-7b", "A10G"))
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "False", timeout_s=CONVERGE_S)
    ready = kvis.condition(obj, "Ready")
    assert ready["reason"] == "NameConflict", ready
    assert f"Service {ns}/{name} exists and is controlled by no controller" in ready["message"]

    def untouched() -> None:
        service = k8s.kubectl_json("get", "service", name, "-n", ns)
        assert service["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
        assert service["spec"] == theirs["spec"]
        assert "ownerReferences" not in service["metadata"]

    untouched()
    assert kvis.children(k8s, ns, name, "deployments,poddisruptionbudgets") == []
    # Deleting the InferenceService leaves it in place.
    k8s.kubectl("delete", "inferenceservice", name, "-n", ns, "--timeout=60s", timeout=70)
    time.sleep(3)  # time for the garbage collector to act, were there anything to collect
    untouched()
    k8s.kubectl("delete", "service", name, "-n", ns)


def test_a_write_the_api_server_refuses_is_in_the_status(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns = kvpilot.watch_namespaces[0]
    # The CRD takes any string in both places; the Deployment's schema does not. The API server
    # answers the quantity with a 500 (it cannot convert the applied object), the label with a 422.
    cases = {
        "bad-quantity": ({"resources": {"requests": {"cpu": "lots"}}}, "quantities must match the regular expression"),
        "bad-node-label": (
            {"nodeSelector": {"pool": "not a label!"}},
            'spec.template.spec.nodeSelector: Invalid value: "not a label!"',
        ),
    }
    for name, (extra, _) in cases.items():
        apply_isvc(name, _spec("llama-2-7b", "A10G", **extra))
    for name, (_, words) in cases.items():
        poll(
            lambda name=name: kvis.condition(kvis.get(k8s, ns, name), "Ready").get("reason") == "ApplyFailed",
            CONVERGE_S,
            f"{name}: ApplyFailed",
        )
        ready = kvis.condition(kvis.get(k8s, ns, name), "Ready")
        assert ready["status"] == "False"
        assert ready["message"].startswith(f"the API server refused Deployment {ns}/{name}: "), ready
        assert words in ready["message"], ready["message"]
        assert kvis.children(k8s, ns, name, "deployments") == []


def test_deleting_an_inference_service_does_not_wait_for_the_operator(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "orphan-free"
    apply_isvc(name, _spec("llama-2-7b", "A10G"))
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    assert not obj["metadata"].get("finalizers"), obj["metadata"]
    operator.stop()
    try:
        started = time.monotonic()
        k8s.kubectl("delete", "inferenceservice", name, "-n", ns, "--timeout=20s", timeout=30)
        print(f"kubectl delete returned in {time.monotonic() - started:.1f} s with the operator stopped")
        assert k8s.kubectl("get", "inferenceservice", name, "-n", ns, check=False).returncode != 0
        poll(lambda: kvis.children(k8s, ns, name) == [], CONVERGE_S, f"children of {name} garbage-collected")
    finally:
        operator.start()


OPERATOR_KINDS = {"deployments", "services", "poddisruptionbudgets", "inferenceservices"}
# The operator never deletes (its role cannot): DELETEs of these kinds are the garbage collector's.
WRITES = {"POST", "PUT", "PATCH", "APPLY"}


def _metrics(k8s: Cluster) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in k8s.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest.split("}")[0]))
        samples.append((name, labels, float(line.rsplit(" ", 1)[1])))
    return samples


def _requests(k8s: Cluster, verbs: set[str]) -> int:
    """Requests with `verbs` to the operator's kinds so far, from the API server's metrics: the
    objects themselves and the InferenceServices' status (kube-controller-manager writes the
    other kinds' status only)."""
    return int(
        sum(
            value
            for name, labels, value in _metrics(k8s)
            if name == "apiserver_request_total"
            and labels.get("resource") in OPERATOR_KINDS
            and labels.get("verb") in verbs
            and (
                not labels.get("subresource")
                or (labels["resource"], labels["subresource"]) == ("inferenceservices", "status")
            )
        )
    )


def _service_account_requests(k8s: Cluster) -> int:
    """Every request of a service account outside kube-system so far: here, only the operator's
    (API priority and fairness sorts them into the `service-accounts` flow schema)."""
    return int(
        sum(
            value
            for name, labels, value in _metrics(k8s)
            if name == "apiserver_flowcontrol_dispatched_requests_total"
            and labels.get("flow_schema") == "service-accounts"
        )
    )


def test_an_idle_inference_service_costs_no_writes(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "idle"
    _rolled_out(k8s, apply_isvc, ns, name, "A10G")

    def quiet() -> bool:
        # The children of earlier tests' InferenceServices are garbage-collected by now.
        rest = k8s.kubectl_json(
            "get",
            "deployments,services,poddisruptionbudgets",
            "-n",
            ns,
            "-l",
            "app.kubernetes.io/managed-by=kvpilot-operator",
        )["items"]
        return {o["metadata"]["labels"]["app.kubernetes.io/instance"] for o in rest} == {name}

    poll(quiet, CONVERGE_S, "only the idle InferenceService's children left")
    # The SLO autoscaler records its first decision once, within a period of the service appearing.
    poll(
        lambda: "autoscaler" in k8s.kubectl_json("get", "inferenceservice", name, "-n", ns).get("status", {}),
        CONVERGE_S,
        "the autoscaler's first decision in the status",
    )
    time.sleep(5)  # the last events of the rollout
    writes, reads = _requests(k8s, WRITES), _requests(k8s, {"GET", "LIST"})
    operator_requests = _service_account_requests(k8s)
    assert operator_requests > 0  # the metric does see the operator
    time.sleep(30)  # two periods of the resync timer this operator no longer has
    print(
        f"idle 30 s: {_requests(k8s, WRITES) - writes} writes and "
        f"{_requests(k8s, {'GET', 'LIST'}) - reads} reads of the operator's kinds; "
        f"{_service_account_requests(k8s) - operator_requests} requests of the operator in all"
    )
    assert _requests(k8s, WRITES) == writes
    # At most kopf's own upkeep (its peering record's keep-alive, a watch the API server ended).
    assert _service_account_requests(k8s) - operator_requests <= 3


def test_pod_settings_reach_the_pods_through_the_api_server(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "passthrough"
    env = [
        {"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm", "key": "api-key", "optional": True}}}
    ]
    apply_isvc(
        name,
        _spec(
            "llama-2-7b",
            "A10G",
            env=env,
            imagePullSecrets=[{"name": "registry"}],
            podLabels={"team": "ml"},
            podAnnotations={"owner": "ml"},
            rollout={"maxSurge": 0, "maxUnavailable": 1},
            topologySpreadConstraints=[
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"team": "ml"}},
                }
            ],
        ),
    )
    obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    assert kvis.condition(obj, "Ready")["reason"] == "ReplicasReady"
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert env[0] in container["env"] and {"name": "HOME", "value": "/tmp"} in container["env"]
    assert template["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert template["metadata"]["labels"]["team"] == "ml" and template["metadata"]["annotations"]["owner"] == "ml"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": render.PRESTOP_SLEEP_S}}
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    # `kubectl get kvis` shows the Ready condition's reason.
    table = k8s.kubectl("get", "inferenceservice", name, "-n", ns).stdout
    assert "ReplicasReady" in table and "STATUS" in table


def test_a_pod_no_node_can_take_makes_ready_say_unschedulable(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "nowhere"
    apply_isvc(name, _spec("llama-2-7b", "A10G", nodeSelector={"pool": "does-not-exist"}))

    # The scheduler marks the pod Unschedulable; the pod's event reconciles its InferenceService.
    def unschedulable() -> dict[str, Any] | None:
        found = kvis.get(k8s, ns, name)
        return found if kvis.condition(found, "Ready").get("reason") == "Unschedulable" else None

    obj = poll(unschedulable, CONVERGE_S, f"{name} Ready reason Unschedulable")
    ready = kvis.condition(obj, "Ready")
    assert ready["status"] == "False" and "0/1 replicas ready" in ready["message"] and "node" in ready["message"]


def test_the_operator_serves_its_own_metrics_per_service(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC
) -> None:
    """`kvpilot operator --metrics` (the chart's metrics port): the plan's predictions beside the
    SLO and the replicas, per InferenceService, read from what the operator watches."""
    ns, name = kvpilot.watch_namespaces[0], "measured"
    _rolled_out(k8s, apply_isvc, ns, name, "A10G")
    obj = kvis.get(k8s, ns, name)

    def samples() -> dict[str, float] | None:
        with httpx.Client(trust_env=False, timeout=10) as http:
            text = http.get(operator.metrics_url).text
        found = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("namespace") == ns and s.labels.get("service") == name
        }
        return found if "kvpilot_operator_ready_replicas" in found else None

    found = poll(samples, CONVERGE_S, f"{ns}/{name} in the operator's /metrics")
    assert found["kvpilot_operator_predicted_ttft_p95_seconds"] == obj["status"]["plan"]["predictedTtftMs"] / 1000
    assert found["kvpilot_operator_slo_ttft_p95_seconds"] == obj["spec"]["slo"]["ttftP95Ms"] / 1000
    assert found["kvpilot_operator_desired_replicas"] == obj["status"]["desiredReplicas"] == 1
