"""The InferenceService status: conditions, plan summary and replica counts (pure).

Conditions follow the Kubernetes convention (type, status, reason, message, lastTransitionTime,
observedGeneration); lastTransitionTime only moves when a condition's status flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from kvpilot.operator.api.conditions import PLAN_ACCURATE, with_transition_times
from kvpilot.operator.api.names import API_KEY_SHA256, selector, service_url, variant_deployment
from kvpilot.operator.api.plan import MixedPlan, Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus, InspectedCheckpoint, LastGoodPlan, PlanAccuracy
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.gpus import LIST_PRICE_PER_GPU_HOUR
from kvpilot.operator.planning.variants import price_per_gpu_hour

CONDITION_TYPES = ("Planned", "Progressing", "Ready", "Degraded")


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan as the CRD's `status.plan` (camelCase, GiB for people reading `kubectl get -o`)."""
    summary: dict[str, Any] = {
        "fits": plan.fits,
        "reason": plan.reason,
        "runtime": plan.runtime,
        "gpu": plan.gpu,
        "gpuCount": plan.gpu_count,
        "deviceProfile": plan.device_profile,
        "cpus": plan.cpus or None,
        "compileDecode": plan.compile_decode or None,
        "quantization": plan.quantization,
        "speculative": plan.speculative,
        "assumedDraftAcceptance": plan.assumed_draft_acceptance,
        "assumedPrefixShare": plan.assumed_prefix_share,
        "weightsGiB": round(plan.weight_bytes / sizing.GiB, 2),
        "kvBytesPerToken": plan.kv_bytes_per_token,
        "kvCacheDtype": plan.kv_cache_dtype,
        "kvPoolGiB": round(plan.kv_pool_bytes / sizing.GiB, 2),
        "kvBlocks": plan.kv_blocks,
        "maxModelLen": plan.max_model_len,
        "maxNumSeqs": plan.max_num_seqs,
        "maxNumBatchedTokens": plan.max_num_batched_tokens,
        "predictedTtftMs": plan.predicted_ttft_ms,
        "predictedTpotMs": plan.predicted_tpot_ms,
        "capacityRps": plan.capacity_rps,
        "predictedReadySeconds": plan.predicted_ready_s,
        "replicas": plan.replicas,
        "meetsSlo": plan.meets_slo,
        "reasons": dict(plan.reasons),
    }
    return {key: value for key, value in summary.items() if value is not None}


def _desired(
    plan: Plan,
    spec: InferenceServiceSpec | None,
    deployment: Mapping[str, Any] | None,
    variants: list[dict[str, Any]] | None,
) -> int:
    """The replicas the service wants: its mixed pool's, its spec's or plan's, else (a spec that does
    not plan) what the Deployment of the last good plan runs."""
    if variants:
        return sum(v["replicas"] for v in variants)
    if plan.fits and spec is not None:
        return spec.replicas if spec.replicas is not None else plan.replicas
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def variant_rows(
    mixed: MixedPlan | None,
    name: str,
    deployments: Mapping[str, Mapping[str, Any]],
    full: Mapping[str, tuple[int, str]],
) -> list[dict[str, Any]] | None:
    """status.variants: each variant (GPU type, and capacity class) of a mixed pool with its
    Deployment's replicas (as they are, else as planned), what they cost an hour, and (`full`, by
    Variant.key) the replicas its nodes held when they were found full, and since when."""
    if mixed is None or not mixed.fits:
        return None
    rows = []
    for v in mixed.variants:
        held, since = full.get(v.key, (None, None))
        named = variant_deployment(name, v.gpu, v.capacity_class)
        deployment = deployments.get(named) or {}
        replicas = int((deployment.get("spec") or {}).get("replicas", v.plan.replicas) or 0)
        rows.append(
            {
                "gpu": v.gpu,
                # Only when it names one: a pool without classes reads as it always did.
                **({"capacityClass": v.capacity_class} if v.capacity_class else {}),
                "deployment": named,
                "replicas": replicas,
                "readyReplicas": int((deployment.get("status") or {}).get("readyReplicas") or 0),
                "maxReplicas": v.max_replicas,
                "gpuCount": v.plan.gpu_count,
                "quantization": v.plan.quantization,
                "maxNumSeqs": v.plan.max_num_seqs,
                "capacityRps": v.plan.capacity_rps,
                "predictedTtftMs": v.plan.predicted_ttft_ms,
                "predictedTpotMs": v.plan.predicted_tpot_ms,
                "pricePerGpuHour": v.price_per_gpu_hour,
                "costPerHour": round(replicas * v.plan.gpu_count * v.price_per_gpu_hour, 2),
                **({"schedulableReplicas": held, "fullSince": since} if held is not None else {}),
            }
        )
    return rows


