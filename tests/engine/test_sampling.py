from __future__ import annotations

import pytest
import torch

from kvpilot.engine.core.request import Request
from kvpilot.engine.worker.sampler import _filtered_probs, sample
from kvpilot.engine.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.count_nonzero(_filtered_probs(logits, 1.0, 2, 1.0)) == 2
    # top_p 0.7: 0.5 alone is short of 0.7, so 0.3 joins; 0.15 is not needed.
    probs = _filtered_probs(logits, 1.0, 0, 0.7)
    assert probs[:2].gt(0).all() and probs[2:].eq(0).all()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    r = Request("r", [1], SamplingParams(temperature=1.0, seed=3))
    counts = torch.bincount(torch.tensor([sample(logits, [r], torch.Generator())[0] for _ in range(3000)]), minlength=3)
    freq = counts.float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04), freq


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    reqs = [Request(str(i), [1], SamplingParams(temperature=0.0)) for i in range(2)]
    assert sample(logits, reqs, torch.Generator()) == [1, 0]
