"""Where the gateway sends a request: the InferenceService a model name addresses, and the engine
among its ready pods. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def served_model(service: Mapping[str, Any]) -> str | None:
    model = (service.get("spec") or {}).get("model") or {}
    return model.get("servedModelName") or model.get("name")


def route(model: str, services: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(namespace, name) of the InferenceService serving `model`; LookupError with what a client
    can act on when none or several do."""
    matches = sorted(
        (s["metadata"]["namespace"], s["metadata"]["name"])
        for s in services
        if served_model(s) == model and not s["metadata"].get("deletionTimestamp")
    )
    if not matches:
        served = sorted({m for s in services if (m := served_model(s))})
        raise LookupError(f"The model `{model}` does not exist; served here: {', '.join(served) or 'none'}")
    if len(matches) > 1:
        raise LookupError(
            f"The model `{model}` is served by several InferenceServices "
            f"({', '.join('/'.join(m) for m in matches)}): give them distinct servedModelName"
        )
    return matches[0]


def choose(
    urls: Sequence[tuple[str, str]], in_flight: Mapping[str, int], refused_until: Mapping[str, float], now: float
) -> str | None:
    """The base URL with the fewest requests in flight among those not refused lately (None: no
    engine to try now)."""
    candidates = [url for _, url in urls if refused_until.get(url, 0.0) <= now]
    return min(candidates, key=lambda url: in_flight.get(url, 0), default=None)