def cost_per_hour(
    plan: Plan, desired: int, variants: Sequence[Mapping[str, Any]] | None, prices: Mapping[str, float]
) -> float | None:
    """status.costPerHour: a mixed pool's rows' costPerHour summed (each at its own class's price);
    one GPU type's `desired` replicas x GPUs per replica x its price per GPU-hour (the operator's
    `prices`, else its list price). None for a CPU plan or one that does not fit: the status then
    says nothing it cannot know."""
    if variants:
        return round(sum(float(row.get("costPerHour") or 0) for row in variants), 2)
    if not plan.fits or plan.gpu not in LIST_PRICE_PER_GPU_HOUR:
        return None
    return round(desired * plan.gpu_count * price_per_gpu_hour(prices, str(plan.gpu)), 2)


def _unschedulable(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's PodScheduled condition when no node can take it (False, reason Unschedulable)."""
    return next(
        (
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if (c.get("type"), c.get("status"), c.get("reason")) == ("PodScheduled", "False", "Unschedulable")
        ),
        None,
    )


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods no node can take."""
    return [pod for pod in pods if _unschedulable(pod) is not None]


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _replica_conditions(
    counts: str, desired: int, ready: int, current: bool, ready_message: str
) -> tuple[tuple[bool, str], dict[str, Any]]:
    if desired == 0:
        ready_condition = _condition("Ready", False, "ScaledToZero", "0 replicas requested")
    elif ready >= desired:
        ready_condition = _condition("Ready", True, "ReplicasReady", ready_message)
    else:
        ready_condition = _condition("Ready", False, "ReplicasNotReady", counts)
    if not current:
        progressing = True, "RollingOut"
    elif ready < desired:
        progressing = True, "WaitingForReady"
    else:
        progressing = False, "RolloutComplete"
    return progressing, ready_condition


# Container states that keep a pod from ever getting ready on its own, as `kubectl get pods` shows them.
_STUCK_CONTAINER_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
)


def pod_problem(deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """Why engine pods are not ready, as (reason, message), from the pods first (the most specific:
    a crash loop, an image that cannot be pulled, a pod no node can take) and then the Deployment
    (its progress deadline passed); None when nothing says."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        name = pod.get("metadata", {}).get("name", "?")
        pod_status = pod.get("status") or {}
        for container in pod_status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _STUCK_CONTAINER_REASONS:
                detail = waiting.get("message") or waiting["reason"]
                return waiting["reason"], f"pod {name}, container {container.get('name')}: {detail}"
        if (condition := _unschedulable(pod)) is not None:
            return "Unschedulable", f"pod {name}: {condition.get('message', 'no node fits it')}"
    for condition in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", condition.get("message", "the rollout made no progress in time")
    return None


class _Rollout(NamedTuple):
    """What the owned Deployment's status says of the desired replicas."""

    desired: int
    ready: int
    updated: int
    current: bool  # the Deployment has rolled out this generation's template to all replicas
    counts: str


def _rollout(deployment: Mapping[str, Any] | None, desired: int) -> _Rollout:
    observed = (deployment or {}).get("status", {})
    generation = (deployment or {}).get("metadata", {}).get("generation", 0)
    ready = int(observed.get("readyReplicas", 0))
    updated = int(observed.get("updatedReplicas", 0))
    current = (
        deployment is not None
        and observed.get("observedGeneration", 0) >= generation
        and updated >= desired
        and int(observed.get("replicas", 0)) == desired
    )
    return _Rollout(desired, ready, updated, current, f"{ready}/{desired} replicas ready")


def _unplanned_conditions(plan: Plan, rollout: _Rollout, deployment: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A spec that does not plan: nothing runs, or the Deployment of the last plan that fit does."""
    failure, code = plan.reason, plan.failure or "DoesNotFit"
    if deployment is None:
        return [
            _condition("Planned", False, code, failure),
            _condition("Progressing", False, "NoDeployment", "nothing is rolled out: " + failure),
            _condition("Ready", False, code, failure),
            _condition("Degraded", False, "NoDeployment", "no engine pods to degrade"),
        ]
    kept = "the Deployment of the last plan that fit keeps running"
    _, ready_condition = _replica_conditions(
        rollout.counts, rollout.desired, rollout.ready, rollout.current, f"{rollout.counts} (the last plan that fit)"
    )
    return [
        _condition("Planned", False, code, f"{failure}; {kept}"),
        _condition(
            "Progressing",
            False,
            code,
            f"this generation's plan is not rolled out (only its replicas are applied): {failure}; {kept}",
        ),
        ready_condition,
        _condition("Degraded", True, code, f"serving the last plan that fit, not this generation's: {failure}"),
    ]


def _planned_conditions(plan: Plan, spec: InferenceServiceSpec, rollout: _Rollout) -> list[dict[str, Any]]:
    slo = (
        f"predicted TTFT {plan.predicted_ttft_ms:g} ms (SLO {spec.slo.ttft_p95_ms:g}), "
        f"TPOT {plan.predicted_tpot_ms:g} ms (SLO {spec.slo.tpot_p95_ms:g})"
    )
    progressing, ready_condition = _replica_conditions(
        rollout.counts, rollout.desired, rollout.ready, rollout.current, f"{rollout.counts}; {slo}"
    )
    if not plan.meets_slo:
        degraded = _condition("Degraded", True, "SLOAtRisk", plan.reasons.get("replicas", slo))
    elif rollout.current and rollout.ready < rollout.desired:
        degraded = _condition("Degraded", True, "ReplicasUnavailable", f"rollout finished but only {rollout.counts}")
    else:
        degraded = _condition("Degraded", False, "AsPlanned", slo)
    return [
        _condition("Planned", True, "Planned", plan.reason),
        _condition(
            "Progressing", *progressing, f"{rollout.updated}/{rollout.desired} replicas updated, {rollout.counts}"
        ),
        ready_condition,
        degraded,
    ]


def conditions(
    plan: Plan,
    spec: InferenceServiceSpec | None,
    desired: int,
    deployment: Mapping[str, Any] | None,
    blocked: tuple[str, str] | None = None,
    problem: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Planned / Progressing / Ready / Degraded from the plan and the Deployment's status.

    `deployment` is the one this InferenceService owns, if any; when the plan does not fit it is
    the Deployment of the last plan that did, still running. `blocked` is (reason, message) when
    the children could not be written (NameConflict, ApplyFailed).
    """
    rollout = _rollout(deployment, desired)
    if not plan.fits:
        conditions_ = _unplanned_conditions(plan, rollout, deployment)
    else:
        assert spec is not None  # a plan fits only for a valid spec
        conditions_ = _planned_conditions(plan, spec, rollout)
    if problem is not None:
        # Not ready, and the pods or the Deployment say why: that is the reason to show.
        reason, message = problem
        conditions_ = [
            _condition("Ready", False, reason, f"{c['message']}: {message}")
            if c["type"] == "Ready" and c["status"] == "False" and c["reason"] == "ReplicasNotReady"
            else c
            for c in conditions_
        ]
    if blocked is not None:
        reason, message = blocked
        replaced = {
            "Progressing": _condition("Progressing", False, reason, message),
            "Ready": _condition("Ready", False, reason, message),
        }
        conditions_ = [replaced.get(c["type"], c) for c in conditions_]
    return conditions_


def _same_prediction(accuracy: PlanAccuracy, plan: Plan) -> bool:
    """Whether `status.planAccuracy` compared the engines with this plan's predictions."""
    judged = ((accuracy.ttft, plan.predicted_ttft_ms), (accuracy.tpot, plan.predicted_tpot_ms))
    return all(window is None or window.predicted_ms in (None, value) for window, value in judged)


def plan_accuracy(
    old: InferenceServiceStatus, plan: Plan, now: datetime, generation: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`planAccuracy` and the PlanAccurate condition as the autoscaler's loop last wrote them
    (autoscaling/accuracy.py), for this generation; both start again (Unknown) when this plan
    predicts other latencies than the ones they were judged against. None: the loop wrote none."""
    written = old.condition(PLAN_ACCURATE)
    if written is None:
        return None, None
    accuracy = old.plan_accuracy or PlanAccuracy()
    # Stamped again below, for this generation.
    condition = written.model_dump(include={"type", "status", "reason", "message"}, exclude_none=True)
    if not _same_prediction(accuracy, plan):
        accuracy = PlanAccuracy()
        reason, message = (
            (
                "Replanned",
                f"the plan now predicts p95 TTFT {plan.predicted_ttft_ms:g} ms, TPOT "
                f"{plan.predicted_tpot_ms:g} ms: no window of the engines compared with it yet",
            )
            if plan.fits
            else ("NoPrediction", "the spec does not plan: no predicted latency to compare")
        )
        condition = {"type": PLAN_ACCURATE, "status": "Unknown", "reason": reason, "message": message}
    return accuracy.dump() or None, with_transition_times([condition], old.conditions or [], now, generation)[0]


def _carried(old: InferenceServiceStatus, plan: Plan) -> dict[str, Any]:
    """What the autoscaler's loop (autoscaling/loop.py) writes, besides the PlanAccurate condition,
    and its adapter sync's status.adapters (autoscaling/adapter_sync.py): a reconcile carries them
    over, since the merge patch of this status would otherwise remove what it does not list. The
    latency is the plan's predicted one until the autoscaler reports what the engines measure."""
    if old.latency and old.latency.source == "observed":
        latency = old.latency.dump()
    else:
        latency = {"ttftP95Ms": plan.predicted_ttft_ms, "tpotP95Ms": plan.predicted_tpot_ms, "source": "predicted"}
    return {
        **({"autoscaler": old.autoscaler.dump()} if old.autoscaler and old.autoscaler.dump() else {}),
        **({"adapters": [a.dump() for a in old.adapters]} if old.adapters else {}),
        "latency": latency,
    }


def build(
    *,
    name: str,
    namespace: str,
    generation: int,
    plan: Plan,
    spec: InferenceServiceSpec | None,
    deployment: Mapping[str, Any] | None,
    old: InferenceServiceStatus,
    now: datetime,
    blocked: tuple[str, str] | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
    last_good: LastGoodPlan | None = None,
    api_key: tuple[str, str] | None = None,
    correction: Mapping[str, Any] | None = None,
    variants: list[dict[str, Any]] | None = None,
    inspected: InspectedCheckpoint | None = None,
    inspected_draft: InspectedCheckpoint | None = None,
    gpu_prices: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The whole `status` to write; `deployment` is the owned Deployment, if any; `last_good` the
        last plan that fit (reconcile.last_good); `api_key` the SHA-256 of the service's API key and its
        Secret, for the gateway's check; `correction` the factors the plan's replicas were chosen with
        (controller/correction.py); `inspected` and `inspected_draft` what the inspection Jobs of the
    model's and the draft's checkpoints (on a claim or in the engine image) found;
        `gpu_prices` US dollars per GPU-hour by type (the operator's --gpu-price), for status.costPerHour."""
    desired = _desired(plan, spec, deployment, variants)
    cost = cost_per_hour(plan, desired, variants, gpu_prices or {})
    observed = (deployment or {}).get("status", {})
    fresh = conditions(plan, spec, desired, deployment, blocked, pod_problem(deployment, pods))
    accuracy, accurate = plan_accuracy(old, plan, now, generation)
    return {
        **_carried(old, plan),
        "observedGeneration": generation,
        "replicas": int(observed.get("replicas", 0)),
        "readyReplicas": int(observed.get("readyReplicas", 0)),
        "desiredReplicas": desired,
        "selector": selector(name),
        # The Service exists whether or not the plan fits, so the address is stable from the start.
        "url": service_url(name, namespace),
        "plan": plan_summary(plan),
        **({"variants": variants} if variants else {}),
        **({"costPerHour": cost} if cost is not None else {}),
        **{
            k: v.dump()
            for k, v in (
                ("lastGoodPlan", last_good),
                ("inspectedCheckpoint", inspected),
                ("inspectedDraftCheckpoint", inspected_draft),
            )
            if v
        },
        **({"auth": {API_KEY_SHA256: api_key[0], "secretName": api_key[1]}} if api_key else {}),
        **({"planAccuracy": accuracy} if accuracy else {}),
        **({"correction": dict(correction)} if correction else {}),
        "conditions": [
            *with_transition_times(fresh, old.conditions or [], now, generation),
            *([accurate] if accurate else []),
        ],
    }
