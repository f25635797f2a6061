"""Greedy output equals HuggingFace's greedy generate, however the engine batches, chunks and caches."""

from __future__ import annotations

import warnings

import pytest

from kvpilot.engine import LLM, SamplingParams
from tests.engine.conftest import make_prompts
from tests.engine.oracle import check_greedy

LENGTHS = [5, 9, 17, 31, 48, 64, 100, 150, 200, 256, 333, 400]
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in fp32


def params_for(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=8 + (i * 5) % 25, temperature=0.0)


def generate_and_check(llm: LLM, prompts: list[list[int]], hf_greedy) -> None:
    params = [params_for(i) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    reports = []
    for i, (prompt, out, p) in enumerate(zip(prompts, outputs, params)):
        ref = hf_greedy(prompt, p.max_tokens)
        report = check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, f"prompt {i} ({len(prompt)} tokens)")
        if report:
            reports.append(report)
    for report in reports:
        warnings.warn(report, stacklevel=2)


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not kv.block_tables, f"requests still hold blocks: {list(kv.block_tables)}"
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, (
        f"{kv.pool.num_blocks - kv.pool.num_free_blocks} blocks never returned to the free list"
    )
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def test_chunked_prefill_small_budget(corpus_ids, hf_greedy):
    llm = LLM(max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, dtype="float32")
    generate_and_check(llm, make_prompts(corpus_ids, LENGTHS), hf_greedy)
    assert_no_leaks(llm)


def test_prefix_caching_shared_prefix(corpus_ids, hf_greedy):
    prefix = corpus_ids[:256]
    prompts = [
        prefix + corpus_ids[300 + 9 * i : 300 + 9 * i + n]
        for i, n in enumerate([1, 3, 5, 8, 13, 21, 34, 55, 2, 4, 16, 40])
    ]
    llm = LLM(max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20, dtype="float32")
    generate_and_check(llm, prompts, hf_greedy)
    stats = llm.engine.kv.pool.stats
    assert stats.hits >= 11 * 256, (
        f"12 prompts share 256 tokens, yet only {stats.hits} of {stats.queries} tokens hit the cache"
    )
    # Again, now that every prompt is cached whole: the last token is still recomputed for its logits.
    generate_and_check(llm, prompts, hf_greedy)
    assert_no_leaks(llm)
    assert llm.engine.kv.pool._cached, "prefix-cached blocks should stay cached (evictable) after the requests finish"


def test_preemption_under_tiny_pool(corpus_ids, hf_greedy):
    num_blocks = 40  # 640 tokens: the 12 prompts together need ~2100
    llm = LLM(
        max_model_len=512,
        kv_cache_memory_bytes=num_blocks * 16 * KV_BYTES_PER_TOKEN,
        max_num_batched_tokens=256,
        dtype="float32",
    )
    assert llm.engine.kv.pool.num_blocks == num_blocks
    generate_and_check(llm, make_prompts(corpus_ids, LENGTHS), hf_greedy)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert_no_leaks(llm)


@pytest.mark.parametrize("chat", [False, True])
def test_text_prompt_and_chat(chat, tokenizer, hf_greedy):
    llm = LLM(kv_cache_memory_bytes=32 << 20, dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    if chat:
        messages = [{"role": "user", "content": "Name three primary colours."}]
        ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        out = llm.chat(messages, params)[0]
    else:
        ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
        out = llm.generate("The capital of France is", params)[0]
    assert out.prompt_token_ids == ids
    ref = hf_greedy(ids, 24)
    check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, "text prompt")
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
