"""The model's building blocks whose weights come from a checkpoint.

Every parameter that a checkpoint fills carries a `weight_loader(param, loaded[, shard])`: the one
place where checkpoint tensors meet parameters, so the model loader only routes tensors to
parameters by name. What a checkpoint stores for a linear layer is its `CheckpointFormat`'s to
declare (as vLLM's quantization methods do): a full-precision weight by default, a quantized
checkpoint's integers and scales otherwise (kvpilot.engine.model.compressed_tensors); once all of
it is in, the format turns it into the layer's serving form. A quantized layer's checkpoint
parameters are lazy: empty placeholders that take their memory only when their checkpoint tensor
loads, and the loader finishes each layer as soon as its parameters are in, so a model whose
full-precision weights do not fit in memory still loads quantized.
"""

from __future__ import annotations

import abc
import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.model.quantization import LinearQuantization

# A checkpoint tensor -> the values of the parameter rows it fills, given their shape.
Decode = Callable[[torch.Tensor, torch.Size], torch.Tensor]


def materialize(param: torch.Tensor) -> torch.Tensor:
    """A lazy parameter gets its memory (once); any other tensor is returned as it is."""
    shape = getattr(param, "full_shape", param.shape)
    if param.shape != shape:
        param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    materialize(param)
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def _parameter(*shape: int, lazy: bool = False, dtype: torch.dtype | None = None) -> nn.Parameter:
    """A parameter a checkpoint tensor of `shape` fills; a lazy one is empty until then."""
    param = nn.Parameter(torch.empty(0 if lazy else shape, dtype=dtype), requires_grad=False)
    param.full_shape = torch.Size(shape)  # type: ignore[attr-defined]
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class CheckpointFormat(abc.ABC):
    """What a checkpoint stores for a linear layer, and how that becomes the layer's serving form."""

    @abc.abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the parameters the checkpoint fills (Linear.checkpoint_parameter)."""

    @abc.abstractmethod
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the filled parameters into the serving form of `layer.quantization`."""


class FullPrecision(CheckpointFormat):
    """The weight as trained, [out, in]; a quantized layer quantizes it once it is in (and holds no
    memory for it until then)."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = layer.checkpoint_parameter(
            layer.out_features, layer.in_features, lazy=layer.quantization is not None
        )

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.quantization is None:
            return
        weight = layer._parameters.pop("weight")  # a tied weight stays with its other owner
        layer.quantization.quantize(layer, weight.data)


class Linear(nn.Module):
    """y = x W^T + b, with W as the checkpoint stores it ([out, in]); with a quantization, in its
    low-bit form once loaded. `shard_sizes` names the projections fused into the layer (FusedLinear),
    each filled from its own checkpoint tensors; a plain layer has one, None."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quantization: LinearQuantization | None = None,
        shard_sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shard_sizes: dict[str | None, int] = dict(shard_sizes or {None: out_features})
        self.shard_offsets = dict(zip(self.shard_sizes, itertools.accumulate(self.shard_sizes.values(), initial=0)))
        self.quantization = quantization
        self.checkpoint_format: CheckpointFormat = FullPrecision()
        self.checkpoint_format.create_weights(self)
        self.bias = self.checkpoint_parameter(out_features) if bias else None
        # The full-precision weight in oneDNN's layout, in place of `weight`, once pack_for_onednn ran.
        self.register_buffer("packed_weight", None, persistent=False)

    def rows(self, shard: str | None) -> slice:
        """The rows of the weight (and bias) that hold `shard`."""
        start = self.shard_offsets[shard]
        return slice(start, start + self.shard_sizes[shard])

    def checkpoint_parameter(
        self, *shape: int, dtype: torch.dtype | None = None, lazy: bool = False, decode: Decode | None = None
    ) -> nn.Parameter:
        """A parameter whose rows the checkpoint fills, one tensor per shard, each through `decode`
        first when the checkpoint stores it in another form."""
        param = _parameter(*shape, lazy=lazy, dtype=dtype)
        param.weight_loader = functools.partial(self.shard_loader, decode=decode)  # type: ignore[attr-defined]
        param.shards = tuple(self.shard_sizes)  # type: ignore[attr-defined]
        return param

    def shard_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None, decode: Decode | None = None
    ) -> None:
        rows = materialize(param).data[self.rows(shard)]
        default_weight_loader(rows, loaded if decode is None else decode(loaded, rows.shape))

    def load_as(self, checkpoint_format: CheckpointFormat) -> None:
        """Take the parameters `checkpoint_format` declares in place of the full-precision weight."""
        del self.weight
        self.checkpoint_format = checkpoint_format
        checkpoint_format.create_weights(self)

    def process_weights_after_loading(self) -> None:
        self.checkpoint_format.process_weights_after_loading(self)

    def pack_for_onednn(self, keep_plain: bool = False) -> bool:
        """Serve the full-precision weight from oneDNN's blocked layout (cpu/onednn_linear.py); a
        quantized or already packed layer stays as it is. A tied weight stays with its other owner,
        the layer keeping a packed copy. `keep_plain`: the plain weight stays too, for a graph that
        torch.compile traces (it cannot take the packed one), the eager calls taking the packed one.
        Whether it packed."""
        if self.quantization is not None or self.packed_weight is not None or "weight" not in self._parameters:
            return False
        weight = self._parameters["weight"] if keep_plain else self._parameters.pop("weight")
        self.packed_weight = onednn_linear.pack(weight.data)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # is_compiling first: a traced graph must not even look at the packed buffer.
        if not torch.compiler.is_compiling() and self.packed_weight is not None:
            return onednn_linear.linear(x, self.packed_weight, self.bias)
        if self.quantization is None:
            return nn.functional.linear(x, self.weight, self.bias)
        y = self.quantization.matmul(self, x)
        return y if self.bias is None else y + self.bias


class FusedLinear(Linear):
    """Several projections of the same input as one matmul (q, k and v; gate and up): one weight
    read and one kernel launch instead of several. The checkpoint keeps them apart, so each shard
    loads into its rows: weight_loader(param, loaded, shard)."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool = False,
        quantization: LinearQuantization | None = None,
    ) -> None:
        super().__init__(in_features, sum(shards.values()), bias, quantization, shards)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.shard_sizes.values()), dim=-1)


def pack_for_onednn(model: nn.Module, keep_plain: bool = False) -> int:
    """Every full-precision linear layer of `model` packed for oneDNN (Linear.pack_for_onednn);
    how many were."""
    return sum(module.pack_for_onednn(keep_plain) for module in model.modules() if isinstance(module, Linear))


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
