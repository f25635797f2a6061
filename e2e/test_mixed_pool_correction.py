"""Issue 41 on the real control plane: a mixed pool whose engines run far from their plans is
judged and corrected type by type (controller/correction.py, autoscaling/accuracy.py).

The pool of e2e/mixed_pool.py at its two replicas (one L4, one H100-80GB; autoscaling slo held at
2..2 so that only the correction moves the plans), an SLO that the CPU engines behind the pods meet,
and a sustained load through the gateway (SPIKE_RPS, capped at IN_FLIGHT in flight: the backlog
reaches the L4 pod, which the capacity weights give about an eighth of the requests, so both types
have windows of their own). CPU engines are ten to fifty times slower than either GPU type's plan,
and not by the same factor: the H100's plan predicts faster steps than the L4's for the same engine.

1. After accuracy.SUSTAIN_PERIODS judged periods outside the band, PlanAccurate is False
   (OutsideBand), its message giving each type's numbers.
2. status.correction holds factors per GPU type (byGpu) and none for the pool: each type's factors
   lie within the range of its own observed / predicted ratios (planAccuracy.variants, sampled
   while the load ran) and are well above 2; the H100's TPOT factor is well above the L4's (its
   plan predicts 1.9 ms steps where the L4's predicts 3 ms, for engines alike: one factor for both
   would leave one of them wrong). Measured: L4 TPOT ratios 36.7-39.6, H100 75.2-82.9.
3. Each corrected type's capacity per replica (status.variants) fell from its uncorrected plan's;
   the Deployments stayed at one replica each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.load import Load
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.mixed_pool import GPUS, MODEL, deployment_replicas, pool_spec, variant_rows
from e2e.pod_runner import PodRunner
from e2e.polling import Background, poll
from kvpilot.operator.api.conditions import PLAN_ACCURATE
from kvpilot.operator.autoscaling.accuracy import BAND, SUSTAIN_PERIODS

ApplyISVC = Callable[[str, dict[str, Any]], dict[str, Any]]
NAME = "mixed-corrected"
PROMPT = "Write one sentence about the sea."
MAX_TOKENS = 8
SPIKE_RPS = 30.0
IN_FLIGHT = 10
# The least the H100's TPOT factor exceeds the L4's by: their plans' steps are 1.58x apart, and the
# H100's pod, with the larger share, runs the fuller batches.
TYPES_APART = 1.3
# Met by the CPU engines at this load: no scaling pressure, the replicas held at two anyway.
SLO = {"ttftP95Ms": 20000, "tpotP95Ms": 5000}


@pytest.fixture()
def pool(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC, tmp_path: Path
) -> Iterator[tuple[str, PodRunner]]:
    """The pool at two replicas, Ready, both engines serving."""
    namespace = kvpilot.watch_namespaces[0]
    autoscaling = {"mode": "slo", "minReplicas": len(GPUS), "maxReplicas": len(GPUS)}
    apply_isvc(NAME, pool_spec(replicas=len(GPUS), slo=SLO, autoscaling=autoscaling))
    kvis.wait_condition(k8s, namespace, NAME, "Ready", "True", timeout_s=120)
    with PodRunner(k8s, namespace, NAME, tmp_path) as runner:
        poll(lambda: len(runner.serving()) == len(GPUS) or None, 240, f"the engines of {NAME}", interval_s=1.0)
        yield namespace, runner
        assert not runner.errors, runner.snapshot()


class Ratios(Background):
    """Twice a second: each type's observed / predicted p95 ratios in planAccuracy.variants."""

    def __init__(self, k8s: Cluster, namespace: str) -> None:
        super().__init__("mixed-ratios")
        self.k8s, self.namespace = k8s, namespace
        self.seen: dict[str, dict[str, set[float]]] = {gpu: {"ttft": set(), "tpot": set()} for gpu in GPUS}

    def loop(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                status = kvis.get(self.k8s, self.namespace, NAME).get("status", {})
            except Exception:  # noqa: BLE001 - a slow kubectl read skips one sample
                continue
            for entry in status.get("planAccuracy", {}).get("variants") or []:
                for signal, found in self.seen.get(entry["gpu"], {}).items():
                    if ratio := (entry.get(signal) or {}).get("ratio"):
                        found.add(ratio)


def corrected(k8s: Cluster, namespace: str) -> dict[str, Any] | None:
    """The status once PlanAccurate is False and status.correction holds both types' factors."""
    status: dict[str, Any] = kvis.get(k8s, namespace, NAME).get("status", {})
    accurate = kvis.condition({"status": status}, PLAN_ACCURATE)
    rows = (status.get("correction") or {}).get("byGpu") or []
    return status if accurate.get("status") == "False" and {r["gpu"] for r in rows} == set(GPUS) else None


def test_a_pool_far_from_its_plans_is_corrected_type_by_type(
    k8s: Cluster, gateway: LocalGateway, pool: tuple[str, PodRunner]
) -> None:
    namespace, _ = pool
    planned = {gpu: row["capacityRps"] for gpu, row in variant_rows(kvis.get(k8s, namespace, NAME)).items()}
    key = kvis.api_key(k8s, namespace, NAME)
    target = f"{gateway.url}/namespaces/{namespace}"
    load = Load(
        lambda: [target],
        MODEL,
        rate=SPIKE_RPS,
        max_in_flight=IN_FLIGHT,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        api_key=key,
    )
    with Ratios(k8s, namespace) as ratios, load:
        # SUSTAIN_PERIODS of 2 s judged, then the correction handler's re-plan.
        status = poll(lambda: corrected(k8s, namespace), 120, "PlanAccurate False and a correction per type")
    accurate = kvis.condition({"status": status}, PLAN_ACCURATE)
    print(f"PlanAccurate: {accurate['message']}\ncorrection: {status['correction']}\nratios: {ratios.seen}")
    # 1. Judged type by type, for a sustained run.
    assert accurate["reason"] == "OutsideBand" and "by GPU type: L4: " in accurate["message"], accurate
    assert status["planAccuracy"]["outsidePeriods"] >= SUSTAIN_PERIODS, status["planAccuracy"]
    # 2. Factors per type, from each type's own ratios (smoothed: within the range seen), none pool-wide.
    correction = status["correction"]
    assert "ttft" not in correction and "tpot" not in correction, correction
    for row in correction["byGpu"]:
        for signal in ("ttft", "tpot"):
            seen = ratios.seen[row["gpu"]][signal]
            assert seen and min(seen) * 0.99 <= row[signal] <= max(seen) * 1.01, (row, signal, seen)
            assert row[signal] > BAND[1], row
    factor = {row["gpu"]: row for row in correction["byGpu"]}
    assert factor["H100-80GB"]["tpot"] > TYPES_APART * factor["L4"]["tpot"], factor
    # 3. Each type re-planned with its own factors: less capacity per replica, the replicas held.
    rows = variant_rows({"status": status})
    for gpu in GPUS:
        assert rows[gpu]["capacityRps"] < planned[gpu], (gpu, planned, rows[gpu])
    assert deployment_replicas(k8s, namespace, NAME) == {gpu: 1 for gpu in GPUS}
    ok = [r for r in load.results if r.error is None]
    assert load.results and len(ok) == len(load.results), [r.error for r in load.results if r.error][:5]
