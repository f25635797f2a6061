"""The Events a mixed pool's reconcile posts when a GPU type's replicas change, each naming the type
and why: the cost ranking (cheapest per req/s first, dearest first to go), a type whose nodes are
full, or a type no longer in the pool. The autoscaler's ScaledUp/ScaledDown say why the total moved;
these say where it went."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator.api.names import VARIANT_LABEL
from kvpilot.operator.api.plan import MixedPlan
from kvpilot.operator.kube.events import EVENT_COMPONENT, scaling_event

REASON = "VariantScaled"


def variant_replicas(deployments: Iterable[Mapping[str, Any] | None]) -> dict[str, tuple[str, int]]:
    """A pool's Deployments by their variant label (the GPU type, lower case, and its capacity
    class: l4, l4-spot): (name, replicas)."""
    found = {}
    for d in deployments:
        label = (d["metadata"].get("labels") or {}).get(VARIANT_LABEL) if d is not None else None
        if d is not None and label:
            found[label] = (d["metadata"]["name"], int((d.get("spec") or {}).get("replicas") or 0))
    return found


def why(mixed: MixedPlan | None, label: str, grew: bool, full: Mapping[str, tuple[int, str]]) -> str:
    """Why the variant labelled `label` got more (`grew`) or fewer replicas; `full` by Variant.key.
    A variant of a capacity class is named with it (L4@spot): its nodes, price and rank are its own."""
    variants = mixed.variants if mixed is not None and mixed.fits else []
    rank, found = next(((i, v) for i, v in enumerate(variants) if v.label == label), (0, None))
    if found is None:
        return "its GPU type is no longer in spec.accelerator.variants (or, for type *, on the nodes)"
    if found.key in full:
        held, since = full[found.key]
        return f"its nodes took {held} (no free {found.key} since {since}); the rest go to the next type"
    cost = f"${found.cost_per_rps_hour:.3g}/h per req/s" if found.cost_per_rps_hour is not None else "misses the SLO"
    place = f"{found.key} is type {rank + 1} of {len(variants)} by cost per req/s ({cost})"
    if grew:
        return f"{place}: the cheapest with room take the load first (at most {found.max_replicas} of it)"
    return f"{place}: fewer replicas wanted, the dearest go first"


def variant_events(
    body: Mapping[str, Any],
    mixed: MixedPlan | None,
    before: Mapping[str, tuple[str, int]],
    after: Mapping[str, tuple[str, int]],
    full: Mapping[str, tuple[int, str]],
    at: float,
) -> list[dict[str, Any]]:
    """An Event for each pool Deployment whose replicas went from `before` to `after` (a new one
    from 0)."""
    events = []
    for label in sorted(after):
        deployment, now = after[label]
        was = before.get(label, (deployment, 0))[1]
        if was != now:
            message = f"{deployment}: {was} -> {now} replicas: {why(mixed, label, now > was, full)}"
            events.append(scaling_event(body, REASON, message, at, EVENT_COMPONENT))
    return events
