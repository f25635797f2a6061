"""Issue 41 on the real control plane: the SLO autoscaler scales a mixed pool by cost.

The pool of e2e/mixed_pool.py (the embedded model over an L4 and an H100-80GB, at most one replica
of each), with `autoscaling.mode: slo` between one and two replicas, a real engine behind every pod
(PodRunner) and the chart's gateway in front; the operator's autoscaler runs every 2 s (conftest),
its window 4 periods. The planner gives the L4 the lower cost per req/s (status.variants lists it
first: a replica-hour's price over its capacityRps), so the pool fills the L4 first and the H100
takes the overflow (operator/planning/variants.py `fill`).

As in e2e/test_autoscaling.py, the TTFT SLO is one these CPU engines cannot meet under load (a
~150-token prompt's prefill on one thread takes longer than SLO_TTFT_MS) and are never asked to
without it (no request, no TTFT observation): load must add a replica, its end must take it away.

CPU engines are also far from any GPU plan's predictions, so a load whose every window the
autoscaler judges (MIN_OBSERVATIONS requests) would, after accuracy.SUSTAIN_PERIODS periods (16 s
here), turn PlanAccurate False. The first version of this test found that the planner's correction
then re-planned both types with the pool's merged factors and re-ranked them (the H100 became the
cheaper per req/s and took the replica); a mixed pool is now judged and corrected type by type,
each against its own plan (controller/correction.py). That verdict is another scenario; this one
keeps each run of judged windows short (a burst is not a wrong plan), as a load in bursts does:
HIGH_RPS until what a phase waits for has happened, then TRICKLE_RPS (too few requests to judge,
enough that the thin p95 over the SLO forbids a scale-down), and asserts that PlanAccurate never
went False.

1. At rest the one replica is the L4's (its Deployment at 1, the H100's at 0).
2. Open-loop load through the gateway: the autoscaler scales 1 -> 2 (ScaledUp) and the new
   replica is the H100's (VariantScaled: type 2 of 2 by cost, the cheapest with room first).
3. While both serve, a burst (until the H100's pods have a window of their own), a pause, and a
   spike (SPIKE_RPS: the gateway sends the L4 pod its share only with several requests in flight):
   status.planAccuracy.variants has a row per type with its own plan's predicted TPOT
   (status.variants) beside its own pods' p95 (the L4's from when it served alone), its
   plannedShare (replicas x capacityRps over the pool's) and, from a window that holds requests of
   both, its observedShare and requests: the shares sum to 1. Latency ratios are not asserted (CPU
   engines are not GPUs).
4. The load stops: after the 10 s stabilization window the autoscaler scales 2 -> 1 (ScaledDown)
   and the H100's replica is the one removed (the dearest first), its engine stopped; the L4's
   Deployment stays at 1 throughout.
"""

from __future__ import annotations

import time
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
from e2e.mixed_pool import MODEL, cost_per_rps_hour, deployment_replicas, engine_urls, pool_spec, variant_rows
from e2e.pod_runner import PodRunner
from e2e.polling import Background, poll
from kvpilot.operator.api.conditions import PLAN_ACCURATE
from kvpilot.operator.api.names import variant, variant_deployment
from kvpilot.operator.autoscaling.accuracy import SUSTAIN_PERIODS

ApplyISVC = Callable[[str, dict[str, Any]], dict[str, Any]]
NAME = "mixed-scaling"
SLO_TTFT_MS = 20
PROMPT = (
    "Summarise the following notes for a colleague who missed the meeting. "
    + "The team reviewed the release plan, the open bugs, the test coverage and the rollout schedule. " * 6
)
MAX_TOKENS = 8
# Requests per second: over the SLO with windows the autoscaler judges (4 periods of 2 s hold ~40),
# and between bursts (~4 a window, under decisions.MIN_OBSERVATIONS).
HIGH_RPS = 5.0
TRICKLE_RPS = 0.5
# The gateway's least-load ((in flight + 1) / weight, the weights capacityRps as corrected by each
# type's own TPOT) sends the L4 pod (about an eighth of the pool's weight) a request only once the
# H100's has six or more in flight: a spike that fills the Load's cap on requests in flight
# (IN_FLIGHT, the arrivals beyond it shed) gets there at once, where HIGH_RPS may take many
# seconds. The cap is no higher than that needs: the spike's backlog keeps windows judged while
# it drains.
SPIKE_RPS = 30.0
IN_FLIGHT = 10
SCALE_DOWN_WINDOW_S = 10
# planAccuracy's shares are rounded to 3 decimals each.
SHARE_ROUNDING = 0.0025


