"""plan(spec, context) -> Plan: the search over devices, quantization schemes and tensor-parallel sizes."""

from __future__ import annotations

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning import planner
from kvpilot.operator.planning.context import Correction, PlanContext

__all__ = ["Correction", "Plan", "PlanContext", "plan"]


def plan(spec: InferenceServiceSpec, context: PlanContext | None = None) -> Plan:
    return planner.plan_with(spec, context or PlanContext())
