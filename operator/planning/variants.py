"""One service across several GPU types: a plan per type (a variant), and the load shared among
them at the lowest cost.

Each variant is first planned as if it served the whole load alone on its type (its own
tensor-parallel size, quantization, KV pool, batch limits and speculation), so its engine settings
hold whatever share it is later given. Its replicas' capacity (Plan.capacity_rps: the most requests
per second one serves within the SLO) and the price of a replica-hour rank the variants: the load
goes to the one with the lowest cost per request per second first, up to its maxReplicas, the rest
to the next, and so on. A GPU type may be a variant once per capacity class (the operator's: spot
and on-demand nodes, each with its own node labels and price): it is planned once, so its classes
run the same engine settings, and ranked, priced, bounded and filled per class. A variant with a
share is then planned again at it with its settings held, so its replicas and predicted latencies
are those of the share it serves; the others stand by at zero replicas, next in line when the
cheaper ones are full.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from kvpilot.operator.api.names import variant_key
from kvpilot.operator.api.plan import MixedPlan, Plan, Variant
from kvpilot.operator.api.spec import ANY_GPU, InferenceServiceSpec
from kvpilot.operator.planning.context import PlanContext
from kvpilot.operator.planning.gpus import GPUS, LIST_PRICE_PER_GPU_HOUR, find_gpu
from kvpilot.operator.planning.placement import NO_GPU_TYPE
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.planning.reasons import failed_plan


class VariantRequest(NamedTuple):
    """A GPU type a service may run on, with its own bounds: the most replicas of it (else the
    service's maxReplicas) and GPUs per replica (else the planner's choice), on the nodes of one
    capacity class (else any node of the type)."""

    gpu: str
    max_replicas: int | None = None
    count: int | None = None
    capacity_class: str | None = None

    @property
    def key(self) -> str:
        return variant_key(self.gpu, self.capacity_class)


def requested(spec: InferenceServiceSpec, on_nodes: Iterable[str] | None = None) -> list[VariantRequest]:
    """The GPU types spec.accelerator.variants names, with their bounds. A variant of type * stands
    for each catalog GPU type the nodes carry (`on_nodes`: their product labels; None, planning
    without a cluster: every catalog type) that no variant of its capacity class names."""
    entries = spec.accelerator.variants
    wanted = [VariantRequest(v.type, v.max_replicas, v.count, v.capacity_class) for v in entries if v.type != ANY_GPU]
    named = {(gpu.name if (gpu := find_gpu(r.gpu)) else r.gpu, r.capacity_class) for r in wanted}
    found = [find_gpu(product) for product in on_nodes] if on_nodes is not None else list(GPUS.values())
    carried = [name for name in GPUS if name in {gpu.name for gpu in found if gpu is not None}]
    for any_type in (v for v in entries if v.type == ANY_GPU):
        wanted += [
            VariantRequest(name, any_type.max_replicas, any_type.count, any_type.capacity_class)
            for name in carried
            if (name, any_type.capacity_class) not in named
        ]
    return wanted


# The Planned=False reason of a variant naming a capacity class the operator was not given.
UNKNOWN_CAPACITY_CLASS = "UnknownCapacityClass"


def price_per_gpu_hour(prices: Mapping[str, float], gpu: str, capacity_class: str | None = None) -> float:
    """US dollars per GPU-hour of the catalog type `gpu` on the nodes of `capacity_class`: that
    class's price for the type (prices["L4@spot"]), else the type's (prices["L4"]), else its list
    price. The admin states a class's price only where it differs."""
    for key in (variant_key(gpu, capacity_class), gpu):
        if key in prices:
            return prices[key]
    return LIST_PRICE_PER_GPU_HOUR[gpu]


class _Alone(NamedTuple):
    """A variant planned for the whole load, with its bounds and price, and its capacity class."""

    plan: Plan
    max_replicas: int
    price_per_gpu_hour: float
    capacity_class: str | None = None
    node_selector: Mapping[str, str] = {}

    @property
    def key(self) -> str:
        return variant_key(str(self.plan.gpu), self.capacity_class)

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


def _on(context: PlanContext, gpu: str) -> PlanContext:
    """`context` with the correction of `gpu`'s own pods: a pool-wide factor would move every type
    by what the pool's mix showed, where each type's own pods say how far its own plan is off."""
    return replace(context, correction=context.correction.for_gpu(gpu)) if context.correction else context


def _alone(spec: InferenceServiceSpec, wanted: VariantRequest, context: PlanContext) -> Plan:
    accelerator = {"type": wanted.gpu, "count": wanted.count, "node_selector": {}, "variants": []}
    autoscaling = {"max_replicas": wanted.max_replicas or spec.autoscaling.max_replicas}
    return plan(_with(spec, accelerator=accelerator, autoscaling=autoscaling), _on(context, wanted.gpu))


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
    shared = plan(held, _on(context, str(chosen.gpu)))
    if not shared.fits:  # the same settings on the same GPU: only a changed catalog could get here
        return chosen.model_copy(update={"replicas": replicas})
    return shared.model_copy(
        update={
            "reasons": {**chosen.reasons, "replicas": shared.reasons["replicas"]},
            "capacity_rps": chosen.capacity_rps,
        }
    )


