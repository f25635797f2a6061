"""Full-precision weights served from oneDNN's blocked layout on an x86 CPU: the same products as
the plain weight; a tied LM head packed as its own copy, counted in the weights; the engine's greedy
tokens HF's with and without packing; a layer that torch.compile traces (compile_decode) reads the
plain weight it keeps beside the packed one (tests/engine/cpu/test_compiled_decode.py for the engine)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu import features as cpu_features
from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.model.layers import Linear, pack_for_onednn
from tests.engine.conftest import make_prompts
from tests.engine.oracle import check_greedy


def test_this_torch_has_the_kernels() -> None:
    assert onednn_linear.available()


def _layer(dtype: torch.dtype, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=bias)
    weight = torch.randn(960, 576, dtype=dtype) / 24
    layer.weight.data = weight.clone()
    b = torch.randn(960, dtype=dtype) if bias else None
    if b is not None:
        layer.bias.data = b.clone()
    return layer, weight, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_the_plain_weights_product(dtype: torch.dtype, bias: bool) -> None:
    layer, weight, b = _layer(dtype, bias)
    # The engine packs a dtype only where the CPU has its arithmetic (test_cpu_features): oneDNN
    # refuses bf16 weights without AVX512BW/VL/DQ (an AVX2-only CPU), where the plain layer serves.
    if onednn_linear.serves(torch.device("cpu"), dtype, cpu_features.onednn_dtypes(cpu_features.read_cpu_flags())):
        assert layer.pack_for_onednn()
        assert "weight" not in layer._parameters and layer.packed_weight.is_mkldnn
        assert not layer.pack_for_onednn()  # once only
    else:
        assert layer.packed_weight is None and "weight" in layer._parameters
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for rows in (1, 2, 5, 64):
        x = torch.randn(rows, 576, dtype=dtype)
        expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(layer(x).float(), expected, rtol=tolerance, atol=tolerance * 4)


def test_a_quantized_layer_is_left_as_it_is() -> None:
    layer, _, _ = _layer(torch.float32, bias=False)
    layer.quantization = object()  # type: ignore[assignment]
    assert not layer.pack_for_onednn() and layer.packed_weight is None


def test_the_engine_packs_its_linear_layers_and_counts_the_tied_heads_copy(
    monkeypatch, caplog, corpus_ids, hf_greedy
) -> None:
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.worker.model_runner"):
        llm = LLM(kv_cache_memory_bytes=16 << 20, dtype="float32")
    runner = llm.engine.runner
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # qkv, o, gate_up and down in each decoder layer, and the head
    assert runner.onednn_layers == len(linears) == 4 * model.config.num_hidden_layers + 1
    assert f"onednn_layers={runner.onednn_layers} " in caplog.text
    # The embedding keeps the tied weight; the head serves its own packed copy of it, counted.
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.packed_weight.shape == embedding.shape and "weight" not in model.lm_head._parameters
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda cpuinfo=None: frozenset())
    plain = LLM(kv_cache_memory_bytes=16 << 20, dtype="float32").engine.runner
    assert plain.onednn_layers == 0
    assert runner.weight_bytes - plain.weight_bytes == embedding.numel() * 4  # fp32
    prompts = make_prompts(corpus_ids, [7, 23])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref = hf_greedy(prompt, 10)
        check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, f"packed: prompt {i}")


def test_a_cpu_without_x86_vector_flags_keeps_the_plain_weights(monkeypatch, corpus_ids, hf_greedy) -> None:
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda cpuinfo=None: frozenset())
    llm = LLM(kv_cache_memory_bytes=16 << 20)
    runner = llm.engine.runner
    assert runner.cpu_kernels.name == "fp32" and runner.onednn_layers == 0
    assert all(m.packed_weight is None for m in runner.model.modules() if isinstance(m, Linear))
    prompts = make_prompts(corpus_ids, [11])
    out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))[0]
    ref = hf_greedy(prompts[0], 10)
    check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, "plain weights")


def test_pack_for_onednn_counts_the_layers_it_packed() -> None:
    model = torch.nn.Sequential(_layer(torch.float32, False)[0], _layer(torch.float32, True)[0])
    assert pack_for_onednn(model) == 2 and pack_for_onednn(model) == 0


def test_a_layer_that_keeps_its_plain_weight_serves_eager_calls_packed_and_traced_ones_plain() -> None:
    layer, weight, _ = _layer(torch.float32, bias=False)
    assert layer.pack_for_onednn(keep_plain=True)
    assert layer.weight is layer._parameters["weight"] and layer.packed_weight.is_mkldnn
    # Each path marked by a different weight: the packed one scaled, so that which one ran shows.
    layer.packed_weight = onednn_linear.pack(weight * 2)
    x = torch.randn(3, 576)
    plain, packed = torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, weight * 2)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), packed, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.compile(layer, backend="eager")(x), plain, rtol=1e-4, atol=1e-4)
