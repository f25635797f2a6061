"""kvpilot's own engine: `kvpilot serve`, its capabilities declared by the engine (engine/config.py)."""

from __future__ import annotations

from kvpilot.engine.config import CAPABILITIES
from kvpilot.operator.runtimes.runtime import Runtime

RUNTIME = Runtime(name="kvpilot", capabilities=CAPABILITIES, image=None)