def autoscaled_spec() -> dict[str, Any]:
    """The pool at one replica, the SLO autoscaler allowed one or two, one step at a time."""
    return pool_spec(
        replicas=1,
        slo={"ttftP95Ms": SLO_TTFT_MS},
        autoscaling={
            "mode": "slo",
            "minReplicas": 1,
            "maxReplicas": 2,
            "maxStep": 1,
            "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S,
        },
    )


def accuracy_entries(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.planAccuracy.variants by GPU type."""
    return {e["gpu"]: e for e in status.get("planAccuracy", {}).get("variants") or []}


class Sampler(Background):
    """Once a second: each GPU type's Deployment's replicas, and the run of judged windows outside
    the band (planAccuracy.outsidePeriods) and PlanAccurate's status."""

    def __init__(self, k8s: Cluster, namespace: str) -> None:
        super().__init__("mixed-sampler")
        self.k8s, self.namespace = k8s, namespace
        self.replicas: list[dict[str, int]] = []
        self.outside: list[int] = []
        self.accurate: set[str] = set()

    def loop(self) -> None:
        while not self.stopping.wait(1.0):
            self.sample()
        # Once more at the end: the state the test waited for may have come after the last tick.
        self.sample()

    def sample(self) -> None:
        try:
            self.replicas.append(deployment_replicas(self.k8s, self.namespace, NAME))
            obj = kvis.get(self.k8s, self.namespace, NAME)
        except Exception:  # noqa: BLE001 - a slow kubectl read skips one sample
            return
        self.outside.append(obj.get("status", {}).get("planAccuracy", {}).get("outsidePeriods", 0))
        self.accurate.add(kvis.condition(obj, PLAN_ACCURATE).get("status", "none"))

    def changes(self) -> list[dict[str, int]]:
        """The replicas sampled, repeats dropped: each distinct state in the order it came."""
        return [s for i, s in enumerate(self.replicas) if i == 0 or s != self.replicas[i - 1]]


@pytest.fixture()
def pool(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC, tmp_path: Path
) -> Iterator[tuple[str, list[str], PodRunner]]:
    """The pool, Ready, its one replica's engine serving: (namespace, GPU types cheapest per req/s
    first, the runner)."""
    namespace = kvpilot.watch_namespaces[0]
    apply_isvc(NAME, autoscaled_spec())
    obj = kvis.wait_condition(k8s, namespace, NAME, "Ready", "True", timeout_s=120)
    rows = variant_rows(obj)
    ranked = list(rows)
    costs = [cost_per_rps_hour(rows[gpu]) for gpu in ranked]
    # The premise: the L4 is the cheaper per req/s (the status lists the cheapest first).
    assert ranked == ["L4", "H100-80GB"] and costs[0] < costs[1], (costs, rows)
    with PodRunner(k8s, namespace, NAME, tmp_path) as runner:
        poll(lambda: len(runner.serving()) == 1 or None, 180, f"the engine of {NAME}'s first pod", interval_s=1.0)
        yield namespace, ranked, runner
        assert not runner.errors, runner.snapshot()


def status_of(k8s: Cluster, namespace: str) -> dict[str, Any]:
    status: dict[str, Any] = kvis.get(k8s, namespace, NAME).get("status", {})
    return status


def scaled_up(k8s: Cluster, namespace: str, ranked: list[str]) -> bool:
    """Both types at one replica, and the cheap type's own TPOT judged (from when it served alone)."""
    cheap, dear = ranked
    return deployment_replicas(k8s, namespace, NAME) == {cheap: 1, dear: 1} and judged(k8s, namespace, cheap)


def run_ended(k8s: Cluster, namespace: str) -> bool:
    """No judged window outside the band in the last period (a window too thin to judge ends a run)."""
    return not status_of(k8s, namespace).get("planAccuracy", {}).get("outsidePeriods")


def judged(k8s: Cluster, namespace: str, gpu: str) -> bool:
    """Whether planAccuracy.variants holds `gpu`'s own TPOT comparison (a window of its own)."""
    return "tpot" in accuracy_entries(status_of(k8s, namespace)).get(gpu, {})


def both_in_one_window(k8s: Cluster, namespace: str) -> dict[str, Any] | None:
    """The status once planAccuracy.variants holds a window with requests of every type and each
    type's own TPOT comparison; None before."""
    status = status_of(k8s, namespace)
    entries = accuracy_entries(status)
    if len(entries) < 2 or not all((e.get("requests") or 0) > 0 and "tpot" in e for e in entries.values()):
        return None
    return status


def pause(k8s: Cluster, namespace: str, load: Load) -> None:
    """The trickle until a period's window is too thin to judge (which ends a run outside the band)."""
    load.rate = TRICKLE_RPS
    poll(lambda: run_ended(k8s, namespace), 60, "a window too thin to judge", interval_s=0.5)


def scale_up_and_share(
    k8s: Cluster, namespace: str, ranked: list[str], runner: PodRunner, load: Load
) -> tuple[dict[str, Any], dict[str, float]]:
    """Steps 2 and 3 under `load`: (the status of a window of both types, seconds each phase took)."""
    took: dict[str, float] = {}

    def phase(name: str) -> None:
        took[name] = round(time.monotonic() - started - sum(took.values()), 1)

    started = time.monotonic()
    load.rate = HIGH_RPS  # 2. over the SLO: one more replica, on the dearer type (the cheaper one is full)
    poll(lambda: scaled_up(k8s, namespace, ranked), 120, "the scale-up to the dear type", interval_s=0.5)
    phase("scale-up")
    load.rate = TRICKLE_RPS
    poll(lambda: len(runner.serving()) == 2 or None, 180, "the new pod's engine", interval_s=1.0)
    pause(k8s, namespace, load)
    phase("engine")
    load.rate = HIGH_RPS  # 3. while both serve: a window of the dear type's own, then one of both
    poll(lambda: judged(k8s, namespace, ranked[1]), 90, "a window of the dear type's own", interval_s=0.5)
    pause(k8s, namespace, load)
    phase("dear type judged")
    load.rate = SPIKE_RPS
    status = poll(lambda: both_in_one_window(k8s, namespace), 90, "a window of both types", interval_s=0.5)
    phase("both in a window")
    return status, took


def check_shares(status: dict[str, Any], ranked: list[str]) -> None:
    """planAccuracy.variants against status.variants, from one status."""
    rows = variant_rows({"status": status})
    entries = {e["gpu"]: e for e in status["planAccuracy"]["variants"]}
    print(f"planAccuracy.variants: {list(entries.values())}")
    assert list(entries) == ranked, entries  # a row per type, in status.variants' order
    capacity = {gpu: rows[gpu]["replicas"] * rows[gpu]["capacityRps"] for gpu in ranked}
    assert all(rows[gpu]["replicas"] == 1 for gpu in ranked), rows
    for gpu, entry in entries.items():
        assert entry["variant"] == variant(gpu), entry
        # Its own plan's predictions, not the pool's first plan's.
        assert entry["tpot"]["predictedMs"] == rows[gpu]["predictedTpotMs"], (entry, rows[gpu])
        assert entry["tpot"]["requests"] >= 1 and entry["tpot"]["observedMs"] > 0, entry
        assert abs(entry["plannedShare"] - capacity[gpu] / sum(capacity.values())) <= SHARE_ROUNDING, entry
        assert entry["requests"] > 0 and 0 < entry["observedShare"] < 1, entry
    assert rows[ranked[0]]["predictedTpotMs"] != rows[ranked[1]]["predictedTpotMs"], rows
    total = sum(e["requests"] for e in entries.values())
    assert abs(sum(e["observedShare"] for e in entries.values()) - 1) <= SHARE_ROUNDING, entries
    for entry in entries.values():
        assert abs(entry["observedShare"] - entry["requests"] / total) <= SHARE_ROUNDING, entries


def check_events(k8s: Cluster, namespace: str, ranked: list[str]) -> None:
    """ScaledUp 1 -> 2 and ScaledDown 2 -> 1; VariantScaled: the dear type's Deployment up then
    down, each saying it is the dearer by cost; the cheap type's only ever went 0 -> 1."""
    messages: dict[str, list[str]] = {}
    for e in kvis.events(k8s, namespace, NAME):
        messages.setdefault(e["reason"], []).append(e["message"])
    ups, downs, variants = (messages.get(r, []) for r in ("ScaledUp", "ScaledDown", "VariantScaled"))
    print("events:\n" + "\n".join(f"{r}: {m}" for r, ms in messages.items() for m in ms))
    assert [m for m in ups if "1 -> 2" in m] and not [m for m in ups if "1 -> 2" not in m], "\n".join(ups)
    assert [m for m in downs if "2 -> 1" in m] and not [m for m in downs if "2 -> 1" not in m], "\n".join(downs)
    cheap, dear = (variant_deployment(NAME, gpu) for gpu in ranked)
    rank = f"{ranked[1]} is type 2 of 2 by cost per req/s"
    assert [m for m in variants if m.startswith(f"{dear}: 0 -> 1 replicas: {rank}") and "first" in m], variants
    assert [m for m in variants if m.startswith(f"{dear}: 1 -> 0 replicas: {rank}") and "dearest" in m], variants
    assert [m for m in variants if m.startswith(cheap)] == [
        m for m in variants if m.startswith(f"{cheap}: 0 -> 1 replicas: {ranked[0]} is type 1 of 2")
    ], variants


def test_load_fills_the_cheapest_type_first_and_its_end_removes_the_dearest(
    k8s: Cluster, gateway: LocalGateway, pool: tuple[str, list[str], PodRunner]
) -> None:
    namespace, ranked, runner = pool
    cheap, dear = ranked
    # 1. At rest: the one replica is the cheaper type's, and its engine is the one serving.
    assert deployment_replicas(k8s, namespace, NAME) == {cheap: 1, dear: 0}
    assert sorted(engine_urls(k8s, namespace, NAME, runner)) == [cheap], runner.snapshot()
    key = kvis.api_key(k8s, namespace, NAME)
    target = f"{gateway.url}/namespaces/{namespace}"
    load = Load(
        lambda: [target], MODEL, rate=0, max_in_flight=IN_FLIGHT, prompt=PROMPT, max_tokens=MAX_TOKENS, api_key=key
    )
    with Sampler(k8s, namespace) as sampled:
        with load:
            status, took = scale_up_and_share(k8s, namespace, ranked, runner, load)
        # 4. No load: back to one replica, the dearer type's removed.
        ended = time.monotonic()
        poll(lambda: deployment_replicas(k8s, namespace, NAME) == {cheap: 1, dear: 0} or None, 120, "the scale-down")
        took["scale-down"] = round(time.monotonic() - ended, 1)
        poll(lambda: len(runner.engines()) == 1 or None, 60, "the removed pod's engine stopped", interval_s=1.0)
    print(f"seconds: {took}; outsidePeriods sampled: {sampled.outside}; PlanAccurate: {sampled.accurate}")
    # The scenario's premise: no run of judged windows long enough to turn the correction on.
    assert "False" not in sampled.accurate and max(sampled.outside) < SUSTAIN_PERIODS, (took, sampled.outside)
    check_shares(status, ranked)
    assert sorted(engine_urls(k8s, namespace, NAME, runner)) == [cheap], runner.snapshot()
    # The cheap type's replica stayed throughout; the dear type's came and went once.
    assert sampled.changes() == [{cheap: 1, dear: 0}, {cheap: 1, dear: 1}, {cheap: 1, dear: 0}], sampled.replicas
    check_events(k8s, namespace, ranked)
    ok = [r for r in load.results if r.error is None]
    assert load.results and len(ok) == len(load.results), [r.error for r in load.results if r.error][:5]
    assert took["scale-down"] >= SCALE_DOWN_WINDOW_S - 2, took  # not before its stabilization window (2 s: a period)
