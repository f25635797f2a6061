"""`status.correction`: how much slower (or faster) than predicted a service's engines run, which
the planner multiplies its latencies by when it chooses replicas (pure).

It comes from `status.planAccuracy` (the autoscaler's observed / predicted p95 per window) once
PlanAccurate is False, i.e. once the ratio has stayed outside the band for a sustained run; the
plan's own predictions stay uncorrected, so every later ratio still measures the model and the
factor does not chase itself. Smoothed: each new window moves the factor half-way (in log space)
to the window's ratio, and a window within CHANGE of the factor moves nothing. It holds while the
physics it measured holds (model, accelerator, serving, runtime, image: `basis`); it is dropped when
PlanAccurate is True again (the model predicts this service within the band) or that basis changes.
The draft acceptance the engines reported rides along (`acceptance`, by speculative mode): the
planner predicts that mode with it, and under serving.speculative auto drops a mode it makes no
better than none.

Only in `autoscaling.mode: slo`, where the operator owns the replica count: under `external` an HPA
or KEDA does, and a re-planned count would move a Deployment the operator promised to leave alone.
Not for a mixed pool (accelerator.variants): one factor from the pool's merged p95 does not hold for
each of its types (see `correction`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.api.conditions import PLAN_ACCURATE
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import Correction as KeptCorrection
from kvpilot.operator.api.status import InferenceServiceStatus, LatencyWindow
from kvpilot.operator.planning.context import Correction

ACCEPTANCE_KEY = "acceptance"
# A window's ratio this close to the factor in use changes nothing (no re-plan, no write).
CHANGE = 0.1
_SIGNALS = ("ttft", "tpot")


def basis(spec: InferenceServiceSpec) -> str:
    """What a step's speed depends on: the factor measured under one of these holds only for it."""
    fields = spec.model_dump(mode="json", include={"model", "accelerator", "serving", "runtime", "image"})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _verdict(status: InferenceServiceStatus) -> str | None:
    """PlanAccurate's status, None before the autoscaler's loop judged."""
    condition = status.condition(PLAN_ACCURATE)
    return condition.status if condition else None


def _ratios(status: InferenceServiceStatus) -> tuple[dict[str, float], str] | None:
    """The last window's observed / predicted per signal (1 where the window had none) and its time."""
    accuracy = status.plan_accuracy
    found: dict[str, LatencyWindow | None] = {s: getattr(accuracy, s) if accuracy else None for s in _SIGNALS}
    ratios = {s: entry.ratio for s, entry in found.items() if entry and entry.ratio}
    if not ratios:
        return None
    window = max(entry.time or "" for s, entry in found.items() if entry and s in ratios)
    return {s: ratios.get(s, 1.0) for s in _SIGNALS}, window


def _moved(kept: KeptCorrection, ratios: Mapping[str, float]) -> bool:
    return any(abs(ratios[s] / getattr(kept, s) - 1) > CHANGE for s in _SIGNALS)


def correction(status: InferenceServiceStatus, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The correction to plan `spec` with (and to write as status.correction), from the last status."""
    if spec.autoscaling.mode != "slo" or spec.accelerator.variants:
        # A mixed pool's merged p95 against its cheapest type's predictions is no factor for each
        # type: applied to all it re-ranks them (an L4's capacity falls 75x where an H100's falls
        # 18x) and moves the replicas. Each type's own ratios are in planAccuracy.variants.
        return None
    # A correction measured under another basis does not hold for this spec.
    kept = status.correction if status.correction and status.correction.basis == basis(spec) else None
    verdict = _verdict(status)
    if verdict == "True":
        return None
    found = _ratios(status)
    if verdict != "False" or found is None:
        return kept.dump() if kept else None
    ratios, window = found
    if kept and (kept.window == window or not _moved(kept, ratios)):
        return kept.dump()
    factors = {s: math.sqrt(getattr(kept, s) * ratios[s]) if kept else ratios[s] for s in _SIGNALS}
    made = {**{s: round(f, 3) for s, f in factors.items()}, "window": window, "basis": basis(spec)}
    acceptance = {**((kept.acceptance if kept else None) or {}), **_observed_acceptance(status)}
    return made | ({ACCEPTANCE_KEY: acceptance} if acceptance else {})


def _observed_acceptance(status: InferenceServiceStatus) -> dict[str, float]:
    """The draft acceptance the engines reported under the plan's speculative mode, by mode. Kept
    once the plan leaves the mode (no new reports then), so that the choice it led to holds."""
    mode = status.plan.speculative if status.plan else None
    share = status.plan_accuracy.draft_acceptance if status.plan_accuracy else None
    observed = share.observed if share else None
    return {mode: observed} if mode not in (None, "off") and observed is not None else {}


def stale(status: InferenceServiceStatus, spec: InferenceServiceSpec) -> bool:
    """Whether the last status's verdict asks for another correction than the one in use: the
    service is worth re-planning (an event handler asks this of every status change)."""
    return correction(status, spec) != (status.correction.dump() if status.correction else None)


def factors(found: Mapping[str, Any] | None) -> Correction | None:
    """The correction for the planner."""
    if not found:
        return None
    acceptance = tuple(sorted((mode, float(a)) for mode, a in (found.get(ACCEPTANCE_KEY) or {}).items()))
    return Correction(float(found["ttft"]), float(found["tpot"]), acceptance)
