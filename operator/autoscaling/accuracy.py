"""How far the plan's predictions are from what the engines measure (pure): `status.planAccuracy`
and the `PlanAccurate` condition, written by the autoscaler's loop every period it writes.

`planAccuracy` holds, per signal, the plan's predicted p95 (status.plan), the p95 the engines
reported over the autoscaler's window, their ratio (observed / predicted) and the requests behind
it; and the draft acceptance and prefix share the plan assumed beside the observed ones (shown, not
judged: a prefix share far from the assumed one explains a TTFT ratio), and the KV blocks the plan
predicted beside the fewest an engine allocated (`kvBlocks`: vLLM measures its own pool from
--gpu-memory-utilization, so this is where a wrong memory model shows), and the time to ready the
plan predicted beside the newest ready pod's (`readySeconds`: from the pod's start, so its image
pull counts, its scheduling does not). A mixed pool adds `variants`: each GPU type's own plan's
p95s beside its own pods' (variant_windows), and its share of the requests beside its share of
the pool's planned capacity: the gateway's split by capacity, measured. PlanAccurate judges a
mixed pool by these ratios, each type's own (its pool-wide p95s stay shown). A p95 counts only from a
window of at least MIN_OBSERVATIONS requests (a p95 of a few is mostly their maximum, as for the
autoscaler's own decisions).

PlanAccurate:
- Unknown (`NoPrediction`) while the plan predicts no latency, (`NoObservations`) until a window
  has enough requests;
- False (`OutsideBand`) once a ratio has stayed outside BAND for SUSTAIN_PERIODS periods in a row
  (a period without enough requests, or with every ratio inside, ends the run): a burst that moves
  one window's p95 is not a wrong plan;
- True (`WithinBand`) as soon as every ratio of a window is inside again; while a run outside is
  shorter than SUSTAIN_PERIODS the condition keeps its status, reason `BriefExcursion`;
- a period without enough requests says nothing new: the condition stays as it was.
The message always carries the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kvpilot.operator.api.conditions import PLAN_ACCURATE, with_transition_times
from kvpilot.operator.api.status import Condition, InferenceServiceStatus, PlanAccuracy, PlanStatus, VariantStatus
from kvpilot.operator.autoscaling.decisions import MIN_OBSERVATIONS, Signals
from kvpilot.operator.autoscaling.variant_windows import VariantSignals
from kvpilot.operator.kube.events import iso, seconds_of

STATUS_KEY = "planAccuracy"
# Observed / predicted p95 within this band is a plan that holds: the planner works from datasheet
# numbers and a roofline, so a factor of two either way is what it promises, not a tenth.
BAND = (0.5, 2.0)
# Periods in a row outside the band before PlanAccurate goes False: two windows (2 min at the
# default 15 s period), so one burst that fills a window does not count, and the time follows
# `kvpilot operator --autoscale-interval`.
SUSTAIN_PERIODS = 8
# (status key, also PlanAccuracy's field; the plan's predicted field, the signal's p95, the requests behind it)
_SIGNALS = (
    ("ttft", "predicted_ttft_ms", "ttft_p95_seconds", "ttft_observations"),
    ("tpot", "predicted_tpot_ms", "tpot_p95_seconds", "tpot_observations"),
)
# (status key; PlanAccuracy's field, also the observed signal; the plan's assumed field; its name in the message)
_SHARES = (
    ("draftAcceptance", "draft_acceptance", "assumed_draft_acceptance", "draft acceptance"),
    ("prefixShare", "prefix_share", "assumed_prefix_share", "prefix share"),
)


def _kv_blocks_entry(predicted: int | None, observed: int | None, last: int | None) -> dict[str, Any] | None:
    """The plan's KV blocks beside the engines' (the `last` observed stays while none reports)."""
    seen = last if observed is None else observed
    if not predicted or seen is None:
        return None
    return {"predicted": predicted, "observed": seen, "ratio": round(seen / predicted, 3)}


def newest_ready_seconds(pods: Sequence[Mapping[str, Any]]) -> tuple[str, float] | None:
    """(name, seconds from its start to Ready) of the ready engine pod that started last; None
    when no pod is ready (or none says when)."""
    started = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        if ready and ready.get("status") == "True" and status.get("startTime") and ready.get("lastTransitionTime"):
            start, at = seconds_of(status["startTime"]), seconds_of(ready["lastTransitionTime"])
            started.append((start, pod["metadata"]["name"], max(0.0, at - start)))
    if not started:
        return None
    _, name, seconds = max(started)
    return name, seconds


def _ready_entry(predicted: float | None, observed: tuple[str, float] | None, last: Any) -> dict[str, Any] | None:
    """The plan's time to ready beside the newest pod's (the `last` observed stays while no pod is ready)."""
    if not predicted:
        return None
    if observed is None:
        return last.dump() if last is not None and last.predicted == predicted else None
    pod, seconds = observed
    return {"predicted": predicted, "observed": round(seconds, 1), "ratio": round(seconds / predicted, 3), "pod": pod}


def comparison(predicted_ms: float | None, observed_seconds: float | None, requests: int) -> dict[str, Any] | None:
    """One signal's predicted and observed p95 and their ratio; None when either is missing or
    the window holds too few requests to judge."""
    if not predicted_ms or predicted_ms <= 0 or observed_seconds is None or requests < MIN_OBSERVATIONS:
        return None
    observed_ms = observed_seconds * 1000
    return {
        "predictedMs": predicted_ms,
        "observedMs": round(observed_ms, 1),
        "ratio": round(observed_ms / predicted_ms, 3),
        "requests": requests,
    }


def _variant_entry(
    row: VariantStatus, seen: VariantSignals, started: int, planned: float | None, last: Any, now: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One GPU type's predictions beside its pods' p95s (the last judged window stays while this
    one holds too few requests, beside the same prediction), and its shares; and the comparisons
    this window judged."""
    entry: dict[str, Any] = {"gpu": row.gpu, "variant": row.label}
    if row.capacity_class:
        entry["capacityClass"] = row.capacity_class
    judged = []
    for field, predicted, p95, requests in _SIGNALS:
        fresh = comparison(getattr(row, predicted), getattr(seen, p95), getattr(seen, requests))
        kept = getattr(last, field) if last is not None else None
        if fresh is not None:
            entry[field] = {**fresh, "time": iso(now)}
            judged.append(fresh)
        elif kept is not None and kept.predicted_ms == getattr(row, predicted):
            entry[field] = kept.dump()
    if planned is not None:
        entry["plannedShare"] = round(planned, 3)
    if started:
        entry["observedShare"] = round(seen.ttft_observations / started, 3)
        entry["requests"] = seen.ttft_observations
    elif last is not None and last.observed_share is not None:
        entry["observedShare"], entry["requests"] = last.observed_share, last.requests
    return entry, judged


