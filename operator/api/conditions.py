"""Status conditions as Kubernetes writes them (type, status, reason, message,
lastTransitionTime, observedGeneration), shared by the reconcile (controller/status.py) and the
autoscaler's loop, which write different conditions of the same list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# Written by the autoscaler's loop (autoscaling/accuracy.py), carried over by every reconcile.
PLAN_ACCURATE = "PlanAccurate"


def with_transition_times(
    new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]], now: datetime, generation: int
) -> list[dict[str, Any]]:
    """`new` stamped with `generation` and, from `old`, when each one's status last changed
    (now, where it changed or is new)."""
    before = {c.get("type"): c for c in old}
    stamped = []
    for condition in new:
        previous = before.get(condition["type"], {})
        since = previous.get("lastTransitionTime")
        if previous.get("status") != condition["status"] or not since:
            since = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        stamped.append({**condition, "observedGeneration": generation, "lastTransitionTime": since})
    return stamped
