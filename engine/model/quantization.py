"""Quantization of linear layers: weight-only INT8 per output channel and INT4 group-wise, and W8A8
(INT8 weights and activations).

A quantized layer loads its checkpoint weight as usual (through its weight_loader, fused shards
included), then `process_weights_after_loading` replaces it with the low-bit form and frees it:
INT8 as int8 with one bf16 scale per output channel; INT4 as two 4-bit values per byte (PyTorch's
packed layout for its int4 matmul) with a bf16 scale and zero per group of input columns. A
layer can also take values that were quantized elsewhere (`load_quantized`: a compressed-tensors
checkpoint's integers, scales and zero points), stored in the same form.

Kernels: on CPU, PyTorch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, which take
bf16 activations (fp32 activations are cast: these kernels are 10-100x slower on fp32). Both are
decode kernels: their time grows with the tokens of a step as a dense GEMM's does not, so from
INT8_DENSE_TOKENS / INT4_DENSE_TOKENS tokens on (prefill chunks, large batches) the layer
dequantizes its weight for that matmul and runs the dense GEMM instead
(bench/history/2026-11-30-quantization.md, "Routing by tokens per step"): INT8 from its plain int8
weight, INT4 by unpacking PyTorch's CPU layout
(`_unpack_cpu_int4pack`; layers whose output width is not a multiple of 64 keep the packed
kernel). Decode-sized INT4 and INT8 matmuls run cpu_kernels' C++ kernels where the CPU has
AVX2 or wider: on a CPU without AVX512-BF16 its INT4 one takes the activations as 16-bit integers
per group (cpu_kernels.int4_activations), finer than their bf16. Elsewhere (CUDA) the weight is
dequantized on the fly for each matmul: correct, and the memory saving holds, but not yet the
speed of a low-bit kernel (no GPU was at hand to validate CUDA's int4 layout). There no kernel
reads the scales, so they stay fp32 (a checkpoint's scales are not rounded to bf16), and every
dequantization computes in fp32 and rounds once to the activations' dtype.

W8A8 stores its weight as INT8 does and quantizes the activations too, per token (row) at each
matmul, symmetric, from the row's largest magnitude (dynamic: no calibration). The int8 x int8
products sum exactly in int32 (`torch._int_mm`, oneDNN's int8 GEMM: VNNI / AMX-INT8 dot products
where the CPU has them) and are scaled back by both scales in fp32. Without integer dot products
(the "fp32" CPU kernel path, kvpilot.engine.cpu.features) the same numbers come from an
fp32 GEMM of the integer values (exact while a row's sum stays under 2^24). It runs on CPUs only.
"""

from __future__ import annotations

import abc
import functools
from typing import NamedTuple

import torch
from torch import nn

from kvpilot.engine.cpu import kernels as cpu_kernels

# PyTorch's int4 kernel: values 0..15 around a midpoint, w = (q - 8) * scale + zero.
_INT4_MID = 8
# Inner K tiles of PyTorch's packed int4 layout on CPU.
_INNER_K_TILES = 2
# From this many tokens in one matmul, INT8 on CPU dequantizes and runs the dense GEMM: the packed
# kernel's time grows with the tokens and the GEMM's far less, so past a crossover (near 64 tokens
# on the embedded model's layers) dequantizing pays. Not from 64 itself: a decode step of 64
# sequences (max_num_seqs' default) would then dequantize every layer each step, the 49152-row LM
# head among them; prefill chunks, from 128 tokens, keep the dense route. Measured:
# bench/history/2026-12-01-cpu-kernel-paths-w8a8.md, "The dense-route thresholds" and the section
# after it.
INT8_DENSE_TOKENS = 128
# The same for INT4, whose dense route also unpacks PyTorch's layout, a cost per layer whatever the
# step: the crossover comes later, between 256 and 512 tokens on the embedded model's layers
# (bench/history/2026-11-30-quantization.md, "Routing by tokens per step").
INT4_DENSE_TOKENS = 512
# From this many output rows kvpilot's INT8 matmul (cpu/kernels.py) beats PyTorch's packed one at
# decode sizes (weights read from memory: `python -m bench.cpu_kernels --copies 8`): a wide layer
# streams its weight at the memory's speed, while on narrow ones (576 and 960 rows) the kernel's
# fixed cost per call is not paid back, so they keep PyTorch's
# (bench/history/2026-12-02-serving-cpu-decode.md, "Matmuls in C++").
INT8_KERNEL_ROWS = 3072


