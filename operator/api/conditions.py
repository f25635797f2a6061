"""Status conditions as Kubernetes writes them (type, status, reason, message,
lastTransitionTime, observedGeneration), shared by the reconcile (controller/status.py) and the
autoscaler's loop, which write different conditions of the same list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvpilot.operator.api.status import Condition

# Written by the autoscaler's loop (autoscaling/accuracy.py), carried over by every reconcile.
PLAN_ACCURATE = "PlanAccurate"


def with_transition_times(
    new: Sequence[Mapping[str, Any]], old: Sequence[Condition], now: datetime, generation: int
) -> list[dict[str, Any]]:
    """`new` stamped with `generation` and, from `old` (the status's), when each one's status last
    changed (now, where it changed or is new)."""
    before = {c.type: c for c in old}
    stamped = []
    for condition in new:
        previous = before.get(condition["type"])
        since = previous.last_transition_time if previous else None
        if previous is None or previous.status != condition["status"] or not since:
            since = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        stamped.append({**condition, "observedGeneration": generation, "lastTransitionTime": since})
    return stamped
