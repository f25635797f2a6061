"""bench.plan_accuracy's pure parts: the rate of a planned batch, the argv it serves, the prompts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import plan_accuracy as pa
from kvpilot.operator.planning import cpus
from kvpilot.operator.planning.planner import Plan, plan

BUILTIN = cpus.builtin_profiles()["amd-epyc-zen5-2c"]


def planned(scheme: str = "none", mode: str = "off") -> Callable[[float], Plan]:
    def at(rate: float) -> Plan:
        spec = pa.make_spec(scheme, mode, rate, 108, 48, (2000, 100))
        return plan(spec, device_profiles={pa.PROFILE_NAME: BUILTIN})

    return at


@pytest.mark.parametrize("target", [1.0, 3.0, 6.0])
@pytest.mark.parametrize("scheme, mode", [("none", "off"), ("int4", "ngram")])
def test_the_rate_found_plans_the_target_batch(scheme: str, mode: str, target: float) -> None:
    at = planned(scheme, mode)
    rate = pa.rate_for_batch(at, target)
    found = at(rate)
    assert found.fits and found.replicas == 1
    # Three significant digits of the rate: the batch within a percent or two of the target.
    assert found.predicted_batch == pytest.approx(target, rel=0.02)
    assert at(rate * 0.9).predicted_batch < target


def test_a_rate_the_replica_cannot_keep_up_with_is_not_taken_for_a_small_batch() -> None:
    at = planned()
    # Far beyond what one replica keeps up with, the plan has no latencies (batch 0): the
    # bisection must treat that as too high, not as a batch below the target.
    assert at(64).predicted_tpot_ms == 0
    rate = pa.rate_for_batch(at, 2.0)
    assert 0 < rate < 64 and at(rate).predicted_tpot_ms > 0


def test_the_served_argv_is_the_plans_with_host_and_port_replaced() -> None:
    at = planned("int4", "ngram")
    found = at(1.0)
    spec = pa.make_spec("int4", "ngram", 1.0, 108, 48, (2000, 100))
    argv = pa.served_argv(spec, found, 4321)
    args = argv[argv.index("serve") + 1 :]
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "4321"
    for flag, value in (
        ("--quantization", "int4"),
        ("--speculative", "ngram"),
        ("--max-num-seqs", str(found.max_num_seqs)),
        ("--kv-cache-memory-bytes", str(found.kv_pool_bytes)),
        ("--device", "cpu"),
    ):
        assert args[args.index(flag) + 1] == value


def test_ratios_and_the_goal() -> None:
    row = pa.ratio_row(20.0, 26.0)
    assert row["ratio"] == pytest.approx(1.3) and row["error_pct"] == pytest.approx(30.0)
    assert pa.within_goal(1.25) and pa.within_goal(0.75) and not pa.within_goal(1.3)


def test_prompts_have_one_length_and_share_no_first_block() -> None:
    prompts = pa.fixed_length_prompts(40)
    assert len({len(p) for p in prompts}) == 1 and len(prompts[0]) > 64
    # The prefix cache hashes 16-token blocks chained from the first: distinct first blocks, no hits.
    assert len({tuple(p[:16]) for p in prompts}) == 40
