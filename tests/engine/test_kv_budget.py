"""KV pool sizing on a GPU: the arithmetic after profiling (the profiling itself needs a device)."""

from __future__ import annotations

import pytest

from kvpilot.engine.worker.model_runner import kv_budget_after_profile

GIB = 1 << 30


def test_pool_gets_what_utilization_leaves_after_the_peak():
    # The worked example: 24 GiB GPU, ~14 GiB of weights, 90%: about 7.6 GiB for KV.
    assert kv_budget_after_profile(24 * GIB, 0.9, 14 * GIB) == int(24 * GIB * 0.9) - 14 * GIB


def test_no_room_for_kv_is_a_clear_error():
    with pytest.raises(ValueError, match=r"peak at .* leaving no KV cache within gpu_memory_utilization=0.5"):
        kv_budget_after_profile(24 * GIB, 0.5, 14 * GIB)
