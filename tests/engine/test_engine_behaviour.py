"""Engine behaviour on the real model: validation, stops, seeds, aborts."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu.features import kernel_path, read_cpu_flags
from kvpilot.engine.worker.sampler import SamplerOutput, SamplingMetadata
from tests.engine.conftest import make_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_bytes=48 << 20, max_model_len=600, dtype="float32")


def assert_all_blocks_free(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not llm.engine.kv.block_tables


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1] * 601, SamplingParams(), "more than max_model_len=600"),
        ([10**9], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_prompts_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert_all_blocks_free(llm)


def test_negative_max_tokens_is_a_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_engine_config_errors_are_clear():
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        LLM(kv_cache_memory_bytes=1 << 20, max_model_len=4096)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=12)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm, corpus_ids):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = corpus_ids[:40]
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = make_prompts(corpus_ids, [12, 90, 200, 33])
    mixed = llm.generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(max_tokens=30, temperature=1.0)] * 2
        + [params]
        + [SamplingParams(max_tokens=30, temperature=1.0)] * 2,
    )
    assert mixed[2].outputs[0].token_ids == alone
    different_seed = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    )
    assert different_seed[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_stop_string_cuts_text(llm, tokenizer):
    greedy = llm.generate(["The capital of France is"], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    assert "Paris" in greedy.text
    stopped = llm.generate(["The capital of France is"], SamplingParams(max_tokens=20, temperature=0, stop=["Paris"]))[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == greedy.text[: greedy.text.index("Paris")]


def test_stop_token_ids_and_ignore_eos(llm):
    greedy = llm.generate(["The capital of France is"], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    stop_at = greedy.token_ids[3]
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1] and out.stop_reason == stop_at
    chat = [{"role": "user", "content": "Say OK."}]
    short = llm.chat(chat, SamplingParams(max_tokens=200, temperature=0))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 200  # ended by EOS
    long = llm.chat(chat, SamplingParams(max_tokens=len(short.token_ids) + 5, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == len(short.token_ids) + 5


def test_n_completions_and_max_model_len_cap(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    capped = llm.generate([[100] * 595], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 5


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request = engine.add_request("Tell me a long story", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    engine.abort(request.request_id)
    assert request.finish_reason.value == "abort"
    assert not engine.has_unfinished()
    assert_all_blocks_free(llm)


def test_the_default_dtype_is_bf16_where_the_cpu_has_it():
    llm = LLM(kv_cache_memory_bytes=16 << 20)
    assert llm.engine.runner.dtype == (torch.bfloat16 if kernel_path(read_cpu_flags()).bf16 else torch.float32)


def test_bfloat16_on_cpu_runs_and_agrees_on_an_easy_prompt():
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=16 << 20)
    k_cache = llm.engine.runner.kv_caches[0][0]
    assert k_cache.dtype.is_floating_point and k_cache.element_size() == 2
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert "Paris" in out.text


def test_a_request_whose_step_fails_is_dropped_alone(llm):
    engine = llm.engine
    execute = engine.runner.execute

    def flaky(scheduler_output):
        if any(item.request.params.max_tokens == 13 for item in scheduler_output.scheduled):
            raise RuntimeError("kernel fault")
        return execute(scheduler_output)

    engine.runner.execute = flaky
    try:
        good = engine.add_request("The capital of France is", SamplingParams(max_tokens=6, temperature=0))
        bad = engine.add_request("Hello", SamplingParams(max_tokens=13, temperature=0))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        engine.runner.execute = execute
    failed = [o for o in outputs if o.request_id == bad.request_id]
    assert len(failed) == 1 and failed[0].finish_reason == "abort" and "kernel fault" in failed[0].error
    assert good.finish_reason.value == "length" and len(good.output_token_ids) == 6
    reference = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert good.output_token_ids == reference.token_ids
    assert_all_blocks_free(llm)


def test_a_failed_steps_rerun_samples_a_seeded_request_as_if_nothing_had_failed(llm):
    seeded = SamplingParams(max_tokens=10, temperature=1.5, seed=7)
    alone = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    runner = llm.engine.runner
    sampler = runner.sampler

    def flaky(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Every batched step fails after sampling has drawn from the seeded generator: each is rerun
        # request by request.
        out = sampler(logits, meta)
        if logits.shape[0] > 1:
            raise RuntimeError("fault after sampling")
        return out

    runner.sampler = flaky
    try:
        outputs = llm.generate(
            ["Once upon a time", "The capital of France is"], [seeded, SamplingParams(max_tokens=10, temperature=0)]
        )
    finally:
        runner.sampler = sampler
    assert outputs[0].outputs[0].token_ids == alone
    assert_all_blocks_free(llm)
