"""Every manifest in examples/ (the ones the docs use), applied as a user would (`kubectl apply -f`)
to the real API server with the chart's operator running: each is accepted, plans and becomes
Ready, with the Deployments its plan says, and goes away when deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll

EXAMPLES = sorted(kvis.EXAMPLES_DIR.glob("*.yaml"))
# Pods through the scheduler and kwok, up to four of them in two Deployments.
READY_S = 120.0


def test_the_examples_are_the_ones_the_docs_show() -> None:
    assert {p.name for p in EXAMPLES} >= {"smollm2-135m.yaml", "mixed-pool.yaml", "llama-3-8b-vllm.yaml"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_an_example_applied_as_it_is_becomes_ready(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, example: Path
) -> None:
    ns = kvpilot.watch_namespaces[0]
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    k8s.kubectl("apply", "-n", ns, "-f", str(example))
    try:
        obj = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=READY_S)
        status = obj["status"]
        assert status["plan"]["fits"], status["plan"]["reason"]
        wanted = [row["deployment"] for row in status.get("variants", []) if row["replicas"]] or [name]
        for deployment in wanted:
            made = k8s.kubectl_json("get", "deployment", deployment, "-n", ns)
            assert made["status"].get("readyReplicas") == made["spec"]["replicas"] > 0
        assert status["readyReplicas"] == status["replicas"] == status["desiredReplicas"]
    finally:
        k8s.kubectl("delete", "-n", ns, "-f", str(example), "--wait=true", timeout=READY_S)
    # The owner reference takes the pods with it: the next example finds the GPUs free.
    poll(lambda: not kvis.children(k8s, ns, name, "pods") or None, READY_S, f"{name}'s pods gone")
