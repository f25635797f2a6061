"""A mixed GPU pool: a plan per GPU type, a replica's capacity, and the load shared cheapest first."""

import math
from typing import Any

import pytest

from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning import latency
from kvpilot.operator.planning import plan as plan_module
from kvpilot.operator.planning import variants as variants_module
from kvpilot.operator.planning.gpus import LIST_PRICE_PER_GPU_HOUR
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.planning.variants import (
    UNKNOWN_CAPACITY_CLASS,
    VariantRequest,
    fill,
    plan_variants,
    price_per_gpu_hour,
)

THREE = [VariantRequest("H100-80GB"), VariantRequest("L4"), VariantRequest("A10G")]


def spec(model: str = "llama-3-8b", rate: float = 8, **sections: Any) -> InferenceServiceSpec:
    body = {"model": {"name": model}, "runtime": "vllm", "load": {"requestsPerSecond": rate}, **sections}
    return InferenceServiceSpec.model_validate(body)


@pytest.mark.parametrize(("gpu", "rate"), [("L4", 8), ("A10G", 8), ("H100-80GB", 50), ("H100-80GB", 120)])
def test_a_replicas_capacity_is_the_rate_at_which_it_stops_meeting_the_slo(gpu: str, rate: float) -> None:
    # predict sees only the rate per replica: n replicas meet the SLO exactly while R / n <= capacity.
    alone = plan(spec(rate=rate, accelerator={"type": gpu}, autoscaling={"maxReplicas": 32}))
    assert alone.fits and alone.meets_slo and alone.capacity_rps > 0
    assert alone.replicas == math.ceil(rate / alone.capacity_rps)
    held = {"type": gpu, "count": alone.gpu_count}
    at_capacity = plan(spec(rate=alone.capacity_rps, accelerator=held, serving={"quantization": alone.quantization}))
    beyond = plan(spec(rate=alone.capacity_rps * 1.01, accelerator=held, serving={"quantization": alone.quantization}))
    assert (at_capacity.replicas, at_capacity.meets_slo) == (1, True)
    assert beyond.replicas == 2


def test_llama_3_8b_on_three_gpu_types_gets_three_plans_of_their_own() -> None:
    mixed = plan_variants(spec(rate=8), THREE)
    assert mixed.fits and mixed.meets_slo and not mixed.left_out
    by_gpu = {v.gpu: v for v in mixed.variants}
    assert set(by_gpu) == {"H100-80GB", "L4", "A10G"}
    h100, l4, a10g = by_gpu["H100-80GB"].plan, by_gpu["L4"].plan, by_gpu["A10G"].plan
    # One H100 serves the load; an L4 or an A10G replica serves a fraction of it.
    assert h100.capacity_rps > 8 > max(l4.capacity_rps, a10g.capacity_rps)
    assert len({(p.gpu, p.kv_pool_bytes, p.max_num_seqs, p.capacity_rps) for p in (h100, l4, a10g)}) == 3
    # At list prices an H100's req/s is the cheapest: it takes the whole load, the others stand by.
    assert [v.gpu for v in mixed.variants][0] == "H100-80GB"
    assert (h100.replicas, l4.replicas, a10g.replicas) == (1, 0, 0)
    assert mixed.cost_per_hour == pytest.approx(LIST_PRICE_PER_GPU_HOUR["H100-80GB"])
    assert "H100-80GB: type 1 of the 3" in h100.reasons["gpu"]
    ranks = [v.cost_per_rps_hour for v in mixed.variants]
    assert ranks == sorted(ranks)  # type: ignore[type-var]


def test_prices_change_which_variant_scales_first() -> None:
    cheap_l4 = plan_variants(spec(rate=8), THREE, prices={"L4": 0.3})
    first = cheap_l4.variants[0]
    assert first.gpu == "L4" and first.price_per_gpu_hour == 0.3
    assert first.plan.replicas == math.ceil(8 / first.plan.capacity_rps) >= 2  # several L4s
    assert first.requests_per_second == 8 and first.plan.meets_slo
    assert all(v.plan.replicas == 0 for v in cheap_l4.variants[1:])
    assert cheap_l4.cost_per_hour == pytest.approx(first.plan.replicas * first.plan.gpu_count * 0.3)
    assert cheap_l4.cost_per_hour < plan_variants(spec(rate=8), THREE).cost_per_hour


