"""KV pool sizing on a GPU: the arithmetic after profiling, and what the profile step runs (on CPU: the
measuring itself needs a device)."""

from __future__ import annotations

import pytest

from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.worker.model_runner import ModelRunner, kv_budget_after_profile
from kvpilot.engine.worker.sampler import Sampler, SamplingMetadata
from tests.engine.test_tiny_llama import make_tiny_llama

GIB = 1 << 30


def test_pool_gets_what_utilization_leaves_after_the_peak():
    # The worked example: 24 GiB GPU, ~14 GiB of weights, 90%: about 7.6 GiB for KV.
    assert kv_budget_after_profile(24 * GIB, 0.9, 14 * GIB) == int(24 * GIB * 0.9) - 14 * GIB


def test_no_room_for_kv_is_a_clear_error():
    with pytest.raises(ValueError, match=r"peak at .* leaving no KV cache within gpu_memory_utilization=0.5"):
        kv_budget_after_profile(24 * GIB, 0.5, 14 * GIB)


def test_the_profile_step_runs_the_sampler_and_the_draft_model(tmp_path, model_dir, monkeypatch):
    """What the GPU profile measures, run on CPU: the target's forward over max_num_batched_tokens,
    the sampler on every sampling row's logits under every filter and verifying drafts, and the
    draft model's catch-up forward over max_num_batched_tokens."""
    make_tiny_llama(tmp_path, model_dir)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculative="draft",
        draft_model=str(tmp_path),
        num_speculative_tokens=3,
    )
    runner = ModelRunner(config, tmp_path)
    forwards: dict[str, list[int]] = {"target": [], "draft": []}
    for name, model in (("target", runner.model), ("draft", runner.draft_model)):
        forward = model.forward

        def counted(input_ids, *args, _forward=forward, _seen=forwards[name]):  # noqa: ANN002
            _seen.append(input_ids.shape[0])
            return _forward(input_ids, *args)

        model.forward = counted
    sampled: list[tuple[tuple[int, ...], SamplingMetadata]] = []
    call = Sampler.__call__

    def recorded(self, logits, meta):
        sampled.append((tuple(logits.shape), meta))
        return call(self, logits, meta)

    monkeypatch.setattr(Sampler, "__call__", recorded)
    runner.run_profile_step()
    assert forwards == {"target": [64], "draft": [64]}
    ((shape, meta),) = sampled
    assert shape == (8 * (1 + 3), runner.hf_config.vocab_size)  # every sequence's row and one per draft
    assert not meta.all_greedy and meta.draft_token_ids is not None and meta.min_p is not None
    assert bool((meta.top_p < 1).all()) and bool((meta.top_k > 0).all()) and len(meta.num_logprobs) == shape[0]
