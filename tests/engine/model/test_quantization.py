"""INT8 and INT4 weight-only and W8A8 linear layers: really low-bit, close to the weights, served end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.contract.config import CAPABILITIES, EngineConfig
from kvpilot.engine.model import quantization
from kvpilot.engine.model.layers import FusedLinear, Linear
from kvpilot.engine.model.quantization import Int4WeightOnly, Int8Dynamic, Int8WeightOnly


def _quantized(layer: Linear, weight: torch.Tensor) -> Linear:
    layer.weight.weight_loader(layer.weight, weight)  # type: ignore[attr-defined]
    layer.process_weights_after_loading()
    return layer


def _layer_bytes(layer: Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))


@pytest.mark.parametrize(
    "scheme", [Int8WeightOnly(), Int4WeightOnly(32), Int4WeightOnly(64)], ids=["int8", "int4-g32", "int4-g64"]
)
def test_quantized_matmul_matches_its_dequantized_weight(scheme):
    torch.manual_seed(0)
    weight = torch.randn(960, 576) * 0.05
    layer = _quantized(Linear(576, 960, quantization=scheme), weight)
    assert "weight" not in dict(layer.named_parameters())
    deq = scheme.dequantized(layer)
    # Rounding costs half a step (int8: 1/127 of the row's largest value, int4: 1/15 of a group's
    # range, at most the whole tensor's); the bf16 scales add up to about as much again.
    step = weight.abs().amax(1, keepdim=True) / 127 if scheme.name == "int8" else (weight.amax() - weight.amin()) / 15
    assert ((deq - weight).abs() <= step).all()
    x = torch.randn(5, 576).bfloat16()
    expected = x.float() @ deq.bfloat16().float().T
    assert torch.allclose(layer(x).float(), expected, atol=0.05, rtol=0.02)


def test_int4_reproduces_weights_that_came_from_int4():
    torch.manual_seed(1)
    # Weights already on a 4-bit grid per group of 32 (as a Q4_1 checkpoint dequantizes to).
    scale = torch.rand(576, 18, 1) * 0.01 + 0.001
    low = torch.randn(576, 18, 1) * 0.05
    q = torch.randint(0, 16, (576, 18, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans its whole range
    weight = (q * scale + low).view(576, 576)
    layer = _quantized(Linear(576, 576, quantization=Int4WeightOnly(32)), weight)
    # Exact up to the bf16 rounding of each group's scale and zero.
    assert (Int4WeightOnly(32).dequantized(layer) - weight).abs().max() < 2e-3


def test_weights_are_really_stored_in_low_bits():
    weight = torch.randn(3072, 576)
    fp16_bytes = weight.numel() * 2
    int8 = _layer_bytes(_quantized(Linear(576, 3072, quantization=Int8WeightOnly()), weight))
    int4_g32 = _layer_bytes(_quantized(Linear(576, 3072, quantization=Int4WeightOnly(32)), weight))
    int4_g64 = _layer_bytes(_quantized(Linear(576, 3072, quantization=Int4WeightOnly(64)), weight))
    assert int8 <= 0.55 * fp16_bytes
    # Packed 4-bit values are 0.25x; a bf16 scale and zero per group add 4 / (2 x group) of fp16.
    assert int4_g32 <= 0.3125 * fp16_bytes and int4_g64 <= 0.30 * fp16_bytes


def test_fused_shards_load_then_quantize():
    torch.manual_seed(2)
    layer = FusedLinear(64, {"q": 64, "k": 32, "v": 32}, quantization=Int8WeightOnly())
    shards = {name: torch.randn(size, 64) for name, size in layer.shard_sizes.items()}
    for name, tensor in shards.items():
        layer.shard_loader(layer.weight, tensor, name)
    layer.process_weights_after_loading()
    deq = Int8WeightOnly().dequantized(layer)
    assert torch.allclose(deq, torch.cat(list(shards.values())), atol=0.03)


def test_group_must_divide_the_input_width():
    with pytest.raises(ValueError, match="does not divide"):
        _quantized(Linear(48, 8, quantization=Int4WeightOnly(32)), torch.randn(8, 48))


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_each_scheme_serves_the_embedded_model_deterministically(scheme):
    if scheme in CAPABILITIES.cpu_only_quantization and EngineConfig().torch_device().type != "cpu":
        # bench/gpu_check.sh runs this file on CUDA, where the scheme is refused, never served.
        with pytest.raises(ValueError, match="runs only on CPUs"):
            LLM(kv_cache_memory_bytes=32 << 20, quantization=scheme)
        return
    llm = LLM(kv_cache_memory_bytes=32 << 20, quantization=scheme)
    reference = LLM(kv_cache_memory_bytes=32 << 20)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.weight_bytes < 0.75 * reference.engine.runner.weight_bytes
    assert "Paris" in llm.generate(prompts[:1], params)[0].outputs[0].text


def test_a_quantized_layer_holds_no_full_precision_weight_until_it_loads():
    layer = Linear(576, 1536, quantization=Int4WeightOnly(32))
    assert layer.weight.numel() == 0  # a model too large at full precision still gets built
    layer.weight.weight_loader(layer.weight, torch.randn(1536, 576))  # type: ignore[attr-defined]
    assert layer.weight.shape == (1536, 576)
    assert Linear(576, 1536).weight.shape == (1536, 576)  # unquantized layers as before


def _counting(monkeypatch: pytest.MonkeyPatch, kernel_name: str) -> list[int]:
    """The token count of each call of the packed kernel `kernel_name` from here on."""
    calls: list[int] = []
    kernel = getattr(torch.ops.aten, kernel_name)

    def counted(a: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(a.shape[0])
        return kernel(a, *rest)

    monkeypatch.setattr(quantization.torch.ops.aten, kernel_name, counted)
    return calls


@pytest.mark.parametrize(
    ("scheme", "kernel_name", "threshold"),
    [
        (Int8WeightOnly(), "_weight_int8pack_mm", "INT8_DENSE_TOKENS"),
        (Int4WeightOnly(32), "_weight_int4pack_mm_for_cpu", "INT4_DENSE_TOKENS"),
    ],
    ids=["int8", "int4"],
)
def test_steps_of_many_tokens_take_the_dense_gemm_with_the_same_weight(
    monkeypatch: pytest.MonkeyPatch, scheme: quantization.LinearQuantization, kernel_name: str, threshold: str
) -> None:
    """The packed kernels serve decode-sized steps; from INT8_DENSE_TOKENS / INT4_DENSE_TOKENS
    tokens on, the layer's low-bit weight is dequantized for a dense GEMM (faster for prefill; INT4
    unpacks PyTorch's CPU layout), to within bf16 rounding of the packed kernel."""
    torch.manual_seed(0)
    layer = nn.Module()
    scheme.quantize(layer, torch.randn(128, 64) * 0.05)
    dense_tokens = getattr(quantization, threshold)
    x = torch.randn(dense_tokens + 16, 64).to(torch.bfloat16)
    calls = _counting(monkeypatch, kernel_name)
    dense = scheme.matmul(layer, x)
    assert calls == []
    half = dense_tokens // 2
    packed = torch.cat([scheme.matmul(layer, x[i : i + half]) for i in range(0, x.shape[0], half)])
    assert calls == [half, half, 16]
    reference = x.float() @ scheme.dequantized(layer).T
    for y in (dense, packed):
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), reference, rtol=0.02, atol=0.02)


