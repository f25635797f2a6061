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
A mixed pool (accelerator.variants) gets factors per GPU type (`byGpu`), each from that type's own
pods against its own plan (planAccuracy.variants), which re-plan that type's variants only.
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


# The key of a service of one GPU type's factors among a mixed pool's (by GPU type).
_POOL = ""
# Factors per key (_POOL, or a GPU type): signal -> observed / predicted.
Factors = dict[str, dict[str, float]]


def _window_ratios(windows: Mapping[str, LatencyWindow | None]) -> tuple[dict[str, float], str] | None:
    """The windows' observed / predicted per signal (1 where a window had none) and the last one's time."""
    ratios = {s: entry.ratio for s, entry in windows.items() if entry and entry.ratio}
    if not ratios:
        return None
    window = max(entry.time or "" for s, entry in windows.items() if entry and s in ratios)
    return {s: ratios.get(s, 1.0) for s in _SIGNALS}, window


def _ratios(status: InferenceServiceStatus, mixed: bool) -> dict[str, tuple[dict[str, float], str]]:
    """The last judged windows' ratios and times, the pool's or (a mixed pool) each GPU type's
    against its own plan. A type on two capacity classes runs one plan: the class whose pods served
    more requests speaks for it."""
    accuracy = status.plan_accuracy
    if accuracy is None:
        return {}
    if not mixed or not accuracy.variants:
        # A pool of one type (planAccuracy.variants lists two or more) is judged as a service of one.
        key = str(status.plan.gpu) if mixed and status.plan and status.plan.gpu else _POOL
        found = _window_ratios({s: getattr(accuracy, s) for s in _SIGNALS})
        return {key: found} if found and (key or not mixed) else {}
    by_gpu = {}
    for row in sorted(accuracy.variants, key=lambda row: row.requests or 0):
        if row.gpu and (found := _window_ratios({s: getattr(row, s) for s in _SIGNALS})):
            by_gpu[row.gpu] = found
    return by_gpu


def _kept_factors(kept: KeptCorrection) -> Factors:
    if kept.by_gpu is not None:
        return {row.gpu or "": {s: getattr(row, s) or 1.0 for s in _SIGNALS} for row in kept.by_gpu}
    return {_POOL: {s: getattr(kept, s) or 1.0 for s in _SIGNALS}}


def _moved(kept: Factors, ratios: Factors) -> bool:
    return any(
        key not in kept or abs(found[s] / kept[key][s] - 1) > CHANGE for key, found in ratios.items() for s in _SIGNALS
    )


def _smoothed(kept: Factors, ratios: Factors) -> Factors:
    """Each factor half-way (in log space) from the kept one to the window's ratio; a GPU type this
    window did not judge keeps its own."""
    made = {key: dict(factors) for key, factors in kept.items()}
    for key, found in ratios.items():
        made[key] = {s: math.sqrt(kept[key][s] * found[s]) if key in kept else found[s] for s in _SIGNALS}
    return {key: {s: round(f, 3) for s, f in factors.items()} for key, factors in made.items()}


def correction(status: InferenceServiceStatus, spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The correction to plan `spec` with (and to write as status.correction), from the last status:
    a mixed pool's by GPU type, each from its own pods against its own plan (planAccuracy.variants),
    since the pool's merged p95 against its cheapest type's predictions is no factor for each type:
    applied to all it re-ranked them (an L4's capacity fell 75x where an H100's fell 18x)."""
    if spec.autoscaling.mode != "slo":
        return None
    # A correction measured under another basis does not hold for this spec.
    kept = status.correction if status.correction and status.correction.basis == basis(spec) else None
    verdict = _verdict(status)
    if verdict == "True":
        return None
    mixed = bool(spec.accelerator.variants)
    found = _ratios(status, mixed)
    if verdict != "False" or not found:
        return kept.dump() if kept else None
    # Only windows after the kept one move it: planAccuracy keeps a type's last window while newer
    # ones judge the others, and that ratio is in its factor already.
    since = (kept.window or "") if kept else ""
    ratios = {key: found_ratios for key, (found_ratios, when) in found.items() if when > since}
    old = _kept_factors(kept) if kept else {}
    if kept and (not ratios or not _moved(old, ratios)):
        return kept.dump()
    factors, window = _smoothed(old, ratios), max(when for _, when in found.values())
    if mixed:
        made: dict[str, Any] = {"byGpu": [{"gpu": gpu, **f} for gpu, f in sorted(factors.items())]}
    else:
        made = dict(factors[_POOL])
    made |= {"window": window, "basis": basis(spec)}
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
    by_gpu = tuple((row["gpu"], float(row["ttft"]), float(row["tpot"])) for row in found.get("byGpu") or [])
    return Correction(float(found.get("ttft", 1.0)), float(found.get("tpot", 1.0)), acceptance, by_gpu)
