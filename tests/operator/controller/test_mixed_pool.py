"""A mixed GPU pool through the reconcile: a Deployment per GPU type, the service's replicas shared
cheapest per request per second first, the status per type, and a type dropped scaled to zero."""

from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.names import INSTANCE_LABEL, VARIANT_LABEL
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import status_of
from kvpilot.operator.controller.reconcile import FULL_RETRY_SECONDS, full_retry_in, reconcile
from kvpilot.operator.kube.indexes import children, pooled
from kvpilot.operator.planning.gpus import LIST_PRICE_PER_GPU_HOUR
from tests.operator.controller.test_reconcile import NOW, FakeCluster, apply_merge_patch, body

VARIANTS = [{"type": "L4", "maxReplicas": 2, "count": 1}, {"type": "H100-80GB"}]
SPEC = {
    "model": {"name": "llama-3-8b"},
    "runtime": "vllm",
    "accelerator": {"variants": VARIANTS},
    "load": {"requestsPerSecond": 8},
}
CHEAP_L4 = {"L4": 0.15}


def run(
    cluster: FakeCluster,
    spec: dict[str, Any],
    prices: dict[str, float] | None = None,
    classes: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """One reconcile of `chat` with `spec`, its status written back as the API server would."""
    old = cluster.objects.get(("InferenceService", "ml", "chat"), {}).get("status") or {}
    service = cluster.put(body(spec, status=old))
    status = reconcile(service, cluster, NOW, gpu_prices=prices, capacity_classes=classes)
    cluster.objects[("InferenceService", "ml", "chat")]["status"] = apply_merge_patch(old, status)
    return status


def deployments(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {name: obj for (kind, _, name), obj in cluster.objects.items() if kind == "Deployment"}


def service_uid(cluster: FakeCluster) -> str:
    return cluster.objects[("InferenceService", "ml", "chat")]["metadata"]["uid"]


def replicas(cluster: FakeCluster) -> dict[str, int]:
    return {name: d["spec"]["replicas"] for name, d in deployments(cluster).items()}


def test_a_deployment_per_gpu_type_each_from_its_own_plan() -> None:
    cluster = FakeCluster()
    status = run(cluster, SPEC, CHEAP_L4)
    made = deployments(cluster)
    assert set(made) == {"chat-l4", "chat-h100-80gb"}
    l4, h100 = made["chat-l4"], made["chat-h100-80gb"]
    for deployment, variant, product in ((l4, "l4", "NVIDIA-L4"), (h100, "h100-80gb", "NVIDIA-H100-80GB-HBM3")):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector[VARIANT_LABEL] == variant and selector[INSTANCE_LABEL] == "chat"
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"][VARIANT_LABEL] == variant
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == product
        # Owned by the service itself, by name and uid: a reference naming the Deployment is
        # dangling to the garbage collector, which deleted such Deployments in the e2e.
        (owner,) = deployment["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("InferenceService", "chat", service_uid(cluster))
    # Each runs its own plan: the L4's one GPU per replica, the H100's own KV pool and batch.
    args = {name: d["spec"]["template"]["spec"]["containers"][0]["args"] for name, d in made.items()}
    assert "--tensor-parallel-size=1" in args["chat-l4"]
    assert {a for a in args["chat-l4"] if a.startswith("--max-num-seqs")} != {
        a for a in args["chat-h100-80gb"] if a.startswith("--max-num-seqs")
    }
    # The Service spans both types' pods.
    service = cluster.objects[("Service", "ml", "chat")]
    assert VARIANT_LABEL not in service["spec"]["selector"]
    # The status: each type with its plan, replicas and cost; the pool's first type as status.plan.
    rows = {row["gpu"]: row for row in status["variants"]}
    assert [row["gpu"] for row in status["variants"]] == ["L4", "H100-80GB"]  # cheapest per req/s first
    assert rows["L4"]["deployment"] == "chat-l4" and rows["L4"]["maxReplicas"] == 2
    assert rows["L4"]["replicas"] == replicas(cluster)["chat-l4"]
    assert rows["L4"]["costPerHour"] == pytest.approx(rows["L4"]["replicas"] * 0.15)
    assert rows["H100-80GB"]["capacityRps"] > rows["L4"]["capacityRps"] > 0
    assert status["plan"]["gpu"] == "L4" and "variants" in status["plan"]["reasons"]
    assert status["desiredReplicas"] == sum(replicas(cluster).values())


def test_the_service_s_replicas_fill_the_cheapest_type_first_and_leave_the_dearest_first() -> None:
    cluster = FakeCluster()
    seen = []
    for total in (1, 2, 3, 4, 3, 1):  # up to autoscaling.maxReplicas 4, which bounds the service's total
        run(cluster, {**SPEC, "replicas": total}, CHEAP_L4)
        seen.append((replicas(cluster)["chat-l4"], replicas(cluster)["chat-h100-80gb"]))
    # Up: the L4s to their maxReplicas 2, then H100s; down: the H100s go first.
    assert seen == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 1), (1, 0)]


def test_each_type_s_change_is_an_event_naming_the_type_and_why() -> None:
    cluster = FakeCluster()
    run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    made = [e["message"] for e in cluster.events]
    assert all(e["reason"] == "VariantScaled" and e["involvedObject"]["name"] == "chat" for e in cluster.events)
    assert made[0].startswith("chat-h100-80gb: 0 -> 1 replicas: H100-80GB is type 2 of 2 by cost per req/s")
    assert made[1].startswith("chat-l4: 0 -> 2 replicas: L4 is type 1 of 2 by cost per req/s ($")
    assert "cheapest with room take the load first (at most 2" in made[1]
    run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    assert len(cluster.events) == 2  # nothing changed, nothing said
    run(cluster, {**SPEC, "replicas": 2}, CHEAP_L4)
    assert cluster.events[-1]["message"].startswith("chat-h100-80gb: 1 -> 0 replicas")
    assert "fewer replicas wanted, the dearest go first" in cluster.events[-1]["message"]
    run(cluster, {**SPEC, "accelerator": {"variants": VARIANTS[1:]}, "replicas": 2}, CHEAP_L4)
    said = {e["message"].split(":")[0]: e["message"] for e in cluster.events[-2:]}
    assert "no longer in spec.accelerator.variants" in said["chat-l4"]


def test_prices_decide_which_type_fills_first() -> None:
    cluster = FakeCluster()
    run(cluster, {**SPEC, "replicas": 1}, {"L4": 2.0})  # an H100's req/s is the cheaper
    assert replicas(cluster) == {"chat-l4": 0, "chat-h100-80gb": 1}
    run(cluster, {**SPEC, "replicas": 1}, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 1, "chat-h100-80gb": 0}


def test_a_type_dropped_from_the_pool_is_scaled_to_zero_and_a_pool_of_a_single_service_too() -> None:
    cluster = FakeCluster()
    single = {**SPEC, "accelerator": {"type": "H100-80GB"}, "replicas": 2}
    run(cluster, single)
    assert replicas(cluster) == {"chat": 2}
    # The service becomes a pool: its one Deployment goes to zero, the pool's come up.
    run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    assert replicas(cluster) == {"chat": 0, "chat-l4": 2, "chat-h100-80gb": 1}
    # The H100s leave the pool: theirs go to zero, the L4s take the replicas up to their maximum.
    status = run(cluster, {**SPEC, "accelerator": {"variants": VARIANTS[:1]}, "replicas": 2}, CHEAP_L4)
    assert replicas(cluster) == {"chat": 0, "chat-l4": 2, "chat-h100-80gb": 0}
    assert [row["gpu"] for row in status["variants"]] == ["L4"]
    # A pool that no longer plans keeps what runs.
    run(cluster, {**SPEC, "accelerator": {"variants": [{"type": "T4", "count": 1}]}, "model": {"name": "llama-3-70b"}})
    assert replicas(cluster) == {"chat": 0, "chat-l4": 2, "chat-h100-80gb": 0}


def test_a_type_dropped_while_the_spec_was_invalid_is_still_scaled_to_zero() -> None:
    cluster = FakeCluster()
    run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 2, "chat-h100-80gb": 1}
    invalid = run(cluster, {**SPEC, "replicas": 3, "slo": {"ttftP95Ms": -1}}, CHEAP_L4)
    assert {c["type"]: c["reason"] for c in invalid["conditions"]}["Planned"] == "InvalidSpec"
    assert [row["gpu"] for row in invalid["variants"]] == ["L4", "H100-80GB"]  # what runs, unchanged
    run(cluster, {**SPEC, "accelerator": {"variants": VARIANTS[:1]}, "replicas": 2}, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 2, "chat-h100-80gb": 0}


