"""One service across several GPU types: a plan per type (a variant), and the load shared among
them at the lowest cost.

Each variant is first planned as if it served the whole load alone on its type (its own
tensor-parallel size, quantization, KV pool, batch limits and speculation), so its engine settings
hold whatever share it is later given. Its replicas' capacity (Plan.capacity_rps: the most requests
per second one serves within the SLO) and the price of a replica-hour rank the variants: the load
goes to the one with the lowest cost per request per second first, up to its maxReplicas, the rest
to the next, and so on. A variant with a share is then planned again at it with its settings held,
so its replicas and predicted latencies are those of the share it serves; the others stand by at
zero replicas, next in line when the cheaper ones are full.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvpilot.operator.api.plan import MixedPlan, Plan, Variant
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning.context import PlanContext
from kvpilot.operator.planning.gpus import GPUS, LIST_PRICE_PER_GPU_HOUR, find_gpu
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.planning.reasons import failed_plan


class VariantRequest(NamedTuple):
    """A GPU type a service may run on, with its own bounds: the most replicas of it (else the
    service's maxReplicas) and GPUs per replica (else the planner's choice)."""

    gpu: str
    max_replicas: int | None = None
    count: int | None = None


def requested(spec: InferenceServiceSpec) -> list[VariantRequest]:
    """The GPU types spec.accelerator.variants names, with their bounds."""
    return [VariantRequest(v.type, v.max_replicas, v.count) for v in spec.accelerator.variants]


class _Alone(NamedTuple):
    """A variant planned for the whole load, with its bounds and price."""

    plan: Plan
    max_replicas: int
    price_per_gpu_hour: float

    @property
    def replica_price(self) -> float:
        return self.price_per_gpu_hour * self.plan.gpu_count

    @property
    def cost_per_rps_hour(self) -> float | None:
        capacity = self.plan.capacity_rps
        return self.replica_price / capacity if capacity > 0 else None


def _with(spec: InferenceServiceSpec, **parts: dict[str, object]) -> InferenceServiceSpec:
    """`spec` with some fields of its parts replaced (accelerator={...}, load={...}, ...)."""
    return spec.model_copy(
        update={part: getattr(spec, part).model_copy(update=fields) for part, fields in parts.items()}
    )


def _alone(spec: InferenceServiceSpec, wanted: VariantRequest, context: PlanContext) -> Plan:
    accelerator = {"type": wanted.gpu, "count": wanted.count, "node_selector": {}, "variants": []}
    autoscaling = {"max_replicas": wanted.max_replicas or spec.autoscaling.max_replicas}
    return plan(_with(spec, accelerator=accelerator, autoscaling=autoscaling), context)


def _at_share(spec: InferenceServiceSpec, alone: _Alone, replicas: int, rate: float, context: PlanContext) -> Plan:
    """The variant's plan at `replicas` serving `rate` req/s, its settings held as planned alone;
    its reasons stay those of the choices, with the replicas' own."""
    chosen = alone.plan
    serving: dict[str, object] = {
        "kv_cache_dtype": chosen.kv_cache_dtype,
        "speculative": chosen.speculative,
        **({} if spec.model.quantization else {"quantization": chosen.quantization}),
    }
    held = _with(
        spec,
        accelerator={"type": chosen.gpu, "count": chosen.gpu_count, "node_selector": {}, "variants": []},
        serving=serving,
        load={"requests_per_second": rate},
        autoscaling={"min_replicas": replicas, "max_replicas": replicas},
    )
    shared = plan(held, context)
    if not shared.fits:  # the same settings on the same GPU: only a changed catalog could get here
        return chosen.model_copy(update={"replicas": replicas})
    return shared.model_copy(
        update={
            "reasons": {**chosen.reasons, "replicas": shared.reasons["replicas"]},
            "capacity_rps": chosen.capacity_rps,
        }
    )


def _ranked(variant: Plan, rank: int, of: int) -> Plan:
    """The variant's plan, its GPU's reason its rank in the pool (the GPU was not set by hand)."""
    gpu = f"{variant.gpu}: type {rank} of the {of} the pool's load goes to, cheapest per req/s first"
    if not variant.capacity_rps:
        gpu = f"{variant.gpu}: type {rank} of {of}, last: even a lone request misses the SLO on it"
    return variant.model_copy(update={"reasons": {**variant.reasons, "gpu": gpu}})


def _shares(spec: InferenceServiceSpec, ranked: Sequence[_Alone]) -> tuple[list[tuple[int, float]], bool]:
    """Replicas and requests per second per variant (in `ranked`'s order), and whether they meet
    the SLO: each variant in turn takes what is left of the load, up to its maxReplicas."""
    left = spec.load.requests_per_second
    shares: list[tuple[int, float]] = []
    for variant in ranked:
        capacity = variant.plan.capacity_rps
        replicas = min(variant.max_replicas, math.ceil(left / capacity - 1e-9)) if capacity > 0 and left > 0 else 0
        served = min(left, replicas * capacity)
        shares.append((replicas, served))
        left -= served
    if ranked[0].plan.capacity_rps == 0 and left > 0:
        # No variant meets the SLO even at a trickle: the first serves it all at its closest.
        shares[0], left = (ranked[0].plan.replicas, left), 0.0
        return shares, False
    total = sum(replicas for replicas, _ in shares)
    if total < spec.autoscaling.min_replicas:
        # The floor the service keeps goes where the load would go first.
        replicas, served = shares[0]
        shares[0] = (replicas + spec.autoscaling.min_replicas - total, served)
    return shares, left <= 1e-9


