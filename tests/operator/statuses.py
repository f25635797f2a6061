"""The status a reconcile writes for the InferenceService ml/chat (controller/status.build), for
the tests of what reads or carries it (the CRD's schema, the autoscaler's loop)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.controller import status

WRITTEN_AT = datetime(2025, 1, 1, tzinfo=UTC)


def reconciled(
    spec: InferenceServiceSpec,
    result: Plan,
    old: Mapping[str, Any] | None = None,
    *,
    generation: int = 1,
    deployment: Mapping[str, Any] | None = None,
    now: datetime = WRITTEN_AT,
    **more: Any,
) -> dict[str, Any]:
    return status.build(
        name="chat",
        namespace="ml",
        generation=generation,
        plan=result,
        spec=spec,
        deployment=deployment,
        old=InferenceServiceStatus.model_validate(old or {}),
        now=now,
        **more,
    )