def test_the_autoscaler_reads_a_pool_s_deployments_as_one() -> None:
    cluster = FakeCluster()
    run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    made = list(deployments(cluster).values())
    for d, ready in zip(made, (2, 1), strict=True):
        d["status"] = {"observedGeneration": 1, "replicas": ready, "readyReplicas": ready, "updatedReplicas": ready}
        d["metadata"]["uid"] = f"uid-{d['metadata']['name']}"
    service = cluster.objects[("InferenceService", "ml", "chat")]
    one, pods = children(service, made, [], [])
    assert one is not None and pods == []
    assert (one["spec"]["replicas"], one["status"]["readyReplicas"], one["status"]["observedGeneration"]) == (3, 3, 1)
    made[0]["status"]["observedGeneration"] = 0  # one type's rollout not yet seen
    assert pooled(made)["status"]["observedGeneration"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("accelerator", "words"),
    [
        ({"type": "L4", "variants": VARIANTS}, "replaces type"),
        ({"count": 2, "variants": VARIANTS}, "replaces type"),
        ({"variants": [{"type": "L4"}, {"type": "L4", "maxReplicas": 2}]}, r"each \(type, capacityClass\) once"),
        (
            {"variants": [{"type": "L4", "capacityClass": "spot"}, {"type": "L4", "capacityClass": "spot"}]},
            r"each \(type, capacityClass\) once",
        ),
        ({"variants": [{"type": "L4", "capacityClass": "Spot!"}]}, "capacityClass"),
        ({"variants": [{"type": "cpu"}]}, "a GPU type"),
    ],
)
def test_variants_that_cannot_be_served_are_refused(accelerator: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        InferenceServiceSpec.model_validate({**SPEC, "accelerator": accelerator})


def put_pod(cluster: FakeCluster, name: str, variant: str, node: str | None = None) -> None:
    """A pod of `variant` running on `node`, or Pending with no node that can take it."""
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes"}
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "ml",
                "labels": {**names.selector_labels("chat"), VARIANT_LABEL: variant},
            },
            "spec": {"nodeName": node} if node else {},
            "status": {"phase": "Running"} if node else {"phase": "Pending", "conditions": [unschedulable]},
        }
    )


