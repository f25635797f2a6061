"""The model's building blocks whose weights come from a checkpoint.

Every parameter that a checkpoint fills carries a `weight_loader(param, loaded)`: the one place
where checkpoint tensors meet parameters, so a layer that stores its weight differently (quantized,
packed, fused) changes only its own loader and the model loader stays as it is. A quantized
layer's full-precision weight is lazy: an empty placeholder that takes its memory only when its
checkpoint tensor loads, and the loader quantizes each layer as soon as its shards are in, so a
model whose full-precision weights do not fit in memory still loads quantized.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.model.quantization import LinearQuantization


def materialize(param: torch.Tensor) -> torch.Tensor:
    """A lazy parameter gets its memory (once); any other tensor is returned as it is."""
    shape = getattr(param, "full_shape", param.shape)
    if param.shape != shape:
        param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    materialize(param)
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _parameter(*shape: int, lazy: bool = False) -> nn.Parameter:
    """A parameter a checkpoint tensor of `shape` fills; a lazy one is empty until then."""
    param = nn.Parameter(torch.empty(0 if lazy else shape), requires_grad=False)
    param.full_shape = torch.Size(shape)  # type: ignore[attr-defined]
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class Linear(nn.Module):
    """y = x W^T + b, with W as the checkpoint stores it ([out, in]); with a quantization, W is
    loaded as usual and then replaced by its low-bit form (process_weights_after_loading)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quantization: LinearQuantization | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _parameter(out_features, in_features, lazy=quantization is not None)
        self.bias = _parameter(out_features) if bias else None
        self.quantization = quantization

    def process_weights_after_loading(self) -> None:
        if self.quantization is None:
            return
        weight = self._parameters.pop("weight")  # a tied weight stays with its other owner
        self.quantization.quantize(self, weight.data)

    def load_quantized(self, quantization: LinearQuantization, q: torch.Tensor, scale: torch.Tensor,
                       zero_point: torch.Tensor | None) -> None:
        """Take values quantized elsewhere (a compressed-tensors checkpoint) in place of the
        full-precision weight, which was never filled."""
        device = self._parameters.pop("weight").device
        self.quantization = quantization
        quantization.load_quantized(self, q.to(device), scale.to(device), None if zero_point is None else zero_point.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization is None:
            return nn.functional.linear(x, self.weight, self.bias)
        y = self.quantization.matmul(self, x)
        return y if self.bias is None else y + self.bias


class FusedLinear(Linear):
    """Several projections of the same input as one matmul (q, k and v; gate and up): one weight
    read and one kernel launch instead of several. The checkpoint keeps them apart, so each shard
    loads into its rows: weight_loader(param, loaded, shard)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False,
                 quantization: LinearQuantization | None = None) -> None:
        super().__init__(in_features, sum(shards.values()), bias, quantization)
        self.shard_sizes = dict(shards)
        offsets = [0]
        for size in shards.values():
            offsets.append(offsets[-1] + size)
        self.shard_offsets = dict(zip(shards, offsets))
        for param in self.parameters():
            param.weight_loader = self.shard_loader  # type: ignore[attr-defined]
            param.shards = tuple(shards)  # type: ignore[attr-defined]

    def rows(self, shard: str) -> slice:
        """The rows of the fused weight (and bias) that hold `shard`."""
        start = self.shard_offsets[shard]
        return slice(start, start + self.shard_sizes[shard])

    def shard_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        default_weight_loader(materialize(param).data[self.rows(shard)], loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.shard_sizes.values()), dim=-1)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = _parameter(num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
