"""The InferenceService status: conditions, plan summary and replica counts (pure).

Conditions follow the Kubernetes convention (type, status, reason, message, lastTransitionTime,
observedGeneration); lastTransitionTime only moves when a condition's status flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kvpilot.operator import sizing
from kvpilot.operator.planner import Plan
from kvpilot.operator.render import selector, service_url
from kvpilot.operator.spec import InferenceServiceSpec

CONDITION_TYPES = ("Planned", "Progressing", "Ready", "Degraded")


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan as the CRD's `status.plan` (camelCase, GiB for people reading `kubectl get -o`)."""
    summary: dict[str, Any] = {
        "fits": plan.fits,
        "reason": plan.reason,
        "gpu": plan.gpu,
        "quantization": plan.quantization,
        "speculative": plan.speculative,
        "weightsGiB": round(plan.weight_bytes / sizing.GiB, 2),
        "kvBytesPerToken": plan.kv_bytes_per_token,
        "kvPoolGiB": round(plan.kv_pool_bytes / sizing.GiB, 2),
        "kvBlocks": plan.kv_blocks,
        "maxModelLen": plan.max_model_len,
        "maxNumSeqs": plan.max_num_seqs,
        "maxNumBatchedTokens": plan.max_num_batched_tokens,
        "predictedTtftMs": plan.predicted_ttft_ms,
        "predictedTpotMs": plan.predicted_tpot_ms,
        "replicas": plan.replicas,
        "meetsSlo": plan.meets_slo,
        "reasons": dict(plan.reasons),
    }
    return {key: value for key, value in summary.items() if value is not None}


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason,
            "message": message}


def conditions(plan: Plan, spec: InferenceServiceSpec | None, desired: int,
               deployment: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Planned / Progressing / Ready / Degraded from the plan and the Deployment's status."""
    if not plan.fits:
        failure = plan.failure or "DoesNotFit"
        return [
            _condition("Planned", False, failure, plan.reason),
            _condition("Progressing", False, "NoDeployment", "nothing is rolled out: " + plan.reason),
            _condition("Ready", False, failure, plan.reason),
            _condition("Degraded", False, "NoDeployment", "no engine pods to degrade"),
        ]
    assert spec is not None  # a plan fits only for a valid spec
    observed = (deployment or {}).get("status", {})
    generation = (deployment or {}).get("metadata", {}).get("generation", 0)
    ready = int(observed.get("readyReplicas", 0))
    updated = int(observed.get("updatedReplicas", 0))
    current = (deployment is not None and observed.get("observedGeneration", 0) >= generation
               and updated >= desired and int(observed.get("replicas", 0)) == desired)
    counts = f"{ready}/{desired} replicas ready"
    slo = (f"predicted TTFT {plan.predicted_ttft_ms:g} ms (SLO {spec.slo.ttft_p95_ms:g}), "
           f"TPOT {plan.predicted_tpot_ms:g} ms (SLO {spec.slo.tpot_p95_ms:g})")

    if desired == 0:
        ready_condition = _condition("Ready", False, "ScaledToZero", "0 replicas requested")
    elif ready >= desired:
        ready_condition = _condition("Ready", True, "ReplicasReady", f"{counts}; {slo}")
    else:
        ready_condition = _condition("Ready", False, "ReplicasNotReady", counts)

    if not plan.meets_slo:
        degraded = _condition("Degraded", True, "SLOAtRisk", plan.reasons.get("replicas", slo))
    elif current and ready < desired:
        degraded = _condition("Degraded", True, "ReplicasUnavailable",
                              f"rollout finished but only {counts}")
    else:
        degraded = _condition("Degraded", False, "AsPlanned", slo)

    if not current:
        progressing = True, "RollingOut"
    elif ready < desired:
        progressing = True, "WaitingForReady"
    else:
        progressing = False, "RolloutComplete"
    return [
        _condition("Planned", True, "Planned", plan.reason),
        _condition("Progressing", *progressing, f"{updated}/{desired} replicas updated, {counts}"),
        ready_condition,
        degraded,
    ]


def with_transition_times(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]],
                          now: datetime, generation: int) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in old}
    stamped = []
    for condition in new:
        previous = before.get(condition["type"], {})
        since = previous.get("lastTransitionTime")
        if previous.get("status") != condition["status"] or not since:
            since = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        stamped.append({**condition, "observedGeneration": generation,
                        "lastTransitionTime": since})
    return stamped


def build(*, name: str, namespace: str, generation: int, plan: Plan, spec: InferenceServiceSpec | None,
          deployment: Mapping[str, Any] | None, old: Mapping[str, Any],
          now: datetime) -> dict[str, Any]:
    """The whole `status` to write."""
    desired = 0
    if plan.fits and spec is not None:
        desired = spec.replicas if spec.replicas is not None else plan.replicas
    observed = (deployment or {}).get("status", {})
    fresh = conditions(plan, spec, desired, deployment)
    return {
        "observedGeneration": generation,
        "replicas": int(observed.get("replicas", 0)),
        "readyReplicas": int(observed.get("readyReplicas", 0)),
        "desiredReplicas": desired,
        "selector": selector(name),
        # The Service exists whether or not the plan fits, so the address is stable from the start.
        "url": service_url(name, namespace),
        "plan": plan_summary(plan),
        # Predicted until the autoscaler reports what the engines measure.
        "latency": {"ttftP95Ms": plan.predicted_ttft_ms, "tpotP95Ms": plan.predicted_tpot_ms,
                    "source": "predicted"},
        "conditions": with_transition_times(fresh, old.get("conditions", []), now, generation),
    }