def test_an_int4_layer_of_a_width_not_a_multiple_of_the_block_always_takes_the_packed_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its last block of rows is laid out otherwise, which the unpacking does not read."""
    torch.manual_seed(0)
    scheme, layer = Int4WeightOnly(32), nn.Module()
    scheme.quantize(layer, torch.randn(quantization.cpu_int4_layout().rows * 3 // 2, 64) * 0.05)
    x = torch.randn(quantization.INT4_DENSE_TOKENS + 16, 64).to(torch.bfloat16)
    calls = _counting(monkeypatch, "_weight_int4pack_mm_for_cpu")
    y = scheme.matmul(layer, x)
    assert calls == [x.shape[0]]
    assert torch.allclose(y.float(), x.float() @ scheme.dequantized(layer).T, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("shape", [(64, 128), (960, 576), (128, 1536)])
def test_the_cpu_int4_layout_unpacks_to_the_values_packed(shape: tuple[int, int]) -> None:
    q = torch.randint(0, 16, shape, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    assert torch.equal(quantization._unpack_cpu_int4pack(packed, *shape).to(torch.int32), q)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_the_cpu_int4_layout_is_read_whatever_isa_aten_runs(capability: str) -> None:
    """ATen packs blocks of 64 rows with AVX512, 32 with AVX2 and 32 adjacent rows without either
    (a forced ISA above this CPU's runs its own): the engine reads the layout off a probe, so the
    values come back on each."""
    code = (
        "import torch; from kvpilot.engine.model import quantization as qz\n"
        "q = torch.randint(0, 16, (960, 576), dtype=torch.int32)\n"
        "packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)\n"
        "assert torch.equal(qz._unpack_cpu_int4pack(packed, 960, 576).to(torch.int32), q)\n"
        "print(torch.backends.cpu.get_cpu_capability(), *qz.cpu_int4_layout())"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    isa, rows, adjacent = done.stdout.split()
    assert (int(rows), adjacent) == {"AVX512": (64, "False"), "AVX2": (32, "False")}.get(isa, (32, "True"))


def _bf16_error_bound(exact: torch.Tensor) -> torch.Tensor:
    """How far from `exact` (float64) its correct rounding to bf16 lies, plus fp32 noise."""
    return (exact.to(torch.bfloat16).double() - exact).abs() + 1e-6 * exact.abs()


def test_dequantization_without_kernels_keeps_fp32_scales_and_rounds_once(monkeypatch):
    """Where no kernel reads the scales (CUDA), a checkpoint's fp32 scales stay fp32, and the weight
    the matmul uses is (q - zp) x s computed in fp32 then rounded once to the activations' bf16:
    every value as close to the exact one as its correct rounding (the bf16 computation, two
    roundings, is not). Run on CPU tensors, with the kernel-less layout."""
    monkeypatch.setattr(quantization, "_has_kernels", lambda device: False)
    gen = torch.Generator().manual_seed(0)
    out_features, in_features, group = 96, 256, 32
    q = torch.randint(-8, 8, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, in_features // group, generator=gen) * 0.02 + 1e-3
    zero_point = torch.randint(-4, 5, scale.shape, generator=gen)
    int4, layer = Int4WeightOnly(group), torch.nn.Module()
    int4.load_quantized(layer, q, scale, zero_point)
    assert layer.scales_and_zeros.dtype == torch.float32
    exact = (
        (q.double().view(out_features, -1, group) - zero_point.double()[..., None]) * scale.double()[..., None]
    ).view(out_features, in_features)
    bound = _bf16_error_bound(exact)
    assert bool(((int4._weight(layer, torch.bfloat16).double() - exact).abs() <= bound).all())
    torch.testing.assert_close(int4.dequantized(layer).double(), exact, rtol=1e-6, atol=1e-7)
    # The bf16 computation this replaces: (q - 8) x s and + z each rounded.
    s16, z16 = scale.bfloat16(), (-zero_point * scale).bfloat16()
    q16 = (q.float() + 8).bfloat16().view(out_features, -1, group)
    twice = ((q16 - 8) * s16[..., None] + z16[..., None]).view(out_features, in_features).double()
    assert bool(((twice - exact).abs() > bound).any())

    int8, layer8 = Int8WeightOnly(), torch.nn.Module()
    channel_scale = torch.rand(out_features, 1, generator=gen) * 0.02 + 1e-3
    int8.load_quantized(layer8, q, channel_scale, None)
    assert layer8.scales.dtype == torch.float32
    exact8 = q.double() * channel_scale.double()
    assert bool(((int8._weight(layer8, torch.bfloat16).double() - exact8).abs() <= _bf16_error_bound(exact8)).all())


def test_scales_stay_bf16_where_the_cpu_kernels_read_them():
    layer = torch.nn.Module()
    Int4WeightOnly(32).load_quantized(layer, torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2), None)
    assert layer.scales_and_zeros.dtype == torch.bfloat16 and layer.int4_layout is not None


def _w8a8_reference(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """Per-token symmetric int8 activations times the int8 weight, in float64."""
    x_scale = x.double().abs().amax(1, keepdim=True) / 127
    xq = torch.round(x.double() / x_scale)
    return (xq @ layer.qweight.double().T) * x_scale * layer.scales.double()


@pytest.mark.parametrize("integer_kernel", [True, False], ids=["int8-gemm", "fp32-gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_quantizes_activations_per_token_on_either_gemm(monkeypatch, integer_kernel, dtype):
    torch.manual_seed(3)
    weight = torch.randn(960, 576) * 0.05
    scheme = Int8Dynamic(integer_kernel)
    layer = _quantized(Linear(576, 960, quantization=scheme), weight)
    assert layer.qweight.dtype == torch.int8 and _layer_bytes(layer) <= 0.51 * weight.numel() * 2
    # Rows of very different magnitudes: one scale per token, not one per step.
    x = (torch.randn(6, 576) * torch.tensor([0.01, 1, 100, 3, 0.5, 20])[:, None]).to(dtype)
    calls: list[tuple[int, ...]] = []
    int_mm = torch._int_mm
    monkeypatch.setattr(quantization.torch, "_int_mm", lambda a, b: calls.append(tuple(a.shape)) or int_mm(a, b))
    y = layer(x)
    assert calls == ([(6, 576)] if integer_kernel else [])
    assert y.dtype == dtype
    reference = _w8a8_reference(x.float(), layer)
    # The integer products sum exactly either way; what remains is fp32 (and bf16) rounding.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    error = (y.double() - reference).abs()
    assert (error <= tolerance * reference.abs().amax(1, keepdim=True)).all(), error.amax(1)
    exact = x.double() @ weight.double().T
    # Each row within a few quantization steps of its exact product.
    assert ((y.double() - exact).abs().amax(1) < 0.03 * exact.abs().amax(1)).all()


def test_w8a8_runs_only_on_cpus():
    layer = nn.Module()
    q = torch.zeros(64, 64, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match="w8a8 runs only on CPUs"):
        Int8Dynamic(True).load_quantized(layer, q, torch.ones(64, 1, device="meta"), None)


def test_w8a8_is_declared_for_cpus_only():
    """The planner reads CAPABILITIES: W8A8 is offered where its kernel runs, on CPUs, and nowhere else."""
    assert "w8a8" in CAPABILITIES.cpu_only_quantization and "w8a8" not in CAPABILITIES.quantization
    assert EngineConfig(quantization="w8a8").quantization == "w8a8"
    assert type(quantization.for_scheme("w8a8", 32)[0]) is Int8Dynamic
