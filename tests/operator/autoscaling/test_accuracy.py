"""The plan's predictions beside what the engines measured, and PlanAccurate's transitions
(operator/autoscaling/accuracy.py): False only for a ratio outside the band for SUSTAIN_PERIODS
periods in a row, True again at the first window inside it, Unknown without observations."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.autoscaling.accuracy import BAND, SUSTAIN_PERIODS, accuracy_patch, newest_ready_seconds
from kvpilot.operator.autoscaling.decisions import MIN_OBSERVATIONS, Signals
from kvpilot.operator.autoscaling.variant_windows import VariantSignals
from kvpilot.operator.kube.events import iso

NOW = 1_800_000_000.0
PERIOD = 15.0
PLAN = {"predictedTtftMs": 200.0, "predictedTpotMs": 25.0}
READY = {"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "1/1 replicas ready"}


def window(ttft_ms: float | None = 220.0, tpot_ms: float | None = 30.0, requests: int = 50, **more: Any) -> Signals:
    return Signals(
        ttft_p95_seconds=None if ttft_ms is None else ttft_ms / 1000,
        tpot_p95_seconds=None if tpot_ms is None else tpot_ms / 1000,
        ttft_observations=requests,
        tpot_observations=requests,
        **more,
    )


class Service:
    """A status that takes each period's patch, as the API server would (top-level fields replaced:
    the patch names every field of planAccuracy and the whole conditions list)."""

    def __init__(self, plan: dict[str, Any] | None = None) -> None:
        self.status: dict[str, Any] = {"plan": dict(PLAN if plan is None else plan), "conditions": [READY]}
        self.now = NOW

    def period(self, signals: Signals, ready: tuple[str, float] | None = None) -> dict[str, Any]:
        self.now += PERIOD
        self.status = {
            **self.status,
            **accuracy_patch(InferenceServiceStatus.model_validate(self.status), signals, 60.0, self.now, 3, ready),
        }
        return self.accurate()

    def accurate(self) -> dict[str, Any]:
        (condition,) = [c for c in self.status["conditions"] if c["type"] == "PlanAccurate"]
        return condition


def test_unknown_until_a_window_holds_enough_requests() -> None:
    service = Service()
    for signals in (window(None, None, requests=0), window(900.0, 90.0, requests=MIN_OBSERVATIONS - 1)):
        condition = service.period(signals)
        assert (condition["status"], condition["reason"]) == ("Unknown", "NoObservations")
        assert f"{MIN_OBSERVATIONS} requests" in condition["message"]
    # What the reconcile wrote stays, and stays first.
    assert service.status["conditions"][0] == READY
    assert "ttft" not in service.status["planAccuracy"] and "outsidePeriods" not in service.status["planAccuracy"]
    nothing = Service(plan={"fits": False, "predictedTtftMs": 0.0, "predictedTpotMs": 0.0})
    assert nothing.period(window(900.0, 90.0))["reason"] == "NoPrediction"


def test_within_the_band_is_true_with_the_numbers_side_by_side() -> None:
    service = Service()
    condition = service.period(window(300.0, 20.0, requests=80))
    assert (condition["status"], condition["reason"]) == ("True", "WithinBand")
    assert condition["observedGeneration"] == 3 and condition["lastTransitionTime"] == iso(service.now)
    accuracy = service.status["planAccuracy"]
    assert accuracy["ttft"] == {
        "predictedMs": 200.0,
        "observedMs": 300.0,
        "ratio": 1.5,
        "requests": 80,
        "time": iso(service.now),
    }
    assert accuracy["tpot"]["ratio"] == 0.8 and accuracy["band"] == list(BAND) and accuracy["windowSeconds"] == 60
    assert "observed 300 ms / predicted 200 ms = 1.50x (80 requests" in condition["message"]


def test_a_brief_excursion_does_not_make_the_plan_inaccurate() -> None:
    service = Service()
    since = service.period(window())["lastTransitionTime"]
    for n in range(1, SUSTAIN_PERIODS):
        condition = service.period(window(ttft_ms=900.0))  # 4.5x: outside
        assert (condition["status"], condition["reason"]) == ("True", "BriefExcursion")
        assert f"{n} of the {SUSTAIN_PERIODS} periods" in condition["message"]
        assert condition["lastTransitionTime"] == since
    assert service.status["planAccuracy"]["outsidePeriods"] == SUSTAIN_PERIODS - 1
    condition = service.period(window())
    assert (condition["status"], condition["reason"], condition["lastTransitionTime"]) == ("True", "WithinBand", since)
    assert "outsidePeriods" not in service.status["planAccuracy"]
    assert "outsideSince" not in service.status["planAccuracy"]


def test_a_sustained_excursion_goes_false_with_the_numbers_and_back_true_when_it_returns() -> None:
    service = Service()
    service.period(window())
    started = service.now + PERIOD
    for _ in range(SUSTAIN_PERIODS - 1):
        assert service.period(window(tpot_ms=5.0))["status"] == "True"  # 0.2x: the plan is pessimistic
    condition = service.period(window(tpot_ms=5.0))
    assert (condition["status"], condition["reason"]) == ("False", "OutsideBand")
    assert condition["lastTransitionTime"] == iso(service.now)
    assert f"for {SUSTAIN_PERIODS} periods since {iso(started)}" in condition["message"]
    assert "p95 TPOT observed 5 ms / predicted 25 ms = 0.20x" in condition["message"]
    assert "band [0.5, 2]" in condition["message"]
    assert service.status["planAccuracy"]["outsideSince"] == iso(started)
    # Still outside: stays False; a window without enough requests says nothing new.
    assert service.period(window(tpot_ms=5.0))["status"] == "False"
    assert service.period(window(requests=3))["status"] == "False"
    condition = service.period(window())
    assert (condition["status"], condition["reason"]) == ("True", "WithinBand")
    assert condition["lastTransitionTime"] == iso(service.now)


def test_a_window_without_enough_requests_ends_a_run_outside() -> None:
    """A run outside must be unbroken: outside, too few requests to tell, outside again is two
    runs, neither long enough."""
    service = Service()
    service.period(window())
    for _ in range(SUSTAIN_PERIODS - 1):
        service.period(window(ttft_ms=50.0))
    assert service.period(window(requests=0))["status"] == "True"
    condition = service.period(window(ttft_ms=50.0))
    assert (condition["status"], condition["reason"]) == ("True", "BriefExcursion")
    assert service.status["planAccuracy"]["outsidePeriods"] == 1


@pytest.mark.parametrize("ratio", [BAND[0], BAND[1]])
def test_the_band_s_edges_are_inside(ratio: float) -> None:
    service = Service()
    for _ in range(SUSTAIN_PERIODS + 1):
        condition = service.period(window(ttft_ms=200.0 * ratio, tpot_ms=25.0))
    assert (condition["status"], condition["reason"]) == ("True", "WithinBand")


def test_observed_draft_acceptance_goes_beside_the_assumed_one() -> None:
    service = Service(plan={**PLAN, "assumedDraftAcceptance": 0.7})
    service.period(window(draft_acceptance=0.41234))
    assert service.status["planAccuracy"]["draftAcceptance"] == {"assumed": 0.7, "observed": 0.412}
    condition = service.period(window())  # no drafts in this window: the last observed stays
    assert service.status["planAccuracy"]["draftAcceptance"] == {"assumed": 0.7, "observed": 0.412}
    assert "draft acceptance observed 0.41, assumed 0.70" in condition["message"]
    assert "draftAcceptance" not in Service().status.get("planAccuracy", {})


def test_observed_prefix_share_goes_beside_the_assumed_one_even_when_the_plan_assumed_none() -> None:
    # The plan assumed every prompt token computed; the engines served 4/5 from the prefix cache:
    # that is why they beat its TTFT, and the message says so beside the ratio.
    service = Service(plan={**PLAN, "assumedPrefixShare": 0.0})
    service.period(window())
    assert "prefixShare" not in service.status["planAccuracy"]  # nothing observed, nothing assumed
    condition = service.period(window(prefix_share=0.8))
    assert service.status["planAccuracy"]["prefixShare"] == {"assumed": 0.0, "observed": 0.8}
    assert "prefix share observed 0.80, assumed 0.00" in condition["message"]
    assumed = Service(plan={**PLAN, "assumedPrefixShare": 0.5})
    assumed.period(window())
    assert assumed.status["planAccuracy"]["prefixShare"] == {"assumed": 0.5}


def test_a_new_prediction_drops_what_was_judged_against_the_old_one() -> None:
    service = Service()
    service.period(window(ttft_ms=900.0, tpot_ms=None))
    service.period(window(ttft_ms=900.0, tpot_ms=None))
    assert service.status["planAccuracy"]["outsidePeriods"] == 2
    service.status["plan"] = {"predictedTtftMs": 300.0, "predictedTpotMs": 25.0}
    service.period(window(ttft_ms=900.0, tpot_ms=None))
    accuracy = service.status["planAccuracy"]
    assert accuracy["outsidePeriods"] == 1 and accuracy["outsideSince"] == iso(service.now)
    assert accuracy["ttft"]["predictedMs"] == 300.0 and accuracy["ttft"]["ratio"] == 3.0
    service.status["plan"] = {"predictedTtftMs": 800.0, "predictedTpotMs": 25.0}
    service.period(window(None, None, requests=0))
    assert "ttft" not in service.status["planAccuracy"]


def test_the_kv_blocks_an_engine_allocated_go_beside_the_plan_s() -> None:
    # vLLM sizes its own pool from --gpu-memory-utilization: 8 % fewer blocks than planned shows here.
    service = Service(plan={**PLAN, "kvBlocks": 10_000})
    service.period(window())
    assert "kvBlocks" not in service.status["planAccuracy"]  # no engine has said yet
    condition = service.period(window(kv_blocks=9_200))
    assert service.status["planAccuracy"]["kvBlocks"] == {"predicted": 10_000, "observed": 9_200, "ratio": 0.92}
    assert "KV blocks allocated 9200, predicted 10000 (0.92x)" in condition["message"]
    service.period(window())  # no reading this period: the last one stays
    assert service.status["planAccuracy"]["kvBlocks"]["observed"] == 9_200
    service.status["plan"] = {**PLAN, "kvBlocks": 20_000}  # another pool: the old engines' count no longer compares
    service.period(window())
    assert "kvBlocks" not in service.status["planAccuracy"]


def pod(name: str, started: str, ready_at: str | None, ready: str = "True") -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": ready, "lastTransitionTime": ready_at}] if ready_at else []
    return {"metadata": {"name": name}, "status": {"startTime": started, "conditions": conditions}}


def test_the_newest_ready_pod_s_time_to_ready_goes_beside_the_plan_s() -> None:
    pods = [
        pod("old", "2026-12-06T09:00:00Z", "2026-12-06T09:01:10Z"),
        pod("new", "2026-12-06T09:30:00Z", "2026-12-06T09:31:35Z"),
        pod("loading", "2026-12-06T09:40:00Z", "2026-12-06T09:40:00Z", ready="False"),
        pod("pending", "2026-12-06T09:45:00Z", None),
    ]
    assert newest_ready_seconds(pods) == ("new", 95.0)
    assert newest_ready_seconds(pods[2:]) is None
    service = Service(plan={**PLAN, "predictedReadySeconds": 80.0})
    condition = service.period(window(), newest_ready_seconds(pods))
    assert service.status["planAccuracy"]["readySeconds"] == {
        "predicted": 80.0,
        "observed": 95.0,
        "ratio": 1.188,
        "pod": "new",
    }
    assert "ready in 95 s (new), predicted 80 s" in condition["message"]
    service.period(window())  # no pod ready now (scaled to zero): the last one stays
    assert service.status["planAccuracy"]["readySeconds"]["observed"] == 95.0
    service.status["plan"] = {**PLAN, "predictedReadySeconds": 30.0}  # another plan: the old pod no longer compares
    service.period(window())
    assert "readySeconds" not in service.status["planAccuracy"]


# A mixed pool: two L4 replicas of 5 req/s each, one H100 of 30 (planned shares 0.25 and 0.75).
POOL = [
    {"gpu": "L4", "replicas": 2, "capacityRps": 5.0, "predictedTtftMs": 400.0, "predictedTpotMs": 40.0},
    {"gpu": "H100-80GB", "replicas": 1, "capacityRps": 30.0, "predictedTtftMs": 100.0, "predictedTpotMs": 10.0},
]


def per_type(l4: tuple[float, float, int], h100: tuple[float, float, int]) -> dict[str, VariantSignals]:
    return {
        name: VariantSignals(
            ttft_p95_seconds=ttft / 1000, tpot_p95_seconds=tpot / 1000, ttft_observations=n, tpot_observations=n
        )
        for name, (ttft, tpot, n) in (("l4", l4), ("h100-80gb", h100))
    }


def test_a_mixed_pool_shows_each_gpu_type_against_its_own_plan_and_its_share_of_the_traffic() -> None:
    service = Service()
    service.status["variants"] = POOL
    # The L4s run twice as slow as their plan; the H100 as planned; the L4s took 40 % of the requests.
    condition = service.period(window(variants=per_type((800.0, 80.0, 40), (110.0, 10.0, 60))))
    l4, h100 = service.status["planAccuracy"]["variants"]
    assert (l4["gpu"], l4["variant"], h100["gpu"]) == ("L4", "l4", "H100-80GB")
    assert l4["ttft"]["ratio"] == 2.0 and l4["tpot"] == {
        "predictedMs": 40.0,
        "observedMs": 80.0,
        "ratio": 2.0,
        "requests": 40,
        "time": iso(service.now),
    }
    assert h100["ttft"]["ratio"] == 1.1 and h100["tpot"]["ratio"] == 1.0
    assert (l4["plannedShare"], l4["observedShare"], l4["requests"]) == (0.25, 0.4, 40)
    assert (h100["plannedShare"], h100["observedShare"], h100["requests"]) == (0.75, 0.6, 60)
    assert (
        "by GPU type: L4: p95 TTFT 800/400 ms, p95 TPOT 80/40 ms, 40% of requests (planned 25%)"
        in (condition["message"])
    )
    # A window too thin for the H100's p95 keeps its last one (beside the same prediction); the
    # shares follow the new window.
    service.period(window(variants=per_type((700.0, 70.0, 30), (500.0, 50.0, MIN_OBSERVATIONS - 1))))
    l4, h100 = service.status["planAccuracy"]["variants"]
    assert l4["ttft"]["observedMs"] == 700.0 and h100["ttft"]["observedMs"] == 110.0
    assert h100["requests"] == MIN_OBSERVATIONS - 1 and l4["observedShare"] == round(30 / (30 + 19), 3)
    # A new plan for the H100 (another prediction): its old window is not judged against it.
    service.status["variants"] = [POOL[0], {**POOL[1], "predictedTtftMs": 150.0}]
    service.period(window(variants=per_type((700.0, 70.0, 30), (500.0, 50.0, 5))))
    assert "ttft" not in service.status["planAccuracy"]["variants"][1]


def test_a_service_of_one_gpu_type_has_no_per_type_rows() -> None:
    service = Service()
    service.status["variants"] = POOL[:1]
    service.period(window(variants=per_type((800.0, 80.0, 40), (110.0, 10.0, 60))))
    assert "variants" not in service.status["planAccuracy"]


def test_spot_and_on_demand_of_one_gpu_type_are_rows_of_their_own() -> None:
    service = Service()
    service.status["variants"] = [{**POOL[0], "capacityClass": "spot"}, POOL[0]]
    seen = {
        "l4-spot": VariantSignals(
            ttft_p95_seconds=0.8, tpot_p95_seconds=0.08, ttft_observations=30, tpot_observations=30
        ),
        "l4": VariantSignals(ttft_p95_seconds=0.4, tpot_p95_seconds=0.04, ttft_observations=10, tpot_observations=10),
    }
    condition = service.period(window(variants=seen))
    spot, on_demand = service.status["planAccuracy"]["variants"]
    assert (spot["variant"], spot["capacityClass"], on_demand["variant"]) == ("l4-spot", "spot", "l4")
    assert "capacityClass" not in on_demand
    assert (spot["observedShare"], spot["plannedShare"], spot["tpot"]["ratio"]) == (0.75, 0.5, 2.0)
    assert "L4@spot: p95 TTFT 800/400 ms" in condition["message"]


def test_a_mixed_pool_is_judged_type_by_type_not_by_its_merged_p95() -> None:
    """The pool's merged p95 (inside the band against its first type's predictions) hides an L4
    three times slower than its plan: PlanAccurate judges each type against its own plan, so a
    sustained run of such windows turns it False; a window whose types are all inside turns it True
    although the merged p95 is far outside."""
    service = Service({**PLAN, "predictedTtftMs": 400.0, "predictedTpotMs": 40.0})
    service.status["variants"] = POOL
    slow_l4 = per_type((1200.0, 120.0, 30), (100.0, 10.0, 60))
    for period in range(1, SUSTAIN_PERIODS + 1):
        condition = service.period(window(500.0, 50.0, variants=slow_l4))
        assert service.status["planAccuracy"]["ttft"]["ratio"] == 1.25  # the merged p95: inside
        assert service.status["planAccuracy"]["outsidePeriods"] == period
    assert (condition["status"], condition["reason"]) == ("False", "OutsideBand")
    assert "L4: p95 TTFT 1200/400 ms, p95 TPOT 120/40 ms" in condition["message"]
    as_planned = per_type((400.0, 40.0, 30), (100.0, 10.0, 60))
    condition = service.period(window(2000.0, 200.0, variants=as_planned))
    assert (condition["status"], condition["reason"]) == ("True", "WithinBand")
    # A window in which no type has enough requests judges nothing, whatever the pool's p95s.
    condition = service.period(window(2000.0, 200.0, variants=per_type((400.0, 40.0, 5), (100.0, 10.0, 5))))
    assert (condition["status"], "outsidePeriods" in service.status["planAccuracy"]) == ("True", False)