def test_replicas_a_full_gpu_type_cannot_place_go_to_the_next_type_until_it_is_tried_again() -> None:
    cluster = FakeCluster()
    spec = {**SPEC, "replicas": 3}
    run(cluster, spec, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 2, "chat-h100-80gb": 1}
    # The L4 nodes take one of the two: the other stays Pending.
    put_pod(cluster, "chat-l4-a", "l4", node="l4-node")
    put_pod(cluster, "chat-l4-x", "l4")
    status = run(cluster, spec, CHEAP_L4)
    (l4,) = [row for row in status["variants"] if row["gpu"] == "L4"]
    assert (l4["schedulableReplicas"], l4["fullSince"]) == (1, "2025-01-01T00:00:00Z")
    # Nothing watched changes when the type's GPUs free up: the reconcile comes back by itself.
    assert full_retry_in(status_of({"status": status}), NOW) == FULL_RETRY_SECONDS
    assert full_retry_in(status_of({"status": status}), NOW + timedelta(seconds=FULL_RETRY_SECONDS - 30)) == 30
    del cluster.objects[("Pod", "ml", "chat-l4-x")]  # the scale-down removes the pending pod first
    run(cluster, spec, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 1, "chat-h100-80gb": 2}  # at once, not after a wait
    # While the type is held full, scale-ups go past it; after FULL_RETRY_SECONDS it is tried again.
    run(cluster, {**spec, "replicas": 4}, CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 1, "chat-h100-80gb": 3}
    later = cluster.put(
        body({**spec, "replicas": 4}, status=cluster.objects[("InferenceService", "ml", "chat")]["status"])
    )
    retried = reconcile(later, cluster, NOW + timedelta(seconds=FULL_RETRY_SECONDS), gpu_prices=CHEAP_L4)
    assert replicas(cluster) == {"chat-l4": 2, "chat-h100-80gb": 2}
    assert all("schedulableReplicas" not in row for row in retried["variants"])


# The operator's capacity classes (--capacity-class, the chart's capacityClasses) and prices.
CLASSES = {"spot": {"karpenter.sh/capacity-type": "spot"}, "on-demand": {"karpenter.sh/capacity-type": "on-demand"}}
CLASS_PRICES = {"L4": 0.2, "L4@spot": 0.1}
SPOT_POOL = [
    {"type": "L4", "capacityClass": "spot", "maxReplicas": 2, "count": 1},
    {"type": "L4", "capacityClass": "on-demand", "count": 1},
    {"type": "H100-80GB"},
]