def fill(mixed: MixedPlan, total: int, room: Mapping[str, int] | None = None) -> list[int]:
    """Replicas per variant (in `mixed.variants`' order, cheapest per req/s first) for `total`
    replicas of the service: each variant that meets the SLO in turn up to its maxReplicas (and the
    `room` its nodes were found to have: its pods beyond it stayed Pending), so a scale-up goes to
    the cheapest with room and a scale-down leaves the most expensive first. At the planned total,
    the planned split (a variant takes load only once those before it are full)."""
    room = room or {}
    serving = [v for v in mixed.variants if v.cost_per_rps_hour is not None] or mixed.variants[:1]
    counts, left = [], total
    for v in mixed.variants:
        counts.append(min(left, v.max_replicas, room.get(v.gpu, v.max_replicas)) if v in serving else 0)
        left -= counts[-1]
    if left > 0:  # beyond every maxReplicas: the autoscaler's bound is the service's, not the types'
        counts[mixed.variants.index(serving[0])] += left
    return counts


def plan_variants(
    spec: InferenceServiceSpec,
    wanted: Sequence[VariantRequest],
    context: PlanContext | None = None,
    prices: Mapping[str, float] | None = None,
) -> MixedPlan:
    """Plan `spec` on each wanted GPU type and share its load among the types that can serve it, at
    the lowest cost. `prices`: US dollars per GPU-hour by catalog name (else the catalog's list prices)."""
    context = context or PlanContext()
    prices = {**LIST_PRICE_PER_GPU_HOUR, **(prices or {})}
    alone: list[_Alone] = []
    left_out: dict[str, str] = {}
    for request in wanted:
        gpu = find_gpu(request.gpu)
        if gpu is None:
            left_out[request.gpu] = f"UnknownGPU: not in the catalog ({', '.join(GPUS)})"
            continue
        planned = _alone(spec, request._replace(gpu=gpu.name), context)
        if not planned.fits:
            left_out[gpu.name] = f"{planned.failure}: {planned.reason}"
            continue
        alone.append(_Alone(planned, request.max_replicas or spec.autoscaling.max_replicas, prices[gpu.name]))
    if not alone:
        return MixedPlan(
            fits=False,
            failure="NoVariantFits",
            reason=f"{spec.model.name} fits none of the GPU types: "
            + "; ".join(f"{gpu}: {why}" for gpu, why in left_out.items()),
            model=spec.model.name,
            left_out=left_out,
        )
    # Cheapest per request per second first; a type that cannot meet the SLO last, cheapest replica first.
    ranked = sorted(alone, key=lambda v: (v.cost_per_rps_hour is None, v.cost_per_rps_hour or 0, v.replica_price))
    shares, meets_slo = _shares(spec, ranked)
    variants = [
        Variant(
            gpu=str(v.plan.gpu),
            plan=_ranked(
                _at_share(spec, v, replicas, rate, context) if replicas else v.plan.model_copy(update={"replicas": 0}),
                rank,
                len(ranked),
            ),
            max_replicas=v.max_replicas,
            requests_per_second=round(rate, 3),
            price_per_gpu_hour=v.price_per_gpu_hour,
            cost_per_rps_hour=None if v.cost_per_rps_hour is None else round(v.cost_per_rps_hour, 4),
            cost_per_hour=round(replicas * v.replica_price, 2),
        )
        for rank, (v, (replicas, rate)) in enumerate(zip(ranked, shares, strict=True), 1)
    ]
    return MixedPlan(
        fits=True,
        reason=_reason(spec, variants, meets_slo),
        model=spec.model.name,
        variants=variants,
        left_out=left_out,
        replicas=sum(v.plan.replicas for v in variants),
        meets_slo=meets_slo and all(v.plan.meets_slo for v in variants if v.plan.replicas),
        cost_per_hour=round(sum(v.cost_per_hour for v in variants), 2),
    )


def _reason(spec: InferenceServiceSpec, variants: Sequence[Variant], meets_slo: bool) -> str:
    rate = spec.load.requests_per_second
    parts = []
    for v in variants:
        per = f"${v.cost_per_rps_hour:.3g}/h per req/s" if v.cost_per_rps_hour is not None else "misses the SLO alone"
        capacity = (
            f"{v.plan.capacity_rps:g} req/s per replica of {v.plan.gpu_count} GPU(s) at ${v.price_per_gpu_hour:g}/GPU-h"
        )
        served = (
            f"{v.plan.replicas} replica(s) serve {v.requests_per_second:g} req/s" if v.plan.replicas else "stands by"
        )
        parts.append(f"{v.gpu}: {served} ({capacity}: {per})")
    head = f"{rate:g} req/s over {len(variants)} GPU type(s), cheapest per req/s first"
    if not meets_slo:
        head += " (the SLO is not met even with every variant at its maxReplicas)"
    return head + ": " + "; ".join(parts)


def as_one_plan(spec: InferenceServiceSpec, mixed: MixedPlan) -> Plan:
    """The Plan a mixed pool shows as the service's (status.plan): its first variant's (the cheapest
    per request per second) with the pool's replicas, SLO verdict and reason, or why no variant can
    serve the model."""
    if not mixed.fits:
        return failed_plan(spec, str(mixed.failure), mixed.reason)
    first = mixed.variants[0].plan
    reasons = {**first.reasons, "variants": mixed.reason}
    return first.model_copy(update={"replicas": mixed.replicas, "meets_slo": mixed.meets_slo, "reasons": reasons})