class Int4Layout(NamedTuple):
    """PyTorch's CPU int4 layout: per block of `rows` output channels and input column k, rows / 2
    bytes, byte i holding rows i and i + rows / 2 (low, high nibble), or rows 2i and 2i + 1 where
    `adjacent`; a last block of fewer rows differs. ATen picks it by the vector ISA it runs (64
    rows with AVX512, 32 with AVX2, 32 adjacent without either): `cpu_int4_layout()`."""

    rows: int
    adjacent: bool


_INT4_LAYOUTS = tuple(Int4Layout(rows, adjacent) for rows in (64, 32, 16) for adjacent in (False, True))


class LinearQuantization(abc.ABC):
    """How one linear layer stores and multiplies its weight."""

    name: str
    # Whether a matmul of a few tokens runs kvpilot's C++ kernel (cpu/kernels.py) instead of
    # PyTorch's packed one: set by the model runner once it has loaded the library.
    cpu_kernel: bool = False

    @abc.abstractmethod
    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        """Replace `weight` ([out, in]) by the layer's low-bit buffers."""

    @abc.abstractmethod
    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T for 2-D x, in x's dtype."""

    @abc.abstractmethod
    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the buffers stand for, [out, in], fp32."""

    @abc.abstractmethod
    def load_quantized(
        self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> None:
        """Store weights quantized elsewhere, in compressed-tensors' terms: w = (q - zero_point) x
        scale, with q signed ([out, in], int8) and one scale (and integer zero point) per output
        channel ([out, 1]) or per group of input columns ([out, in / group])."""


class Int8WeightOnly(LinearQuantization):
    name = "int8"

    @staticmethod
    def channel_scales(weight: torch.Tensor) -> torch.Tensor:
        """One bf16 scale per output channel, [out, 1]: the row's largest magnitude maps to 127."""
        return (weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127).to(torch.bfloat16)

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        scale = self.channel_scales(weight)
        # Rounded against the bf16 scale the kernel multiplies by (as compressed-tensors quantizes
        # against its stored scale), so a checkpoint `kvpilot quantize` wrote holds the same values.
        q = torch.round(weight.float() / scale.float()).clamp(-127, 127).to(torch.int8)
        self.load_quantized(layer, q, scale, None)

    def load_quantized(
        self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> None:
        if zero_point is not None and zero_point.any():
            raise ValueError("int8 weights with zero points are not supported (only symmetric int8)")
        if scale.shape != (q.shape[0], 1):
            raise ValueError(f"int8 needs one scale per output channel, got scales of shape {tuple(scale.shape)}")
        layer.register_buffer("qweight", q.to(torch.int8).contiguous())
        layer.register_buffer("scales", scale.view(-1).to(_scale_dtype(q.device)))

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] < INT8_DENSE_TOKENS:
            ours = self.cpu_kernel and layer.qweight.shape[0] >= INT8_KERNEL_ROWS
            packed_mm = cpu_kernels.int8_mm if ours else torch.ops.aten._weight_int8pack_mm
            return _in_dtype(packed_mm(_in_dtype(x, torch.bfloat16), layer.qweight, layer.scales), x.dtype)
        # The same weight multiplied densely (on CPU: a prefill-sized step).
        return nn.functional.linear(x, self._weight(layer, x.dtype))

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return self._weight(layer, torch.float32)

    @staticmethod
    def _weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """w = q x scale, [out, in], computed in fp32 and rounded once to `dtype`."""
        return _in_dtype(layer.qweight.float() * layer.scales.float()[:, None], dtype)


