"""What every part of the planner says the same way: sizes in GiB, times in ms, lists, and a failed Plan."""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.replica import Sizes


def gib(n: float) -> str:
    return f"{n / sizing.GiB:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def failed_plan(spec: InferenceServiceSpec, failure: str, reason: str, sizes: Sizes | None = None) -> Plan:
    return Plan(
        fits=False,
        failure=failure,
        reason=reason,
        model=spec.model.name,
        runtime=spec.runtime,
        block_size=spec.serving.block_size,
        gpu_memory_utilization=spec.serving.gpu_memory_utilization,
        **(sizes.reported() if sizes else {}),
    )


def rejected_because(option: Plan) -> str:
    """Why an option tried before the chosen one lost: why it does not fit, else its replicas' reason
    (the SLO it misses)."""
    return option.reasons["replicas"] if option.fits else option.reason


def listed(options: Iterable[str]) -> str:
    return ", ".join(options) or "nothing"
