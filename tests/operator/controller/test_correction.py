"""status.correction: the observed / predicted factors the plan's replicas are chosen with."""

from __future__ import annotations

import math
from typing import Any

from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.controller import correction
from kvpilot.operator.controller.reconcile import reconcile
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.operator.controller.test_reconcile import NOW, FakeCluster, body

SPEC: dict[str, Any] = {
    "model": {"name": "SmolLM2-135M-Instruct"},
    "accelerator": {"type": "cpu", "profile": "amd-epyc-zen5-2c"},
    "serving": {"speculative": "off", "maxContextLength": 2048},
    "load": {"requestsPerSecond": 16, "meanPromptTokens": 60, "meanOutputTokens": 16},
    "slo": {"ttftP95Ms": 400, "tpotP95Ms": 100},
    "autoscaling": {"mode": "slo", "maxReplicas": 8},
}


def spec(**changes: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({**SPEC, **changes})


def typed(status: dict[str, Any]) -> InferenceServiceStatus:
    return InferenceServiceStatus.model_validate(status)


def verdict(state: str, ttft: float, tpot: float, window: str = "2026-12-01T10:00:00Z") -> dict[str, Any]:
    return {
        "planAccuracy": {
            "ttft": {"predictedMs": 20, "observedMs": 20 * ttft, "ratio": ttft, "requests": 30, "time": window},
            "tpot": {"predictedMs": 10, "observedMs": 10 * tpot, "ratio": tpot, "requests": 30, "time": window},
        },
        "conditions": [{"type": "PlanAccurate", "status": state, "reason": "OutsideBand", "message": "numbers"}],
    }


def test_a_sustained_miss_becomes_the_factors_and_their_replicas() -> None:
    s = spec()
    found = correction.correction(typed(verdict("False", 3.0, 2.5)), s)
    assert found is not None and (found["ttft"], found["tpot"]) == (3.0, 2.5) and found["basis"] == correction.basis(s)
    plain, corrected = plan(s), plan(s, PlanContext(correction=correction.factors(found)))
    assert corrected.replicas > plain.replicas
    assert "TTFT x3.00, TPOT x2.50 (status.correction)" in corrected.reasons["replicas"]
    # The predictions stay the model's, at the replicas chosen: observed / predicted keeps
    # measuring the model, so the factor cannot chase itself.
    at_those = plan(spec(autoscaling={"mode": "slo", "minReplicas": corrected.replicas, "maxReplicas": 8}))
    assert (corrected.predicted_ttft_ms, corrected.predicted_tpot_ms) == (
        at_those.predicted_ttft_ms,
        at_those.predicted_tpot_ms,
    )


def test_the_factors_follow_new_windows_half_way_and_ignore_small_moves() -> None:
    s = spec()
    first = correction.correction(typed(verdict("False", 4.0, 4.0)), s)
    assert first is not None
    same_window = correction.correction(typed({**verdict("False", 9.0, 9.0), "correction": first}), s)
    assert same_window == first
    later = "2026-12-01T10:00:15Z"
    moved = correction.correction(typed({**verdict("False", 9.0, 1.0, later), "correction": first}), s)
    assert moved is not None and moved["ttft"] == round(math.sqrt(4 * 9), 3) and moved["tpot"] == 2.0
    small = correction.correction(typed({**verdict("False", 4.2, 3.9, later), "correction": first}), s)
    assert small == first


def test_the_correction_holds_while_unknown_and_goes_with_accuracy_or_a_new_basis() -> None:
    s = spec()
    kept = correction.correction(typed(verdict("False", 3.0, 3.0)), s)
    unknown = {"correction": kept, "conditions": [{"type": "PlanAccurate", "status": "Unknown"}]}
    assert correction.correction(typed(unknown), s) == kept  # a reset after the re-plan keeps it
    assert correction.correction(typed({**verdict("True", 1.1, 1.0), "correction": kept}), s) is None
    other = spec(serving={"speculative": "off", "quantization": "int4", "maxContextLength": 2048})
    assert correction.correction(typed(unknown), other) is None
    # Load and SLO are not physics: a new rate keeps the factor.
    assert correction.correction(typed(unknown), spec(load={"requestsPerSecond": 8})) == kept
    # Under `external` an HPA owns the replicas: the plan is not re-planned from observations.
    assert correction.correction(typed(verdict("False", 3.0, 3.0)), spec(autoscaling={"mode": "external"})) is None


def test_stale_asks_for_a_re_plan_only_when_the_verdict_changes_the_factors() -> None:
    s = spec()
    missed = verdict("False", 6.0, 5.0)
    assert correction.stale(typed(missed), s)
    applied = {**missed, "correction": correction.correction(typed(missed), s)}
    assert not correction.stale(typed(applied), s)
    assert not correction.stale(typed({}), s)
    assert correction.stale(typed({**verdict("True", 1.0, 1.0), "correction": applied["correction"]}), s)


def test_reconcile_writes_the_correction_and_plans_replicas_with_it() -> None:
    cluster = FakeCluster()
    first = reconcile(body(SPEC), cluster, NOW)
    assert "correction" not in first
    missed = {**first, **verdict("False", 3.0, 2.5)}
    missed["conditions"] = first["conditions"] + missed["conditions"]
    second = reconcile(body(SPEC, status=missed), cluster, NOW)
    assert (second["correction"]["ttft"], second["correction"]["tpot"]) == (3.0, 2.5)
    assert second["plan"]["replicas"] > first["plan"]["replicas"]
    assert "status.correction" in second["plan"]["reasons"]["replicas"]
    assert second["desiredReplicas"] == second["plan"]["replicas"]


def _ran_ngram(acceptance: float, state: str = "False", window: str = "2026-12-01T10:00:00Z") -> dict[str, Any]:
    status = verdict(state, 1.0, 1.6, window)
    status["planAccuracy"]["draftAcceptance"] = {"assumed": 0.29, "observed": acceptance}
    return {**status, "plan": {"speculative": "ngram"}}


def test_the_observed_acceptance_rides_along_and_stays_once_the_plan_leaves_the_mode() -> None:
    s = spec(serving={"speculative": "auto", "maxContextLength": 2048})
    found = correction.correction(typed(_ran_ngram(0.02)), s)
    assert found is not None and found["acceptance"] == {"ngram": 0.02}
    assert correction.factors(found) == correction.Correction(1.0, 1.6, (("ngram", 0.02),))
    # The re-plan left ngram: no new reports of it, the observation stays with a later window.
    later = verdict("False", 1.0, 1.3, "2026-12-01T10:00:15Z") | {"plan": {"speculative": "off"}}
    again = correction.correction(typed({**later, "correction": found}), s)
    assert again is not None and again["acceptance"] == {"ngram": 0.02} and again["tpot"] != found["tpot"]


def test_an_observed_acceptance_that_makes_speculation_worse_turns_auto_off() -> None:
    # About one request at a time, a TPOT-bound SLO: auto speculates with n-gram drafts (0.29 assumed).
    s = spec(
        serving={"speculative": "auto", "maxContextLength": 2048},
        slo={"ttftP95Ms": 2000, "tpotP95Ms": 100},
        load={"requestsPerSecond": 0.5, "meanPromptTokens": 60, "meanOutputTokens": 64, "temperature": 0},
    )
    assumed = plan(s)
    assert assumed.speculative == "ngram" and assumed.assumed_draft_acceptance == 0.29
    low = plan(s, PlanContext(correction=correction.Correction(1.0, 1.0, (("ngram", 0.02),))))
    assert low.speculative == "off" and low.assumed_draft_acceptance is None
    assert "with the acceptance its engines reported, 0.02 of drafts" in low.reasons["speculative"]
    assert low.predicted_tpot_ms <= assumed.predicted_tpot_ms * 2
    # Drafts accepted as often as assumed or more keep n-gram, predicted with the observed figure.
    high = plan(s, PlanContext(correction=correction.Correction(1.0, 1.0, (("ngram", 0.8),))))
    assert high.speculative == "ngram" and high.assumed_draft_acceptance == 0.8
    assert high.predicted_tpot_ms < assumed.predicted_tpot_ms
    # A pinned mode stays, predicted with what its engines reported.
    pinned = spec(
        serving={"speculative": "ngram", "maxContextLength": 2048},
        slo={"ttftP95Ms": 2000, "tpotP95Ms": 100},
        load=s.load.model_dump(by_alias=True),
    )
    kept = plan(pinned, PlanContext(correction=correction.Correction(1.0, 1.0, (("ngram", 0.02),))))
    assert kept.speculative == "ngram" and kept.assumed_draft_acceptance == 0.02
    assert kept.predicted_tpot_ms > plan(pinned).predicted_tpot_ms


POOL_SPEC: dict[str, Any] = {
    **SPEC,
    "model": {"name": "llama-3-8b"},
    "accelerator": {"variants": [{"type": "L4", "maxReplicas": 4}, {"type": "H100-80GB", "maxReplicas": 4}]},
    "load": {"requestsPerSecond": 4, "meanPromptTokens": 512, "meanOutputTokens": 128},
    "slo": {"ttftP95Ms": 3000, "tpotP95Ms": 400},
}


def _by_type(ratios: dict[str, tuple[float, int]], window: str = "2026-12-01T10:00:00Z") -> list[dict[str, Any]]:
    """planAccuracy.variants with each (type or type@class)'s ratio of both signals and its requests."""
    rows = []
    for key, (ratio, requests) in ratios.items():
        gpu, _, capacity_class = key.partition("@")
        windows = {
            s: {"predictedMs": 10, "observedMs": 10 * ratio, "ratio": ratio, "time": window} for s in ("ttft", "tpot")
        }
        rows.append({"gpu": gpu, "variant": key.lower(), "requests": requests, **windows})
        if capacity_class:
            rows[-1]["capacityClass"] = capacity_class
    return rows


def _pool_missed(ratios: dict[str, tuple[float, int]], window: str = "2026-12-01T10:00:00Z") -> dict[str, Any]:
    # The pool's merged p95 (3.0, 2.5) is no type's factor.
    status = verdict("False", 3.0, 2.5, window)
    status["planAccuracy"]["variants"] = _by_type(ratios, window)
    return status


def test_a_mixed_pool_is_corrected_type_by_type_from_its_own_pods() -> None:
    """Each type's factor is its own pods against its own plan (planAccuracy.variants), not the pool's
    merged p95 against its cheapest type's predictions, which re-planned every type with one factor
    and re-ranked them. A later window that judged one type moves that type's factor only."""
    pool = InferenceServiceSpec.model_validate(POOL_SPEC)
    found = correction.correction(typed(_pool_missed({"L4": (4.0, 40), "H100-80GB": (1.2, 30)})), pool)
    assert found is not None and "ttft" not in found and "tpot" not in found
    assert found["byGpu"] == [{"gpu": "H100-80GB", "ttft": 1.2, "tpot": 1.2}, {"gpu": "L4", "ttft": 4.0, "tpot": 4.0}]
    assert correction.factors(found).for_gpu("L4") == correction.Correction(4.0, 4.0)
    assert correction.factors(found).for_gpu("A10G") == correction.Correction(1.0, 1.0)
    later = _pool_missed({"L4": (9.0, 40)}, "2026-12-01T10:00:15Z")
    moved = correction.correction(typed({**later, "correction": found}), pool)
    assert moved is not None and moved["byGpu"] == [
        {"gpu": "H100-80GB", "ttft": 1.2, "tpot": 1.2},
        {"gpu": "L4", "ttft": 6.0, "tpot": 6.0},
    ]
    # A type's last window stays in planAccuracy while a newer one judges the other: it is in its
    # factor already, so only the newer window moves one.
    h100_later = _pool_missed({"H100-80GB": (4.0, 30)}, "2026-12-01T10:00:30Z")
    h100_later["planAccuracy"]["variants"] += later["planAccuracy"]["variants"]
    again = correction.correction(typed({**h100_later, "correction": moved}), pool)
    assert again is not None and again["byGpu"] == [
        {"gpu": "H100-80GB", "ttft": round(math.sqrt(1.2 * 4.0), 3), "tpot": round(math.sqrt(1.2 * 4.0), 3)},
        {"gpu": "L4", "ttft": 6.0, "tpot": 6.0},
    ]
    # One type on two capacity classes runs one plan: the class whose pods served more speaks for it.
    classes = _pool_missed({"L4@spot": (5.0, 10), "L4@on-demand": (2.0, 50)})
    assert correction.correction(typed(classes), pool)["byGpu"] == [{"gpu": "L4", "ttft": 2.0, "tpot": 2.0}]
    # The same service on one type is corrected by its p95s as before.
    one_type = spec(**{k: v for k, v in POOL_SPEC.items() if k != "accelerator"}, accelerator={"type": "L4"})
    alone = correction.correction(typed(_pool_missed({"L4": (4.0, 40)})), one_type)
    assert alone is not None and (alone["ttft"], alone["tpot"]) == (3.0, 2.5) and "byGpu" not in alone


def test_reconcile_re_plans_only_the_type_whose_pods_run_slower_than_planned() -> None:
    cluster = FakeCluster()
    first = reconcile(body(POOL_SPEC), cluster, NOW)
    capacity = {row["gpu"]: row["capacityRps"] for row in first["variants"]}
    missed = {**first, **_pool_missed({"L4": (3.0, 40), "H100-80GB": (1.0, 30)})}
    missed["conditions"] = first["conditions"] + missed["conditions"]
    second = reconcile(body(POOL_SPEC, status=missed), cluster, NOW)
    assert second["correction"]["byGpu"][1] == {"gpu": "L4", "ttft": 3.0, "tpot": 3.0}
    corrected = {row["gpu"]: row["capacityRps"] for row in second["variants"]}
    assert corrected["H100-80GB"] == capacity["H100-80GB"]
    assert corrected["L4"] < capacity["L4"] / 2, (capacity, corrected)