def test_a_full_variant_hands_the_rest_of_the_load_to_the_next() -> None:
    mixed = plan_variants(
        spec(rate=8),
        [VariantRequest("L4", max_replicas=1, count=1), VariantRequest("H100-80GB")],
        prices={"L4": 0.15},
    )
    l4, h100 = mixed.variants
    assert (l4.gpu, l4.plan.replicas, h100.gpu, h100.plan.replicas) == ("L4", 1, "H100-80GB", 1)
    # The L4 serves what one replica can within the SLO; the H100 the rest, each planned at its share.
    assert l4.requests_per_second == pytest.approx(l4.plan.capacity_rps, abs=1e-3)
    assert l4.requests_per_second + h100.requests_per_second == pytest.approx(8, abs=1e-3)
    assert mixed.meets_slo and l4.plan.meets_slo and h100.plan.meets_slo
    assert f"1 replica(s) for {h100.requests_per_second:g} req/s" in h100.plan.reasons["replicas"]
    assert mixed.replicas == 2
    assert mixed.cost_per_hour == pytest.approx(
        l4.plan.gpu_count * 0.15 + LIST_PRICE_PER_GPU_HOUR["H100-80GB"], abs=0.01
    )


def test_more_load_than_every_variant_at_its_maximum_misses_the_slo() -> None:
    mixed = plan_variants(
        spec(rate=8), [VariantRequest("L4", max_replicas=1, count=1), VariantRequest("A10G", max_replicas=1, count=1)]
    )
    assert mixed.fits and not mixed.meets_slo
    assert [v.plan.replicas for v in mixed.variants] == [1, 1]
    assert "the SLO is not met even with every variant at its maxReplicas" in mixed.reason


def test_a_type_the_model_does_not_fit_is_left_out_with_its_reason() -> None:
    mixed = plan_variants(spec("llama-3-70b", rate=2), [VariantRequest("H100-80GB"), VariantRequest("T4")])
    assert [v.gpu for v in mixed.variants] == ["H100-80GB"]
    assert mixed.left_out["T4"].startswith("WeightsDoNotFit: llama-3-70b")
    unknown = plan_variants(spec(rate=2), [VariantRequest("TPU-v5"), VariantRequest("L4")])
    assert "UnknownGPU" in unknown.left_out["TPU-v5"] and [v.gpu for v in unknown.variants] == ["L4"]
    none = plan_variants(spec("llama-3-70b", rate=2), [VariantRequest("T4"), VariantRequest("A10G")])
    assert not none.fits and none.failure == "NoVariantFits"
    assert "T4: WeightsDoNotFit" in none.reason and "A10G: WeightsDoNotFit" in none.reason


def test_without_load_the_floor_waits_where_the_load_would_go_first() -> None:
    mixed = plan_variants(spec(rate=0), THREE)
    assert {v.gpu: v.plan.replicas for v in mixed.variants} == {"H100-80GB": 1, "L4": 0, "A10G": 0}
    assert mixed.cost_per_hour == pytest.approx(LIST_PRICE_PER_GPU_HOUR["H100-80GB"])
    to_zero = plan_variants(spec(rate=0, autoscaling={"minReplicas": 0}), THREE)
    assert to_zero.replicas == 0 and to_zero.cost_per_hour == 0


@pytest.mark.parametrize("rate", [0, 2, 8, 20, 60])
def test_any_total_fills_the_cheapest_first_and_the_planned_total_is_the_planned_split(rate: float) -> None:
    wanted = [
        VariantRequest("L4", max_replicas=3, count=1),
        VariantRequest("A10G", max_replicas=2),
        VariantRequest("T4"),
    ]
    mixed = plan_variants(spec(rate=rate), wanted)
    planned = [v.plan.replicas for v in mixed.variants]
    assert fill(mixed, mixed.replicas) == planned
    for total in range(sum(v.max_replicas for v in mixed.variants) + 1):
        counts = fill(mixed, total)
        assert sum(counts) == total
        # A variant has replicas only once every cheaper one is at its maxReplicas.
        for i, count in enumerate(counts):
            if count:
                assert all(counts[j] == mixed.variants[j].max_replicas for j in range(i))


