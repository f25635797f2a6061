"""What a plan is made from besides the spec: the cluster's facts and the service's own record."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.engine.contract.device_profile import DeviceProfile
from kvpilot.operator.api.spec import Architecture
from kvpilot.operator.planning.model_config import ModelConfig


class Correction(NamedTuple):
    """What a service's engines showed of the plan (status.correction): observed / predicted p95
    TTFT and TPOT, and the draft acceptance per token by speculative mode; a mixed pool's factors
    per GPU type instead (`by_gpu`: catalog name, TTFT, TPOT), each type's own pods against its own
    plan, which `for_gpu` gives that type's plans."""

    ttft: float
    tpot: float
    acceptance: tuple[tuple[str, float], ...] = ()
    by_gpu: tuple[tuple[str, float, float], ...] = ()

    def for_gpu(self, gpu: str) -> Correction:
        """The correction of a mixed pool's plans on `gpu`: its own factors (none: the model's
        predictions as they are), the pool's draft acceptance."""
        ttft, tpot = next(((t, p) for name, t, p in self.by_gpu if name == gpu), (1.0, 1.0))
        return Correction(ttft, tpot, self.acceptance)


# A service whose engines have shown nothing yet: the model's predictions as they are.
NO_CORRECTION = Correction(1.0, 1.0)


@dataclass(frozen=True)
class PlanContext:
    """`available_gpus`: the GPU products the nodes carry, tried when the spec sets no type;
    `gpus_per_node`: the most GPUs one node of a product (or catalog name) carries, which bounds
    tensor parallelism (else the catalog's figure); `device_profiles`: the CPU profiles beside the
    built-in ones (or why one cannot be read); `correction`: what the service's engines showed,
    which the replicas are chosen with and the draft acceptance predicted with;
    `checkpoint`: the model's architecture as its checkpoint's config.json states it (read from
    the Hub, a claim or the engine image), used when the spec gives none and the catalog lacks the
    model; `draft_checkpoint`: serving.draftModel's config (its architecture and stored scheme),
    read the same way, used when neither serving.draftModelArchitecture nor the catalog give it;
    `capabilities`: another runtime's than the spec's (tests of what a runtime could run)."""

    available_gpus: tuple[str, ...] = ()
    gpus_per_node: Mapping[str, int] = field(default_factory=dict)
    device_profiles: Mapping[str, DeviceProfile | str] = field(default_factory=dict)
    correction: Correction | None = None
    checkpoint: Architecture | None = None
    draft_checkpoint: ModelConfig | None = None
    capabilities: EngineCapabilities | None = None
