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
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.api.conditions import PLAN_ACCURATE
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning.context import Correction

STATUS_KEY = "correction"
ACCURACY_KEY = "planAccuracy"
ACCEPTANCE_KEY = "acceptance"
# A window's ratio this close to the factor in use changes nothing (no re-plan, no write).
CHANGE = 0.1
_SIGNALS = ("ttft", "tpot")


def basis(spec: InferenceServiceSpec) -> str:
    """What a step's speed depends on: the factor measured under one of these holds only for it."""
    fields = spec.model_dump(mode="json", include={"model", "accelerator", "serving", "runtime", "image"})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _verdict(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == PLAN_ACCURATE), {})


def _ratios(status: Mapping[str, Any]) -> tuple[dict[str, float], str] | None:
    """The last window's observed / predicted per signal (1 where the window had none) and its time."""
    accuracy = status.get(ACCURACY_KEY) or {}
    entries = {s: accuracy[s] for s in _SIGNALS if isinstance(accuracy.get(s), Mapping) and accuracy[s].get("ratio")}
    if not entries:
        return None
    window = max(str(e.get("time", "")) for e in entries.values())
    return {s: float(entries[s]["ratio"]) if s in entries else 1.0 for s in _SIGNALS}, window


def _moved(kept: Mapping[str, Any], ratios: Mapping[str, float]) -> bool:
    return any(abs(ratios[s] / float(kept[s]) - 1) > CHANGE for s in _SIGNALS)


def correction(status: Mapping[str, Any], spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The correction to plan `spec` with (and to write as status.correction), from the last status."""
    if spec.autoscaling.mode != "slo":
        return None
    kept = status.get(STATUS_KEY)
    if not isinstance(kept, Mapping) or kept.get("basis") != basis(spec):
        kept = None
    verdict = _verdict(status)
    if verdict.get("status") == "True":
        return None
    found = _ratios(status)
    if verdict.get("status") != "False" or found is None:
        return dict(kept) if kept else None
    ratios, window = found
    if kept and (kept.get("window") == window or not _moved(kept, ratios)):
        return dict(kept)
    factors = {s: math.sqrt(float(kept[s]) * ratios[s]) if kept else ratios[s] for s in _SIGNALS}
    made = {**{s: round(f, 3) for s, f in factors.items()}, "window": window, "basis": basis(spec)}
    acceptance = {**((kept or {}).get(ACCEPTANCE_KEY) or {}), **_observed_acceptance(status)}
    return made | ({ACCEPTANCE_KEY: acceptance} if acceptance else {})


def _observed_acceptance(status: Mapping[str, Any]) -> dict[str, float]:
    """The draft acceptance the engines reported under the plan's speculative mode, by mode. Kept
    once the plan leaves the mode (no new reports then), so that the choice it led to holds."""
    mode = (status.get("plan") or {}).get("speculative")
    observed = ((status.get(ACCURACY_KEY) or {}).get("draftAcceptance") or {}).get("observed")
    return {mode: float(observed)} if mode not in (None, "off") and observed is not None else {}


def stale(status: Mapping[str, Any], spec: InferenceServiceSpec) -> bool:
    """Whether the last status's verdict asks for another correction than the one in use: the
    service is worth re-planning (an event handler asks this of every status change)."""
    return correction(status, spec) != (dict(status[STATUS_KEY]) if status.get(STATUS_KEY) else None)


def factors(found: Mapping[str, Any] | None) -> Correction | None:
    """The correction for the planner."""
    if not found:
        return None
    acceptance = tuple(sorted((mode, float(a)) for mode, a in (found.get(ACCEPTANCE_KEY) or {}).items()))
    return Correction(float(found["ttft"]), float(found["tpot"]), acceptance)