class Int8Dynamic(Int8WeightOnly):
    """W8A8: the weight as INT8 stores it, the activations quantized per token at each matmul."""

    name = "w8a8"

    def __init__(self, integer_kernel: bool) -> None:
        self.integer_kernel = integer_kernel

    def load_quantized(
        self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> None:
        if q.device.type != "cpu":
            raise ValueError(
                f"w8a8 runs only on CPUs (int8 x int8 GEMMs through oneDNN), not on {q.device.type}; "
                "use int8 (weight-only) there"
            )
        super().load_quantized(layer, q, scale, zero_point)
        # Applied after the int32 sum, in fp32: no kernel reads them.
        layer.register_buffer("scales", layer.scales.float())

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        xf = _in_dtype(x, torch.float32)
        x_scale = torch.linalg.vector_norm(xf, ord=float("inf"), dim=1, keepdim=True).clamp_(min=1e-8).div_(127)
        xq = torch.round(xf / x_scale).to(torch.int8)
        if self.integer_kernel:
            acc = torch._int_mm(xq, layer.qweight.T)
        else:
            acc = nn.functional.linear(xq.float(), layer.qweight.float())
        return _in_dtype(acc * x_scale * layer.scales, x.dtype)


class Int4WeightOnly(LinearQuantization):
    """Asymmetric: each group of `group_size` input columns of a row gets a scale and a zero from
    its minimum and maximum (the scheme of GGUF's Q4_1, so weights that came from a Q4_1 file are
    reproduced up to the bf16 rounding of scale and zero)."""

    name = "int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def _check_width(self, in_features: int) -> None:
        if in_features % self.group_size:
            raise ValueError(f"int4 group size {self.group_size} does not divide a layer's input width {in_features}")

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        g = self.group_size
        self._check_width(in_features)
        w = weight.float().view(out_features, in_features // g, g)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = (high - low).clamp(min=1e-8) / 15
        q = (
            torch.round((w - low[..., None]) / scale[..., None])
            .clamp(0, 15)
            .to(torch.int32)
            .view(out_features, in_features)
        )
        self._store(layer, q, scale, low + _INT4_MID * scale)

    def load_quantized(
        self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> None:
        out_features, in_features = q.shape
        self._check_width(in_features)
        if scale.shape != (out_features, in_features // self.group_size):
            raise ValueError(
                f"int4 with group size {self.group_size} needs scales of shape "
                f"{(out_features, in_features // self.group_size)}, got {tuple(scale.shape)}"
            )
        # (q - zp) x s = ((q + 8) - 8) x s + (-zp x s): the kernel's unsigned values and float zero.
        # The CPU kernel reads bf16, so there the zero (and a scale stored in another dtype) is
        # rounded to bf16: within |zp| x s / 256 <= s / 32 of the checkpoint's value, 1/32 of a step.
        zero = (
            torch.zeros_like(scale, dtype=torch.float32) if zero_point is None else -zero_point.float() * scale.float()
        )
        self._store(layer, q.to(torch.int32) + _INT4_MID, scale.float(), zero)

    def _store(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """q: [out, in] in 0..15; scale, zero: [out, in / group]; w = (q - 8) x scale + zero."""
        out_features, in_features = q.shape
        kernel = _has_kernels(q.device)
        layer.register_buffer(
            "qweight",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES) if kernel else _pack_nibbles(q),
        )
        # [in / group, out, 2]: the layout PyTorch's kernel reads.
        layer.register_buffer(
            "scales_and_zeros", torch.stack([scale.T, zero.T], dim=-1).to(_scale_dtype(q.device)).contiguous()
        )
        layer.int4_shape = (out_features, in_features)
        # Read here, not per call: a compiled forward must not trace the probe.
        layer.int4_layout = cpu_int4_layout() if kernel else None

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        layout = layer.int4_layout
        if layout is None or (x.shape[0] >= INT4_DENSE_TOKENS and layer.int4_shape[0] % layout.rows == 0):
            # Dequantized in x's dtype for this matmul only: the layer keeps only its int4 form.
            return nn.functional.linear(x, self._weight(layer, x.dtype))
        args = (_in_dtype(x, torch.bfloat16), layer.qweight, self.group_size, layer.scales_and_zeros)
        if (
            self.cpu_kernel
            and layout.rows in cpu_kernels.INT4_BLOCK_ROWS
            and not layout.adjacent
            and layer.int4_shape[0] % layout.rows == 0
            and self.group_size % cpu_kernels.INT4_GROUP_COLUMNS == 0
        ):
            return _in_dtype(cpu_kernels.int4_mm(*args, layout.rows), x.dtype)
        return _in_dtype(torch.ops.aten._weight_int4pack_mm_for_cpu(*args), x.dtype)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        out_features, in_features = layer.int4_shape
        if layer.int4_layout and out_features % layer.int4_layout.rows:
            # A layout with a short last block: multiplying by the identity reads it back.
            eye = torch.eye(in_features, dtype=torch.bfloat16)
            return (
                torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, self.group_size, layer.scales_and_zeros)
                .float()
                .T
            )
        return self._weight(layer, torch.float32)

    def _weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """w = (q - 8) x scale + zero, [out, in], computed in fp32 and rounded once to `dtype`
        (in bf16, (q - 8) x scale and + zero would each round)."""
        out_features, in_features = layer.int4_shape
        g = self.group_size
        q = (
            _unpack_cpu_int4pack(layer.qweight, out_features, in_features, layer.int4_layout)
            if layer.int4_layout
            else _unpack_nibbles(layer.qweight, in_features)
        )
        scale, zero = layer.scales_and_zeros.float().unbind(-1)  # [in / group, out]
        q = q.view(out_features, in_features // g, g).float()
        w = (q - _INT4_MID) * scale.T[..., None] + zero.T[..., None]
        return _in_dtype(w.view(out_features, in_features), dtype)


def _has_kernels(device: torch.device) -> bool:
    """PyTorch's packed int8 and int4 matmuls exist on CPU: they read bf16 scales and, for int4,
    their own packed layout. Elsewhere the weight is dequantized for each matmul."""
    return device.type == "cpu"


def _scale_dtype(device: torch.device) -> torch.dtype:
    """bf16 where a kernel reads the scales; fp32 where only the dequantization does."""
    return torch.bfloat16 if _has_kernels(device) else torch.float32


def _in_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A no-op .to() still costs a dispatch, ~1 us; a decode step makes hundreds of these calls.
    return y if y.dtype == dtype else y.to(dtype)


@functools.cache
def cpu_int4_layout() -> Int4Layout:
    """The layout `_convert_weight_to_int4pack_for_cpu` writes on this CPU, read off a packed probe
    (ATen decides it by the ISA it runs, which the CPU's flags or ATEN_CPU_CAPABILITY set): read
    with another one, the weights come back as other rows' values. The probe's values come from a
    generator of its own, not the seeded global one."""
    shape = (2 * _INT4_LAYOUTS[0].rows, 64)
    q = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
    for layout in _INT4_LAYOUTS:
        if torch.equal(_unpack_cpu_int4pack(packed, *shape, layout).to(torch.int32), q):
            return layout
    raise RuntimeError(f"PyTorch's CPU int4 layout is none of {_INT4_LAYOUTS}")


def _unpack_cpu_int4pack(
    packed: torch.Tensor, out_features: int, in_features: int, layout: Int4Layout | None = None
) -> torch.Tensor:
    """The 0..15 values [out, in] of `_convert_weight_to_int4pack_for_cpu`'s output, for an output
    width that is a multiple of the layout's block (tests/engine/model/test_quantization.py checks it
    against the op under each ISA ATen runs)."""
    layout = layout or cpu_int4_layout()
    blocks = packed.view(out_features // layout.rows, in_features, layout.rows // 2)
    low, high = blocks & 0xF, blocks >> 4
    values = torch.stack([low, high], dim=3).flatten(2) if layout.adjacent else torch.cat([low, high], dim=2)
    return values.permute(0, 2, 1).reshape(out_features, in_features)  # [block, in, rows] -> [out, in]


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    out = torch.empty(packed.shape[0], in_features, dtype=torch.int32, device=packed.device)
    out[:, 0::2] = (packed & 0xF).to(torch.int32)
    out[:, 1::2] = (packed >> 4).to(torch.int32)
    return out


def for_scheme(
    scheme: str, group_size: int, integer_kernels: bool = True
) -> tuple[LinearQuantization | None, LinearQuantization | None]:
    """The quantization of the body's linear layers and of the LM head for a scheme. The LM head
    stays at weight-only INT8 under INT4 and W8A8: its errors reach every logit directly.
    `integer_kernels`: whether W8A8 multiplies with the int8 GEMM (else the fp32 one)."""
    if scheme == "none":
        return None, None
    if scheme == "int8":
        return Int8WeightOnly(), Int8WeightOnly()
    if scheme == "int4":
        return Int4WeightOnly(group_size), Int8WeightOnly()
    if scheme == "w8a8":
        return Int8Dynamic(integer_kernels), Int8WeightOnly()
    raise ValueError(f"unknown quantization scheme {scheme!r}")
