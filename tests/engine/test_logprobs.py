"""Log-probabilities, min_tokens and penalties on the real model, against HF where HF has the answer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from tests.engine.conftest import make_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_bytes=48 << 20, max_model_len=600, max_num_batched_tokens=64, dtype="float32")


def test_output_logprobs_match_hf_top_tokens(llm, corpus_ids, hf_greedy):
    prompt = make_prompts(corpus_ids, [40])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0].outputs[0]
    ref = hf_greedy(prompt, 8)
    assert out.token_ids == ref.tokens and len(out.logprobs) == 8
    for position, hf_logits in zip(out.logprobs, ref.logits):
        hf = torch.log_softmax(hf_logits.float(), dim=-1)
        top = hf.topk(5)
        assert [lp.token_id for lp in position.top] == top.indices.tolist()
        assert position.chosen.token_id == top.indices[0].item()
        assert abs(position.chosen.logprob - top.values[0].item()) < 1e-3
        assert all(abs(lp.logprob - v) < 1e-3 for lp, v in zip(position.top, top.values.tolist()))


def test_prompt_logprobs_match_hf_over_chunks(llm, corpus_ids, hf_model):
    prompt = make_prompts(corpus_ids, [150])[0]  # three chunks of at most 64 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry.chosen.token_id == prompt[p]
        assert abs(entry.chosen.logprob - hf[p - 1, prompt[p]].item()) < 1e-3
        assert [lp.token_id for lp in entry.top] == hf[p - 1].topk(2).indices.tolist()
    assert out.num_cached_tokens == 0


def test_min_tokens_holds_back_eos(llm):
    chat = [{"role": "user", "content": "Say OK."}]
    short = llm.chat(chat, SamplingParams(max_tokens=100, temperature=0))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    held = llm.chat(chat, SamplingParams(max_tokens=100, temperature=0, min_tokens=20))[0].outputs[0]
    assert len(held.token_ids) >= 20
    assert held.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # the same until EOS would come


def test_penalties_reduce_repetition(llm):
    prompt = "one one one one one one one one one one one"
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    token, count = Counter(plain.token_ids).most_common(1)[0]
    assert count >= 5  # greedy decoding loops on this prompt
    for params in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=2.0)):
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **params))[
            0
        ].outputs[0]
        assert out.token_ids.count(token) < count, params
