"""The autoscaler's loop over a mixed pool, through the operator's own kopf index functions
(operator/process.py): a pool's Deployments are named after their GPU types, so the loop finds them
only where they are keyed by their InferenceService. Found by the gateway's e2e (the gateway keyed
them by name, and so did the operator: a mixed pool had no autoscaler period at all)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from kvpilot.operator import process
from kvpilot.operator.api.names import INSTANCE_LABEL, VARIANT_LABEL, variant
from kvpilot.operator.autoscaling.loop import AutoscalingLoop
from tests.operator.autoscaling.test_gateway_queue import PERIOD, Cluster, idle_engine, serving

META = {"namespace": "team", "resourceVersion": "1"}
POOL = (("L4", 4), ("H100-80GB", 16))  # (GPU type, its plan's max_num_seqs)


def pool_objects(ips: dict[str, str]) -> list[dict[str, Any]]:
    """An InferenceService over two GPU types, each type's Deployment (`chat-<type>`), ReplicaSet
    and one ready pod at its IP in `ips`."""
    service = {
        "kind": "InferenceService",
        "metadata": {"name": "chat", "uid": "uid-chat", **META},
        "spec": {"model": {"name": "SmolLM2"}, "replicas": 2, "autoscaling": {"maxReplicas": 8}},
        "status": {
            "plan": {"maxNumSeqs": POOL[0][1]},
            "variants": [{"gpu": gpu, "maxNumSeqs": seqs, "replicas": 1, "capacityRps": 1.0} for gpu, seqs in POOL],
        },
    }
    objects: list[dict[str, Any]] = [service]
    for gpu, _ in POOL:
        name, labels = f"chat-{variant(gpu)}", {INSTANCE_LABEL: "chat", VARIANT_LABEL: variant(gpu)}
        owner = {"ownerReferences": [{"controller": True, "uid": f"dep-{name}"}]}
        objects += [
            {
                "kind": "Deployment",
                "metadata": {"name": name, "uid": f"dep-{name}", "labels": labels, **META}
                | {"ownerReferences": [{"controller": True, "uid": "uid-chat"}]},
                "spec": {"replicas": 1},
                "status": {"readyReplicas": 1},
            },
            {
                "kind": "ReplicaSet",
                "metadata": {"name": f"{name}-5d8f", "uid": f"rs-{name}", "labels": labels, **META, **owner},
            },
            {
                "kind": "Pod",
                "metadata": {"name": f"{name}-p0", "labels": labels, **META}
                | {"ownerReferences": [{"controller": True, "uid": f"rs-{name}"}]},
                "status": {"podIP": ips[gpu], "conditions": [{"type": "Ready", "status": "True"}]},
            },
        ]
    return objects


def operator_indexes(objects: list[dict[str, Any]]) -> tuple[dict[Any, list[Any]], ...]:
    """The four indexes as kopf builds them from the operator's own index functions."""
    functions = {
        "InferenceService": process.autoscaled_services,
        "Deployment": process.engine_deployments,
        "ReplicaSet": process.engine_replicasets,
        "Pod": process.engine_pods,
    }
    indexes: dict[str, dict[Any, list[Any]]] = {kind: {} for kind in functions}
    for obj in objects:
        for key, value in functions[obj["kind"]](body=obj).items():
            indexes[obj["kind"]].setdefault(key, []).append(value)
    return tuple(indexes[kind] for kind in functions)


class Recording(Cluster):
    """Keeps the status patches the loop writes."""

    def __init__(self) -> None:
        super().__init__()
        self.patches: list[Any] = []

    def patch_status(self, *args: Any, **kwargs: Any) -> str:
        self.patches.append(args[4])
        return "2"


@asynccontextmanager
async def engines() -> AsyncIterator[dict[str, str]]:
    async with AsyncExitStack() as stack:
        yield {gpu: await stack.enter_async_context(serving(idle_engine())) for gpu, _ in POOL}


def test_the_loop_finds_a_mixed_pool_s_deployments_and_reads_every_type_s_pods() -> None:
    async def main() -> tuple[Any, Recording]:
        async with engines() as ips:
            services, deployments, replicasets, pods = operator_indexes(pool_objects(ips))
            cluster = Recording()
            loop = AutoscalingLoop(cluster, services, deployments, replicasets, pods, interval=PERIOD)  # type: ignore[arg-type]
            try:
                (body,) = services[("team", "chat")]
                key = ("team", "chat")
                decision = await loop.one(body, deployments[key], replicasets[key], pods[key], now=2_000_000.0)
            finally:
                await loop.close()
        return decision, cluster

    decision, cluster = asyncio.run(main())
    # Both types' Deployments under the service's key, read as one pool of 2 replicas, both pods read.
    assert decision is not None and decision.previous == 2
    assert decision.signals.reporting == 2 and decision.signals.unknown == ()
    (patch,) = cluster.patches
    assert sorted(patch["autoscaler"]["state"]["baselines"]) == ["chat-h100-80gb-p0", "chat-l4-p0"]
