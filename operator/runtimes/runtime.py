"""What every runtime module declares."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.config import EngineCapabilities


@dataclass(frozen=True)
class Runtime:
    name: str
    capabilities: EngineCapabilities
    # The image a spec without spec.image runs; None: the operator's configured engine image.
    image: str | None