def test_spot_and_on_demand_of_one_type_are_deployments_of_their_own() -> None:
    cluster = FakeCluster()
    status = run(cluster, {**SPEC, "accelerator": {"variants": SPOT_POOL}, "replicas": 3}, CLASS_PRICES, CLASSES)
    made = deployments(cluster)
    # A variant without a class keeps the name it always had: no rollout when the operator is upgraded.
    assert set(made) == {"chat-l4-spot", "chat-l4-on-demand", "chat-h100-80gb"}
    for name, label, capacity in (
        ("chat-l4-spot", "l4-spot", "spot"),
        ("chat-l4-on-demand", "l4-on-demand", "on-demand"),
    ):
        deployment = made[name]
        assert deployment["metadata"]["labels"][VARIANT_LABEL] == label
        assert deployment["spec"]["selector"]["matchLabels"][VARIANT_LABEL] == label
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"][VARIANT_LABEL] == label
        # The class's node labels beside the GPU's own: only that class's L4 nodes take its pods.
        assert pod["spec"]["nodeSelector"] == {
            "nvidia.com/gpu.product": "NVIDIA-L4",
            "karpenter.sh/capacity-type": capacity,
        }
    assert "karpenter.sh/capacity-type" not in made["chat-h100-80gb"]["spec"]["template"]["spec"]["nodeSelector"]
    # The two L4 classes run the same engine settings.
    args = {name: d["spec"]["template"]["spec"]["containers"][0]["args"] for name, d in made.items()}
    assert args["chat-l4-spot"] == args["chat-l4-on-demand"]
    # Spot is the cheaper per req/s: it fills to its maxReplicas first, then on-demand.
    assert replicas(cluster) == {"chat-l4-spot": 2, "chat-l4-on-demand": 1, "chat-h100-80gb": 0}
    rows = {(row["gpu"], row.get("capacityClass")): row for row in status["variants"]}
    assert [(row["gpu"], row.get("capacityClass")) for row in status["variants"]][:2] == [
        ("L4", "spot"),
        ("L4", "on-demand"),
    ]
    spot, on_demand = rows["L4", "spot"], rows["L4", "on-demand"]
    # Each at its own class's price: spot's own, on-demand's the type's (the class states none).
    assert (spot["deployment"], spot["pricePerGpuHour"]) == ("chat-l4-spot", CLASS_PRICES["L4@spot"])
    assert (on_demand["deployment"], on_demand["pricePerGpuHour"]) == ("chat-l4-on-demand", CLASS_PRICES["L4"])
    assert spot["costPerHour"] == pytest.approx(2 * CLASS_PRICES["L4@spot"])
    assert on_demand["costPerHour"] == pytest.approx(CLASS_PRICES["L4"])
    assert "capacityClass" not in rows["H100-80GB", None]
    # The total: every variant's cost, summed.
    assert status["costPerHour"] == pytest.approx(sum(row["costPerHour"] for row in status["variants"]))
    assert status["costPerHour"] == pytest.approx(2 * CLASS_PRICES["L4@spot"] + CLASS_PRICES["L4"])
    # The Events name the class: its rank, price and bounds are its own.
    said = {e["message"].split(":")[0]: e["message"] for e in cluster.events}
    assert "L4@spot is type 1 of 3 by cost per req/s" in said["chat-l4-spot"] and "(at most 2" in said["chat-l4-spot"]
    assert "L4@on-demand is type 2 of 3" in said["chat-l4-on-demand"]


def test_a_full_spot_class_hands_its_replicas_to_on_demand() -> None:
    cluster = FakeCluster()
    spec = {**SPEC, "accelerator": {"variants": SPOT_POOL}, "replicas": 3}
    run(cluster, spec, CLASS_PRICES, CLASSES)
    # The spot nodes take one of the two: the other stays Pending. On-demand L4s are not full.
    put_pod(cluster, "chat-l4-spot-a", "l4-spot", node="spot-node")
    put_pod(cluster, "chat-l4-spot-x", "l4-spot")
    put_pod(cluster, "chat-l4-on-demand-a", "l4-on-demand", node="on-demand-node")
    status = run(cluster, spec, CLASS_PRICES, CLASSES)
    full = {(row["gpu"], row.get("capacityClass")): row.get("schedulableReplicas") for row in status["variants"]}
    assert full == {("L4", "spot"): 1, ("L4", "on-demand"): None, ("H100-80GB", None): None}
    del cluster.objects[("Pod", "ml", "chat-l4-spot-x")]
    run(cluster, spec, CLASS_PRICES, CLASSES)
    assert replicas(cluster) == {"chat-l4-spot": 1, "chat-l4-on-demand": 2, "chat-h100-80gb": 0}
    assert "no free L4@spot since" in cluster.events[-2]["message"] + cluster.events[-1]["message"]