def _ranked(variant: Plan, key: str, rank: int, of: int) -> Plan:
    """The variant's plan, its GPU's reason its rank in the pool (the GPU was not set by hand);
    `key` names the variant (L4, L4@spot)."""
    gpu = f"{key}: type {rank} of the {of} the pool's load goes to, cheapest per req/s first"
    if not variant.capacity_rps:
        gpu = f"{key}: type {rank} of {of}, last: even a lone request misses the SLO on it"
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
    """Replicas per variant (in `mixed.variants`' order: those that meet the SLO first, cheapest per
    req/s first, then those that miss it) for `total` replicas of the service: each variant in turn
    up to its maxReplicas (and the `room` its nodes were found to have, by Variant.key: its pods
    beyond it stayed Pending), so a scale-up goes to the cheapest with room and a scale-down leaves
    the most expensive first. At the planned total, the planned split (a variant takes load only
    once those before it are full). A variant that misses the SLO takes replicas only once every one
    that meets it is full: its maxReplicas is the GPUs of it the service may take, and past those of
    the others the service's replicas go to it rather than past another's maximum."""
    room = room or {}
    serving = [v for v in mixed.variants if v.cost_per_rps_hour is not None] or mixed.variants[:1]
    counts, left = [], total
    for v in mixed.variants:
        counts.append(min(left, v.max_replicas, room.get(v.key, v.max_replicas)))
        left -= counts[-1]
    if left > 0:  # beyond every maxReplicas: the autoscaler's bound is the service's, not the types'
        counts[mixed.variants.index(serving[0])] += left
    return counts


def _no_gpu_type(spec: InferenceServiceSpec, wanted: Sequence[VariantRequest]) -> MixedPlan | None:
    """Why a pool of only `*` variants cannot be planned on a cluster whose nodes carry no GPU type."""
    if wanted:
        return None
    return MixedPlan(
        fits=False,
        failure=NO_GPU_TYPE,
        reason="accelerator.variants: type * found no GPU type on the nodes (none carries a known GPU product "
        "label) and no other variant names one",
        model=spec.model.name,
    )


def _unknown_classes(
    spec: InferenceServiceSpec, wanted: Sequence[VariantRequest], classes: Mapping[str, Mapping[str, str]]
) -> MixedPlan | None:
    """Why the pool cannot be planned when a variant names a capacity class the operator was not
    given: its pods would select no node (or the wrong ones), and leaving the variant out would
    silently move its share to the others."""
    unknown = sorted({r.capacity_class for r in wanted if r.capacity_class and r.capacity_class not in classes})
    if not unknown:
        return None
    known = ", ".join(sorted(classes)) or "none"
    return MixedPlan(
        fits=False,
        failure=UNKNOWN_CAPACITY_CLASS,
        reason=f"accelerator.variants names the capacity class(es) {', '.join(unknown)}, which the operator does "
        f"not know (known: {known}); the cluster admin declares them in the chart's capacityClasses",
        model=spec.model.name,
    )


def _plan_alone(
    spec: InferenceServiceSpec,
    wanted: Sequence[VariantRequest],
    context: PlanContext,
    prices: Mapping[str, float],
    classes: Mapping[str, Mapping[str, str]],
) -> tuple[list[_Alone], dict[str, str]]:
    """Each wanted variant planned for the whole load, and those left out with why. A GPU type is
    planned once per GPU count, for the most replicas its capacity classes may have together: its
    spot and on-demand variants run the same engine settings, only their prices and bounds differ."""
    found = {r.key: find_gpu(r.gpu) for r in wanted}
    most: dict[tuple[str, int | None], int] = {}
    for request in wanted:
        if (gpu := found[request.key]) is not None:
            most[gpu.name, request.count] = most.get((gpu.name, request.count), 0) + (
                request.max_replicas or spec.autoscaling.max_replicas
            )
    planned = {key: _alone(spec, VariantRequest(key[0], bound, key[1]), context) for key, bound in most.items()}
    alone: list[_Alone] = []
    left_out: dict[str, str] = {}
    for request in wanted:
        gpu = found[request.key]
        if gpu is None:
            left_out[request.key] = f"UnknownGPU: not in the catalog ({', '.join(GPUS)})"
            continue
        chosen = planned[gpu.name, request.count]
        if not chosen.fits:
            left_out[variant_key(gpu.name, request.capacity_class)] = f"{chosen.failure}: {chosen.reason}"
            continue
        alone.append(
            _Alone(
                chosen,
                request.max_replicas or spec.autoscaling.max_replicas,
                price_per_gpu_hour(prices, gpu.name, request.capacity_class),
                request.capacity_class,
                dict(classes.get(request.capacity_class, {})) if request.capacity_class else {},
            )
        )
    return alone, left_out


def plan_variants(
    spec: InferenceServiceSpec,
    wanted: Sequence[VariantRequest],
    context: PlanContext | None = None,
    prices: Mapping[str, float] | None = None,
    classes: Mapping[str, Mapping[str, str]] | None = None,
) -> MixedPlan:
    """Plan `spec` on each wanted GPU type and share its load among the types that can serve it, at
    the lowest cost. `prices`: US dollars per GPU-hour by catalog name, or TYPE@CLASS for a capacity
    class's own (else the type's, else the catalog's list prices); `classes`: the operator's
    capacity classes, each with the node labels its variants' pods select."""
    classes = classes or {}
    refused = _no_gpu_type(spec, wanted) or _unknown_classes(spec, wanted, classes)
    if refused is not None:
        return refused
    context = context or PlanContext()
    alone, left_out = _plan_alone(spec, wanted, context, prices or {}, classes)
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
            capacity_class=v.capacity_class,
            node_selector=dict(v.node_selector),
            plan=_ranked(
                _at_share(spec, v, replicas, rate, context) if replicas else v.plan.model_copy(update={"replicas": 0}),
                v.key,
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
        parts.append(f"{v.key}: {served} ({capacity}: {per})")
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
