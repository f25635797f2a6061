"""What every runtime module declares: what it runs, and how a plan becomes its container."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec


@dataclass(frozen=True)
class Launch:
    """What a runtime's arguments are rendered from: the spec, its plan, and what the pod around the
    engine decided (where it holds the files, how long it drains, where a CPU engine caches kernels)."""

    spec: InferenceServiceSpec
    plan: Plan
    model: str  # where the pod holds the model's files
    draft_model: str | None
    float16: bool  # the GPU has no bf16 arithmetic
    drain_seconds: int
    compile_cache_dir: str


@dataclass(frozen=True)
class Runtime:
    name: str
    capabilities: EngineCapabilities
    # The image a spec without spec.image runs; None: the operator's configured engine image.
    image: str | None
    command: tuple[str, ...]
    # The arguments carrying the plan's numbers; raises (ValueError) on a plan the runtime would refuse.
    args: Callable[[Launch], list[str]]
    # Answers 200 once the model is loaded (startup and readiness probes); `/health` is liveness.
    ready_path: str
    # Where the runtime reads the API key it requires on /v1 (its /metrics and probes stay open).
    api_key_env: str
    # Variables the container always gets, before the API key and the spec's own.
    env: tuple[tuple[str, str], ...] = ()
    # Variables it gets only when the plan has adapter slots (a service without adapters keeps its pod
    # template, so an operator upgrade that adds one rolls no pod).
    lora_env: tuple[tuple[str, str], ...] = ()
    # Whether its image has `kvpilot download` (else the downloads run in the operator's engine image).
    ships_downloader: bool = True
    # The models its image carries, loaded by name with no files of the pod's (case-insensitive); any
    # other model is files the pod is given: without model.source, the Hub repository model.name stands
    # for (planning/sources.py).
    builtin_models: tuple[str, ...] = ()
    # Whether it serves LoRA adapters (spec.adapters) with `--enable-lora --max-loras --max-lora-rank
    # --max-cpu-loras`.
    lora: bool = False
    # The speculative modes it runs beside adapters.
    lora_speculative: tuple[str, ...] = ()
