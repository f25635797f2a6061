"""compile_decode: a lone sequence's decode steps run a graph compiled before serving, with HF's greedy
output; every other step runs eagerly, and nothing compiles while requests are served."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.model.layers import Linear
from tests.engine.conftest import make_prompts
from tests.engine.oracle import check_greedy


@pytest.fixture(scope="module")
def compiled() -> tuple[LLM, list[int]]:
    """An fp32 engine with compile_decode, keeping no compiled artifacts (test_compile_cache.py),
    whose compiled forward counts its calls: a decode step served without it shows in the count."""
    llm = LLM(dtype="float32", compile_decode=True, kv_cache_memory_bytes=64 << 20, compile_cache_dir="off")
    runner = llm.engine.runner
    assert runner.compiled_decode is not None
    compiled_forward = runner.compiled_decode.forward
    calls = [0]

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return compiled_forward(*args)

    runner.compiled_decode.forward = counted
    return llm, calls


def test_a_lone_sequence_decodes_through_the_compiled_graph_with_hf_greedy_output(
    compiled, corpus_ids, hf_greedy
) -> None:
    llm, calls = compiled
    runner = llm.engine.runner
    assert runner.decode_kernel, "compile_decode on a CPU builds the C++ decode-attention kernel beside the graph"
    # Its graph can neither take nor cache oneDNN-packed weights (onednn_linear.py): where eager
    # steps read packed ones, every packed layer keeps its plain weight beside for the graph.
    packed = [m for m in runner.model.modules() if isinstance(m, Linear) and m.packed_weight is not None]
    serves = onednn_linear.serves(runner.device, runner.dtype, runner.cpu_kernels.onednn_dtypes)
    assert runner.onednn_layers == len(packed) and (len(packed) > 0) == serves
    assert all(m.weight.shape == m.packed_weight.shape for m in packed)
    before = calls[0]
    for i, prompt in enumerate(make_prompts(corpus_ids, [5, 31, 150, 400])):
        params = SamplingParams(max_tokens=12 + 4 * i, temperature=0.0)
        out = llm.generate([prompt], params)[0].outputs[0]
        ref = hf_greedy(prompt, params.max_tokens)
        check_greedy(out.token_ids, ref.tokens, ref.logits, f"compiled decode, {len(prompt)}-token prompt")
        # The first token comes from the prefill; every later one from a compiled decode step.
        assert calls[0] - before == len(out.token_ids) - 1, "a lone sequence's decode step ran eagerly"
        before = calls[0]


def test_steps_of_several_sequences_run_eagerly_and_agree(compiled, corpus_ids, hf_greedy) -> None:
    llm, calls = compiled
    prompts = make_prompts(corpus_ids, [9, 48, 100])
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (6, 10, 16)]
    before = calls[0]
    outputs = llm.generate(prompts, params)
    for prompt, out, p in zip(prompts, outputs, params):
        ref = hf_greedy(prompt, p.max_tokens)
        check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, f"batched, {len(prompt)}-token prompt")
    # Only the last request's final steps, once it runs alone, are single-sequence decodes.
    assert calls[0] - before == 16 - 10


def test_a_step_the_graph_was_not_traced_for_runs_eagerly(compiled, corpus_ids, hf_greedy) -> None:
    """The compiled forward runs without Dynamo's guards, so the runner itself keeps it to the steps
    it was traced for: with the C++ kernels switched off (a graph traced with them calls them), a
    lone sequence decodes eagerly, with HF's tokens, and through the graph again once they are on."""
    llm, calls = compiled
    runner = llm.engine.runner
    prompt = make_prompts(corpus_ids, [37])[0]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ref = hf_greedy(prompt, params.max_tokens)
    schemes = runner.matmul_kernels
    runner.use_cpu_kernels(False)
    try:
        before = calls[0]
        out = llm.generate([prompt], params)[0].outputs[0]
        check_greedy(out.token_ids, ref.tokens, ref.logits, "kernels off: eager decode")
        assert calls[0] == before, "a step the graph was not traced for ran through it"
    finally:
        runner.use_cpu_kernels(True, schemes)
    before = calls[0]
    out = llm.generate([prompt], params)[0].outputs[0]
    check_greedy(out.token_ids, ref.tokens, ref.logits, "kernels on again: compiled decode")
    assert calls[0] - before == len(out.token_ids) - 1


def test_serve_takes_the_flag_and_leaves_it_off_by_default() -> None:
    from kvpilot.engine.cli import build_parser, engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["serve"])).compile_decode is False
    assert engine_config_from_args(build_parser().parse_args(["serve", "--compile-decode"])).compile_decode is True
    assert engine_config_from_args(build_parser().parse_args(["serve"])).compile_cache_dir is None
    args = build_parser().parse_args(["serve", "--compile-decode", "--compile-cache-dir", "/model-cache/compiled"])
    assert engine_config_from_args(args).compile_cache_dir == "/model-cache/compiled"


def test_a_pool_too_small_to_trace_the_decode_step_is_refused_with_its_size() -> None:
    tokens_per_block, bytes_per_token = 16, 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in fp32
    with pytest.raises(ValueError, match="more than 40 tokens, this one holds 32"):
        LLM(
            dtype="float32",
            compile_decode=True,
            block_size=tokens_per_block,
            kv_cache_memory_bytes=32 * bytes_per_token,
        )


def test_without_a_cpp_compiler_it_is_refused_with_what_to_do(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        LLM(dtype="float32", compile_decode=True, kv_cache_memory_bytes=16 << 20)