def test_a_variant_holds_its_own_bounds_and_settings() -> None:
    mixed = plan_variants(
        spec(rate=8), [VariantRequest("L4", max_replicas=8, count=1), VariantRequest("H100-80GB")], prices={"L4": 0.15}
    )
    l4 = mixed.variants[0]
    assert (l4.gpu, l4.max_replicas, l4.plan.gpu_count) == ("L4", 8, 1)
    assert l4.plan.replicas == math.ceil(8 / l4.plan.capacity_rps)
    # The variant planned alone chose its quantization and KV dtype; at its share it holds them.
    alone = plan(spec(rate=8, accelerator={"type": "L4", "count": 1}, autoscaling={"maxReplicas": 8}))
    assert (l4.plan.quantization, l4.plan.kv_cache_dtype, l4.plan.kv_blocks) == (
        alone.quantization,
        alone.kv_cache_dtype,
        alone.kv_blocks,
    )
    assert l4.plan.reasons["quantization"] == alone.reasons["quantization"]


def test_the_capacity_search_takes_a_few_dozen_predictions(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    predict = latency.predict
    monkeypatch.setattr(latency, "predict", lambda *a, **k: calls.append(a[2]) or predict(*a, **k))
    h100 = spec(rate=120, accelerator={"type": "H100-80GB"}, serving={"quantization": "none", "speculative": "off"})
    measured = plan(h100)
    with_capacity = len(calls)
    calls.clear()
    monkeypatch.setattr(plan_module, "capacity_rps", lambda *a: 0.0)
    plan(h100)
    # Doubling from 1/8 req/s to ~32, then bisecting to 0.1 %: about 20 predictions, not one per thousandth.
    assert measured.capacity_rps > 16 and 0 < with_capacity - len(calls) <= 25


# The operator's capacity classes (the chart's capacityClasses): a class's node labels.
CLASSES = {
    "spot": {"karpenter.sh/capacity-type": "spot"},
    "on-demand": {"karpenter.sh/capacity-type": "on-demand"},
}
SPOT_AND_ON_DEMAND = [
    VariantRequest("L4", max_replicas=2, count=1, capacity_class="spot"),
    VariantRequest("L4", count=1, capacity_class="on-demand"),
]


def test_a_cheaper_spot_class_takes_replicas_before_the_same_type_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    prices = {"L4": 0.8, "L4@spot": 0.3}
    whole_load: list[str | None] = []
    planned = variants_module.plan

    def counted(s: InferenceServiceSpec, context: Any = None) -> Any:
        if s.load.requests_per_second == 8:  # a plan for the whole load: the one per type
            whole_load.append(s.accelerator.type)
        return planned(s, context)

    monkeypatch.setattr(variants_module, "plan", counted)
    mixed = plan_variants(spec(rate=8), SPOT_AND_ON_DEMAND, prices=prices, classes=CLASSES)
    assert whole_load == ["L4"]  # once for the type, whatever its classes
    assert mixed.fits and mixed.meets_slo and not mixed.left_out
    spot, on_demand = mixed.variants
    assert (spot.key, on_demand.key) == ("L4@spot", "L4@on-demand")
    # Each class costs its own price; on-demand states none of its own: the type's.
    assert (spot.price_per_gpu_hour, on_demand.price_per_gpu_hour) == (0.3, 0.8)
    assert spot.cost_per_rps_hour is not None and on_demand.cost_per_rps_hour is not None
    assert spot.cost_per_rps_hour < on_demand.cost_per_rps_hour
    # Planned once per type: the classes run the same engine settings and serve the same per replica.
    settings = [
        (v.plan.quantization, v.plan.kv_cache_dtype, v.plan.max_num_seqs, v.plan.capacity_rps) for v in mixed.variants
    ]
    assert settings[0] == settings[1]
    # The spot L4s fill to their maxReplicas first; on-demand takes the rest of the load.
    needed = math.ceil(8 / spot.plan.capacity_rps)
    assert needed > 2, "the load must need more L4s than spot's maxReplicas for the test to say anything"
    assert (spot.plan.replicas, on_demand.plan.replicas) == (2, needed - 2)
    assert spot.requests_per_second + on_demand.requests_per_second == pytest.approx(8, abs=1e-3)
    assert mixed.cost_per_hour == pytest.approx(2 * 0.3 + (needed - 2) * 0.8, abs=0.01)
    # Each variant's pods select its class's nodes; the reasons name the class.
    assert (spot.node_selector, on_demand.node_selector) == (CLASSES["spot"], CLASSES["on-demand"])
    assert "L4@spot: type 1 of the 2" in spot.plan.reasons["gpu"] and "L4@spot: 2 replica(s)" in mixed.reason
    # Priced the other way round, on-demand goes first: the ranking is per class, not per type.
    dear_spot = plan_variants(spec(rate=8), SPOT_AND_ON_DEMAND, prices={"L4@spot": 0.9, "L4": 0.5}, classes=CLASSES)
    assert [v.key for v in dear_spot.variants] == ["L4@on-demand", "L4@spot"]


def test_a_class_and_a_type_without_a_class_are_variants_of_their_own() -> None:
    wanted = [VariantRequest("L4", max_replicas=1, count=1, capacity_class="spot"), VariantRequest("H100-80GB")]
    mixed = plan_variants(spec(rate=8), wanted, prices={"L4@spot": 0.1}, classes=CLASSES)
    spot, h100 = mixed.variants
    assert (spot.key, spot.label, h100.key, h100.label) == ("L4@spot", "l4-spot", "H100-80GB", "h100-80gb")
    assert h100.capacity_class is None and h100.node_selector == {}
    # A class that states no price of the type: the type's list price.
    listed = plan_variants(spec(rate=8), wanted, classes=CLASSES)
    assert {v.key: v.price_per_gpu_hour for v in listed.variants}["L4@spot"] == LIST_PRICE_PER_GPU_HOUR["L4"]


def test_a_class_the_operator_does_not_know_plans_nothing_and_names_the_known_ones() -> None:
    wanted = [VariantRequest("L4", capacity_class="spto"), VariantRequest("H100-80GB")]
    mixed = plan_variants(spec(rate=8), wanted, classes=CLASSES)
    assert not mixed.fits and mixed.failure == UNKNOWN_CAPACITY_CLASS and mixed.variants == []
    assert "spto" in mixed.reason and "known: on-demand, spot" in mixed.reason
    assert "known: none" in plan_variants(spec(rate=8), wanted).reason


def test_room_is_per_class_a_full_spot_class_hands_its_replicas_to_on_demand() -> None:
    mixed = plan_variants(spec(rate=8), SPOT_AND_ON_DEMAND, prices={"L4": 0.8, "L4@spot": 0.3}, classes=CLASSES)
    assert fill(mixed, 3) == [2, 1]
    assert fill(mixed, 3, room={"L4@spot": 1}) == [1, 2]
    assert fill(mixed, 3, room={"L4": 0}) == [2, 1]  # the type's key is another variant's, not these


def test_a_class_s_price_falls_back_to_the_type_s_then_to_the_list_price() -> None:
    assert price_per_gpu_hour({"L4@spot": 0.2, "L4": 0.45}, "L4", "spot") == 0.2
    assert price_per_gpu_hour({"L4": 0.45}, "L4", "spot") == 0.45
    assert price_per_gpu_hour({"L4@spot": 0.2}, "L4") == LIST_PRICE_PER_GPU_HOUR["L4"]
    assert price_per_gpu_hour({}, "H100-80GB", "on-demand") == LIST_PRICE_PER_GPU_HOUR["H100-80GB"]


def test_types_that_miss_the_slo_take_replicas_past_the_others_maxima_not_past_their_own() -> None:
    """No type meets a 1 µs TTFT: every one takes replicas in turn up to its own maxReplicas, and
    only past them all does the first take more (the service's bound, not a type's)."""
    wanted = [VariantRequest("L4", max_replicas=1, count=1), VariantRequest("H100-80GB", max_replicas=1)]
    mixed = plan_variants(spec(rate=2, slo={"ttftP95Ms": 0.001}), wanted)
    assert all(v.cost_per_rps_hour is None for v in mixed.variants)
    assert fill(mixed, 2) == [1, 1] and fill(mixed, 3) == [2, 1]
