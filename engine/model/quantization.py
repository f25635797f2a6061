"""Weight-only quantization of linear layers: INT8 per output channel, INT4 group-wise.

A quantized layer loads its checkpoint weight as usual (through its weight_loader, fused shards
included), then `process_weights_after_loading` replaces it with the low-bit form and frees it:
INT8 as int8 with one bf16 scale per output channel; INT4 as two 4-bit values per byte (PyTorch's
packed layout for its int4 matmul) with a bf16 scale and zero per group of input columns.

Kernels: on CPU, PyTorch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, which take
bf16 activations (fp32 activations are cast: these kernels are 10-100x slower on fp32). Elsewhere
(CUDA) the weight is dequantized on the fly for each matmul: correct, and the memory saving holds,
but not yet the speed of a low-bit kernel (no GPU was at hand to validate CUDA's int4 layout).
"""

from __future__ import annotations

import abc

import torch
from torch import nn

# PyTorch's int4 kernel: values 0..15 around a midpoint, w = (q - 8) * scale + zero.
_INT4_MID = 8
# Inner K tiles of PyTorch's packed int4 layout on CPU.
_INNER_K_TILES = 2


class LinearQuantization(abc.ABC):
    """How one linear layer stores and multiplies its weight."""

    name: str

    @abc.abstractmethod
    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        """Replace `weight` ([out, in]) by the layer's low-bit buffers."""

    @abc.abstractmethod
    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T for 2-D x, in x's dtype."""

    @abc.abstractmethod
    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The weight the buffers stand for, [out, in], fp32."""


class Int8WeightOnly(LinearQuantization):
    name = "int8"

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        layer.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        layer.register_buffer("scales", scale.to(torch.bfloat16))

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), layer.qweight, layer.scales).to(x.dtype)
        return nn.functional.linear(x, self.dequantized(layer).to(x.dtype))

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return layer.qweight.float() * layer.scales.float()[:, None]


class Int4WeightOnly(LinearQuantization):
    """Asymmetric: each group of `group_size` input columns of a row gets a scale and a zero from
    its minimum and maximum (the scheme of GGUF's Q4_1, so weights that came from a Q4_1 file are
    reproduced up to the bf16 rounding of scale and zero)."""

    name = "int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def quantize(self, layer: nn.Module, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        g = self.group_size
        if in_features % g:
            raise ValueError(f"int4 group size {g} does not divide a layer's input width {in_features}")
        w = weight.float().view(out_features, in_features // g, g)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = (high - low).clamp(min=1e-8) / 15
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out_features, in_features)
        zero = low + _INT4_MID * scale
        device = weight.device
        layer.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), _INNER_K_TILES).to(device)
                              if device.type == "cpu" else _pack_nibbles(q))
        # [in / group, out, 2]: the layout PyTorch's kernel reads.
        layer.register_buffer("scales_and_zeros", torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous())
        layer.int4_shape = (out_features, in_features)

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), layer.qweight, self.group_size, layer.scales_and_zeros).to(x.dtype)
        return nn.functional.linear(x, self.dequantized(layer).to(x.dtype))

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        out_features, in_features = layer.int4_shape
        g = self.group_size
        if layer.qweight.device.type == "cpu":
            # The packed CPU layout is opaque: multiplying by the identity reads it back.
            eye = torch.eye(in_features, dtype=torch.bfloat16)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, g, layer.scales_and_zeros).float().T
        q = _unpack_nibbles(layer.qweight, in_features).float().view(out_features, in_features // g, g)
        scale, zero = layer.scales_and_zeros.float().unbind(-1)  # [in / group, out]
        return ((q - _INT4_MID) * scale.T[..., None] + zero.T[..., None]).view(out_features, in_features)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    out = torch.empty(packed.shape[0], in_features, dtype=torch.int32, device=packed.device)
    out[:, 0::2] = (packed & 0xF).to(torch.int32)
    out[:, 1::2] = (packed >> 4).to(torch.int32)
    return out


def for_scheme(scheme: str, group_size: int) -> tuple[LinearQuantization | None, LinearQuantization | None]:
    """The quantization of the body's linear layers and of the LM head for a scheme. The LM head
    stays at INT8 under INT4: its errors reach every logit directly."""
    if scheme == "none":
        return None, None
    if scheme == "int8":
        return Int8WeightOnly(), Int8WeightOnly()
    if scheme == "int4":
        return Int4WeightOnly(group_size), Int8WeightOnly()
    raise ValueError(f"unknown quantization scheme {scheme!r}")