def variant_entries(
    status: InferenceServiceStatus, signals: Signals, now: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """A mixed pool's planAccuracy.variants: each type (status.variants, cheapest first) with its
    own plan's predicted p95s beside its own pods' (signals.variants, by variant label), and its
    share of the requests started in the window beside its share of the pool's planned capacity
    (replicas x capacityRps); and the comparisons this window judged, every type's. None for a
    service of one GPU type."""
    rows = [row for row in status.variants or [] if row.gpu]
    if len(rows) < 2:
        return None
    old = status.plan_accuracy.variants if status.plan_accuracy and status.plan_accuracy.variants else []
    last = {entry.variant: entry for entry in old}
    capacity = {row.label: (row.replicas or 0) * (row.capacity_rps or 0.0) for row in rows}
    pool = sum(capacity.values())
    started = sum(seen.ttft_observations for seen in signals.variants.values())
    made = [
        _variant_entry(
            row,
            signals.variants.get(key := row.label, VariantSignals()),
            started,
            capacity[key] / pool if pool > 0 else None,
            last.get(key),
            now,
        )
        for row in rows
    ]
    return [entry for entry, _ in made], [window for _, judged in made for window in judged]


def _variant_numbers(entries: Sequence[Mapping[str, Any]]) -> str:
    """Each type's p95s and share, for PlanAccurate's message."""
    parts = []
    for entry in entries:
        said = [
            f"p95 {key.upper()} {window['observedMs']:g}/{window['predictedMs']:g} ms"
            for key, _, _, _ in _SIGNALS
            if (window := entry.get(key))
        ]
        if "observedShare" in entry:
            said.append(f"{entry['observedShare']:.0%} of requests (planned {entry.get('plannedShare', 0):.0%})")
        if said:
            where = f"{entry['gpu']}@{entry['capacityClass']}" if "capacityClass" in entry else entry["gpu"]
            parts.append(f"{where}: {', '.join(said)}")
    return "; ".join(parts)


def _inside(entry: Mapping[str, Any]) -> bool:
    return BAND[0] <= entry["ratio"] <= BAND[1]


def _numbers(block: Mapping[str, Any]) -> str:
    parts = [
        f"p95 {key.upper()} observed {entry['observedMs']:g} ms / predicted {entry['predictedMs']:g} ms = "
        f"{entry['ratio']:.2f}x ({entry['requests']} requests in the {block['windowSeconds']:g} s window of "
        f"{entry['time']})"
        for key, _, _, _ in _SIGNALS
        if (entry := block.get(key))
    ]
    text = "; ".join(parts) + f"; band [{BAND[0]:g}, {BAND[1]:g}]"
    for key, _, _, words in _SHARES:
        if share := block.get(key):
            observed, assumed = share.get("observed"), share.get("assumed")
            text += (
                f"; {words} observed {'none' if observed is None else f'{observed:.2f}'}, "
                f"assumed {'none' if assumed is None else f'{assumed:.2f}'}"
            )
    if blocks := block.get("kvBlocks"):
        text += f"; KV blocks allocated {blocks['observed']}, predicted {blocks['predicted']} ({blocks['ratio']:.2f}x)"
    if ready := block.get("readySeconds"):
        text += f"; ready in {ready['observed']:g} s ({ready['pod']}), predicted {ready['predicted']:g} s"
    if by_type := _variant_numbers(block.get("variants") or []):
        text += f"; by GPU type: {by_type}"
    return text


def _verdict(block: Mapping[str, Any], judged: bool, predicts: bool, old: Condition | None) -> tuple[str, str, str]:
    """(status, reason, message) of PlanAccurate."""
    if not predicts:
        return (
            "Unknown",
            "NoPrediction",
            "status.plan predicts no latency (no plan yet, or it does not fit): nothing to compare",
        )
    if not judged:
        if old is not None:
            return old.status, old.reason or "", old.message or ""
        return (
            "Unknown",
            "NoObservations",
            f"no window of {block['windowSeconds']:g} s has held {MIN_OBSERVATIONS} requests yet",
        )
    periods = block.get("outsidePeriods", 0)
    numbers = _numbers(block)
    if not periods:
        return "True", "WithinBand", f"within the band: {numbers}"
    if periods >= SUSTAIN_PERIODS or (old is not None and old.status == "False"):
        return (
            "False",
            "OutsideBand",
            f"outside the band for {periods} periods since {block['outsideSince']}: {numbers}",
        )
    status = "Unknown" if old is None else old.status
    return (
        status,
        "BriefExcursion",
        f"outside the band for {periods} of the {SUSTAIN_PERIODS} periods in a row that make it inaccurate: {numbers}",
    )


def _block(
    status: InferenceServiceStatus,
    signals: Signals,
    window_seconds: float,
    now: float,
    ready: tuple[str, float] | None,
) -> tuple[dict[str, Any], bool]:
    """The new planAccuracy, and whether this window judged any signal."""
    plan = status.plan or PlanStatus()
    old = status.plan_accuracy or PlanAccuracy()
    against = ((getattr(old, key), getattr(plan, predicted)) for key, predicted, _, _ in _SIGNALS)
    if any(window and window.predicted_ms != value for window, value in against):
        old = PlanAccuracy()  # judged against another plan's predictions: start again
    block: dict[str, Any] = {"windowSeconds": window_seconds, "band": list(BAND)}
    fresh = {}
    for key, predicted, p95, requests in _SIGNALS:
        entry = comparison(getattr(plan, predicted), getattr(signals, p95), getattr(signals, requests))
        if entry is not None:
            fresh[key] = block[key] = {**entry, "time": iso(now)}
        elif last := getattr(old, key):  # nothing new to judge: the last judged window stays
            block[key] = last.dump()
    judged = list(fresh.values())
    if by_type := variant_entries(status, signals, now):
        # A mixed pool is judged type by type: its merged p95 against the first type's predictions
        # measures the pool's mix, not a plan.
        block["variants"], judged = by_type
    if judged and not all(_inside(entry) for entry in judged):
        block["outsidePeriods"] = (old.outside_periods or 0) + 1
        block["outsideSince"] = old.outside_since or iso(now)
    for key, field, assumed, _ in _SHARES:
        observed, last_share = getattr(signals, field), getattr(old, field)
        share = {
            "assumed": getattr(plan, assumed),
            "observed": (last_share.observed if last_share else None) if observed is None else round(observed, 3),
        }
        # Shown where something was observed, or the plan assumes a share (an assumed 0 alone says nothing).
        if share["observed"] is not None or share["assumed"]:
            block[key] = {name: value for name, value in share.items() if value is not None}
    # The last observed pool stays only beside the plan that predicted it (another plan's pool is another).
    last_blocks = old.kv_blocks if old.kv_blocks and old.kv_blocks.predicted == plan.kv_blocks else None
    if blocks := _kv_blocks_entry(plan.kv_blocks, signals.kv_blocks, last_blocks.observed if last_blocks else None):
        block["kvBlocks"] = blocks
    if ready_entry := _ready_entry(plan.predicted_ready_seconds, ready, old.ready_seconds):
        block["readySeconds"] = ready_entry
    return block, bool(judged)


def accuracy_patch(
    status: InferenceServiceStatus,
    signals: Signals,
    window_seconds: float,
    now: float,
    generation: int,
    ready: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """The status fields a period writes for the plan's accuracy: `planAccuracy`, and the
    conditions with PlanAccurate replaced (a merge patch replaces a list whole); `ready`: the
    newest ready pod's time to ready (newest_ready_seconds)."""
    block, judged = _block(status, signals, window_seconds, now, ready)
    plan = status.plan or PlanStatus()
    predicts = any((getattr(plan, predicted) or 0) > 0 for _, predicted, _, _ in _SIGNALS)
    conditions = status.conditions or []
    state, reason, message = _verdict(block, judged, predicts, status.condition(PLAN_ACCURATE))
    condition = {"type": PLAN_ACCURATE, "status": state, "reason": reason, "message": message}
    stamped = with_transition_times([condition], conditions, datetime.fromtimestamp(now, UTC), generation)
    return {
        STATUS_KEY: block,
        "conditions": [*(c.dump() for c in conditions if c.type != PLAN_ACCURATE), *stamped],
    }
