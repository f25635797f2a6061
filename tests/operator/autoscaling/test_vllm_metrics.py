"""The autoscaler reads a vLLM pod's /metrics as vLLM 0.33 itself writes it: the exposition comes
from vLLM's own PrometheusStatLogger (tests/vllm/exposition.py, in the venv tests/vllm/env.py
builds), after engine steps this test chooses, never from text written by hand."""

from __future__ import annotations

import json

import pytest

from kvpilot.operator.autoscaling.metrics import parse
from kvpilot.operator.planning.models import MODELS
from tests.vllm import env
from tests.vllm.model_configs import config_json

STEPS = [
    {
        "running": 3,
        "waiting": 5,
        "kv_usage": 0.25,
        "drafts": [[4, 1], [4, 3]],
        "prompts": [[100, 0], [100, 64]],
        "ttfts": [0.04, 0.3, 0.9],
        "itls": [0.02, 0.03],
        "finished": [{"tpot": 0.05, "tokens": 20, "reason": "length"}],
    },
    {
        "running": 4,
        "waiting": 2,
        "kv_usage": 0.42,
        "drafts": [[4, 4]],
        "prompts": [[50, 48]],
        "ttfts": [0.2],
        "itls": [0.01],
        "finished": [
            {"tpot": 0.5, "tokens": 8, "reason": "stop"},
            {"tpot": 0.0, "tokens": 1, "reason": "abort"},
        ],
    },
]


NUM_GPU_BLOCKS = 37_419


def vllm_exposition() -> str:
    """vLLM's own /metrics after STEPS, speculating with n-gram drafts."""
    case = {
        "argv": ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})],
        "config": config_json(MODELS["smollm2-135m"]),
        "steps": STEPS,
        "num_gpu_blocks": NUM_GPU_BLOCKS,
    }
    return env.run("exposition", json.dumps(case), timeout_s=600)


@pytest.fixture(scope="module")
def exposition() -> str:
    return vllm_exposition()


def test_a_vllm_exposition_gives_the_autoscaler_every_signal(exposition: str) -> None:
    assert "vllm:num_requests_waiting" in exposition and "kvpilot_" not in exposition
    reading = parse(exposition)
    # Gauges: the last step's.
    assert (reading.waiting, reading.running, reading.kv_usage) == (2, 4, 0.42)
    # Histograms: every TTFT vLLM observed, and TPOT per finished request (vLLM counts the 1-token
    # and aborted ones too).
    assert reading.ttft is not None and reading.ttft.count == 4
    ttft_bounds = dict(zip(reading.ttft.bounds, reading.ttft.counts))
    assert (ttft_bounds[0.04], ttft_bounds[0.25], ttft_bounds[0.5], ttft_bounds[1.0]) == (1, 2, 3, 4)
    assert reading.tpot is not None and reading.tpot.count == 3
    # Draft counters: 12 proposed, 8 accepted.
    assert (reading.draft_tokens, reading.accepted_tokens) == (12, 8)
    # Prefix cache counters: 250 prompt tokens looked up, 112 found.
    assert (reading.prefix_queries, reading.prefix_hits) == (250, 112)
    # The KV pool the engine allocated, which planAccuracy sets beside the plan's kvBlocks.
    assert reading.kv_blocks == NUM_GPU_BLOCKS
