"""Fixtures shared by the operator tests."""

from __future__ import annotations

import pytest

from kvpilot.engine.contract.config import CAPABILITIES, EngineCapabilities


@pytest.fixture
def fuller() -> EngineCapabilities:
    """A hypothetical engine build running every scheme and mode the CRD names, with low-bit GPU
    kernels: the planner's search among them is tested against it, independently of what today's
    engine runs."""
    return EngineCapabilities(
        quantization=("none", "int8", "w8a8", "int4"),
        speculative=("off", "ngram", "draft"),
        dtypes=CAPABILITIES.dtypes,
        checkpoint_quantization=("int8", "fp8", "w8a8", "int4", "awq", "gptq"),
        low_bit_gpu_matmuls=True,
    )
