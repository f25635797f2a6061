"""The runtimes an InferenceService can run on, one module each, and what each runs (torch-free).

A runtime declares its capabilities (what the planner may choose among) and how a plan becomes its
pod; adding a runtime is adding one module here and naming it in RUNTIMES. Depends on api/ and the
engine's torch-free contract only, so that planning can read the capabilities.
"""

from __future__ import annotations

from kvpilot.operator.runtimes import kvpilot, vllm
from kvpilot.operator.runtimes.runtime import Runtime

RUNTIMES: dict[str, Runtime] = {runtime.name: runtime for runtime in (kvpilot.RUNTIME, vllm.RUNTIME)}
