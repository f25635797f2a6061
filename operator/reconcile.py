"""One reconciliation of an InferenceService: plan, render, converge the children, report status.

Level-triggered and idempotent: it derives everything from the object as it is now, so create,
update, resume and the periodic resync all run the same function, a child deleted by hand comes
back on the next run, and a restarted operator converges on the objects it already made.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from kvpilot.operator import render, status
from kvpilot.operator.cluster import Cluster
from kvpilot.operator.planner import Plan, plan
from kvpilot.operator.spec import InferenceServiceSpec


def _invalid(body: Mapping[str, Any], error: ValidationError) -> Plan:
    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    return Plan(fits=False, failure="InvalidSpec", reason=f"invalid spec: {problems}",
                model=str(body.get("spec", {}).get("model", {}).get("name", "")))


def reconcile(body: Mapping[str, Any], cluster: Cluster, now: datetime, *,
              default_image: str = render.DEFAULT_ENGINE_IMAGE) -> dict[str, Any]:
    """Converge the children of `body` and return the status to write; `default_image` is the
    engine image for specs that do not set one."""
    metadata = body["metadata"]
    name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
    spec: InferenceServiceSpec | None
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec", {}))
    except ValidationError as error:
        spec, result = None, _invalid(body, error)
    else:
        products = cluster.gpu_products() if not spec.accelerator.type else []
        result = plan(spec, products)

    wanted = (render.children(name, namespace, uid, spec, result, default_image=default_image)
              if spec is not None else [])
    for manifest in wanted:
        cluster.apply(manifest)
    if not result.fits:
        # A plan that cannot work must not leave engine pods crash-looping on the old one.
        cluster.delete("apps/v1", "Deployment", namespace, name)

    deployment = cluster.get("apps/v1", "Deployment", namespace, name) if result.fits else None
    return status.build(name=name, namespace=namespace, generation=int(metadata.get("generation", 0)), plan=result,
                        spec=spec, deployment=deployment, old=body.get("status") or {}, now=now)