def test_a_capacity_class_the_operator_does_not_know_is_not_ready_and_rolls_out_nothing() -> None:
    cluster = FakeCluster()
    pool = [{"type": "L4", "capacityClass": "spto"}, {"type": "H100-80GB"}]
    status = run(cluster, {**SPEC, "accelerator": {"variants": pool}}, CLASS_PRICES, CLASSES)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Planned"]["status"], conditions["Planned"]["reason"]) == ("False", "UnknownCapacityClass")
    assert conditions["Ready"]["status"] == "False"
    assert "spto" in conditions["Planned"]["message"] and "known: on-demand, spot" in conditions["Planned"]["message"]
    assert deployments(cluster) == {}
    # Once the operator knows the class, the pool rolls out.
    run(cluster, {**SPEC, "accelerator": {"variants": pool}}, CLASS_PRICES, {**CLASSES, "spto": {"pool": "x"}})
    assert set(deployments(cluster)) == {"chat-l4-spto", "chat-h100-80gb"}


def test_the_status_says_what_the_service_costs_an_hour() -> None:
    cluster = FakeCluster()
    # One GPU type: its replicas x GPUs per replica x its price per GPU-hour.
    single = run(cluster, {**SPEC, "accelerator": {"type": "H100-80GB", "count": 2}, "replicas": 3}, {"H100-80GB": 4})
    assert single["plan"]["gpuCount"] == 2
    assert single["costPerHour"] == pytest.approx(3 * 2 * 4)
    # Without a price of the operator's: the type's list price.
    listed = run(cluster, {**SPEC, "accelerator": {"type": "L4", "count": 1}, "replicas": 2})
    assert listed["costPerHour"] == pytest.approx(2 * LIST_PRICE_PER_GPU_HOUR["L4"], abs=0.01)
    # A mixed pool: its variants' costs summed, each at its desired replicas.
    pool = run(cluster, {**SPEC, "replicas": 3}, CHEAP_L4)
    assert pool["costPerHour"] == pytest.approx(sum(row["costPerHour"] for row in pool["variants"]))
    assert pool["costPerHour"] == pytest.approx(2 * 0.15 + LIST_PRICE_PER_GPU_HOUR["H100-80GB"], abs=0.01)


def test_a_variant_of_type_any_is_every_gpu_type_the_nodes_carry() -> None:
    """`type: *` (opted into: an unset accelerator still plans the one cheapest type) makes a variant
    of each catalog type on the nodes that no other variant names, with its bounds; types the nodes
    gain or lose are found when the reconcile comes back by itself."""
    cluster = FakeCluster(gpu_products=["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3", "some-unknown-gpu"])
    pool = {"variants": [{"type": "*", "maxReplicas": 3, "count": 1}, {"type": "H100-80GB", "maxReplicas": 1}]}
    status = run(cluster, {**SPEC, "accelerator": pool, "replicas": 2}, CHEAP_L4)
    rows = {row["gpu"]: row for row in status["variants"]}
    assert set(rows) == {"L4", "H100-80GB"} and set(deployments(cluster)) == {"chat-l4", "chat-h100-80gb"}
    # The named H100 keeps its own bound; the L4 has the * entry's.
    assert (rows["L4"]["maxReplicas"], rows["H100-80GB"]["maxReplicas"]) == (3, 1)
    assert replicas(cluster) == {"chat-l4": 2, "chat-h100-80gb": 0}
    # The L4 nodes go: their variant goes to zero, and the replicas to the type that is left.
    cluster.products = ["NVIDIA-H100-80GB-HBM3"]
    status = run(cluster, {**SPEC, "accelerator": pool, "replicas": 2}, CHEAP_L4)
    assert [row["gpu"] for row in status["variants"]] == ["H100-80GB"]
    assert replicas(cluster)["chat-l4"] == 0 and replicas(cluster)["chat-h100-80gb"] == 2
    # No GPU node at all, and no type named: nothing to plan, looked at again later.
    cluster.products = []
    status = run(cluster, {**SPEC, "accelerator": {"variants": [{"type": "*"}]}}, CHEAP_L4)
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "NoGPUType")
    assert "type * found no GPU type on the nodes" in planned["message"]
    # Such a pool comes back by itself to read the nodes again, though no type is full.
    assert full_retry_in(status_of({"status": status}), NOW, any_gpu=True) == FULL_RETRY_SECONDS
    assert full_retry_in(status_of({"status": status}), NOW) is None
