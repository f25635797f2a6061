"""The p95s a plan predicts around its means: TPOT's tail of interrupting prefills."""

from __future__ import annotations

import math

import pytest

from kvpilot.operator.planning.latency import Z_95, Prefills, p95


@pytest.mark.parametrize("busy", [0.05, 0.2, 0.4])
def test_the_tpot_tail_counts_the_prefills_that_arrive_while_the_tail_itself_is_decoded(busy: float) -> None:
    prefill, output_tokens, uninterrupted_step = 0.19, 48, 0.035
    rate = busy / prefill
    mean_tpot = uninterrupted_step / (1 - busy)
    _, tpot_p95 = p95(Prefills(prefill, busy, rate), 0.03, uninterrupted_step, output_tokens)
    decode = tpot_p95 * (output_tokens - 1)  # the 95th-percentile decode, D
    arrivals = rate * decode
    # D is its uninterrupted steps plus the 95th percentile of the prefills arriving within D itself.
    assert decode == pytest.approx(
        uninterrupted_step * (output_tokens - 1) + prefill * (arrivals + Z_95 * math.sqrt(arrivals))
    )
    # Above the mean, by more than when the arrivals are counted over the mean decode only.
    at_mean = rate * mean_tpot * (output_tokens - 1)
    short = mean_tpot + prefill * Z_95 * math.sqrt(at_mean) / (output_tokens - 1)
    assert tpot_p95 > short > mean_tpot


def test_without_prefills_the_tpot_tail_is_the_mean() -> None:
    _, tpot_p95 = p95(Prefills(0.1, 0.0, 0.0), 0.02, 0.02, 48)
    assert tpot_p95 == pytest.approx(0.02)
