from __future__ import annotations

import pytest
import torch

from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.worker.sampler import RowPenalty, Sampler, SamplingMetadata, filtered_probs


def metadata(*params: SamplingParams, seeded: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    greedy = [p.greedy for p in params]
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params]),
        top_p=torch.tensor([p.top_p for p in params]),
        greedy=torch.tensor(greedy),
        all_greedy=all(greedy),
        generators=seeded or {},
    )


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
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    probs = filtered_probs(logits, metadata(SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams()))
    assert torch.count_nonzero(probs[0]) == 2
    # top_p 0.7: 0.5 alone is short of 0.7, so 0.3 joins; 0.15 is not needed.
    assert probs[1, :2].gt(0).all() and probs[1, 2:].eq(0).all()
    # Each row its own settings: the third row is untouched.
    assert torch.allclose(probs[2], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]] * 3000))
    tokens = Sampler(torch.Generator().manual_seed(3))(
        logits, metadata(*[SamplingParams(temperature=1.0)] * 3000)
    ).tokens
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04), freq


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    assert Sampler(torch.Generator())(logits, metadata(*params)).tokens.tolist() == [1, 0]


def test_tiny_temperature_is_greedy_not_an_overflow():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1e-50), SamplingParams(temperature=1.0)]
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, metadata(*params)).tokens
    assert tokens[0] == 1 and 0 <= tokens[1] < 3


def test_a_seeded_row_samples_the_same_whatever_its_neighbours():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    alone = Sampler(torch.Generator().manual_seed(0))(
        logits, metadata(params, seeded={0: torch.Generator().manual_seed(7)})
    ).tokens
    batch = torch.cat([torch.randn(3, 50), logits])
    mixed = Sampler(torch.Generator().manual_seed(99))(
        batch, metadata(*[SamplingParams(temperature=1.0)] * 3, params, seeded={3: torch.Generator().manual_seed(7)})
    ).tokens
    assert mixed[3] == alone[0]


def test_penalties_and_banned_tokens_change_greedy_choices():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.0]] * 4)
    meta = metadata(*[SamplingParams(temperature=0.0)] * 4)
    ids = torch.tensor([0, 0])
    meta.penalties = [
        RowPenalty(0, ids, torch.tensor([0]), presence=0.0, frequency=0.1, repetition=1.0),  # 3.0 - 0.2 < 2.9
        RowPenalty(1, ids, torch.tensor([0]), presence=0.05, frequency=0.0, repetition=1.0),  # 2.95 > 2.9
        RowPenalty(2, ids, torch.tensor([0, 2]), presence=0.0, frequency=0.0, repetition=2.0),  # 1.5, and -1 -> -2
    ]
    meta.banned = {3: [0, 1]}
    out = Sampler(torch.Generator())(logits, meta)
    assert out.tokens.tolist() == [1, 0, 1, 3]
    assert logits[2, 2] == -2.0


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    meta = metadata(SamplingParams(min_p=0.5))
    meta.min_p = torch.tensor([0.5])
    probs = filtered_probs(logits, meta)
    assert probs[0, :2].gt(0).all() and probs[0, 2:].eq(0).all()  # 0.15 < 0.5 x 0.5


def test_logprobs_are_the_models_own_before_penalties():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    meta = metadata(SamplingParams(temperature=0.0))
    meta.num_logprobs = {0: 2}
    meta.banned = {0: [0]}
    out = Sampler(torch.Generator())(logits, meta)
    assert out.tokens.tolist() == [1]
    chosen, top = out.logprobs[0]
    assert abs(chosen - torch.log(torch.tensor(0.3)).item()) < 1e-6
    assert [t for t, _ in top] == [0, 1]
