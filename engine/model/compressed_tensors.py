"""Quantized checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM loads).

Reading: a model folder whose config.json has a `quantization_config` with `quant_method:
compressed-tensors` and weight-only integer schemes (W8A16: 8 bits, symmetric, one scale per output
channel; W4A16: 4 bits, one scale and optionally an integer zero point per group of input columns)
loads without re-calibration: each linear layer the checkpoint stores quantized declares the tensors
it stores (`CompressedWeights`, a `CheckpointFormat`), so the loader fills them as any other
parameters, and once they are in, its integers, scales and zero points go into the engine's
low-bit buffers as they are (`LinearQuantization.load_quantized`). Formats:
`pack-quantized` (values packed into int32, as llm-compressor writes weight-only schemes) and
`int-quantized` / `naive-quantized` (one int8 per value).

Writing them is an offline tool's job: kvpilot.engine.quantize.writer (`kvpilot quantize`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.model.layers import CheckpointFormat, Linear
from kvpilot.engine.model.quantization import LinearQuantization, for_scheme

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs
    from transformers import PretrainedConfig

    from kvpilot.engine.model.llama import LlamaForCausalLM

QUANT_METHOD = "compressed-tensors"
READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a compressed-tensors checkpoint stores: the engine scheme it maps to, and how."""

    scheme: str  # "int8" or "int4"
    group_size: int | None  # int4 only
    args: QuantizationArgs
    format: str

    def describe(self) -> str:
        return f"{self.scheme}" + (f" group {self.group_size}" if self.group_size else "")

    def layer_quantization(self) -> LinearQuantization:
        body, _ = for_scheme(self.scheme, self.group_size or 0)  # int8 has no group
        assert body is not None
        return body

    def create_weights(self, model: LlamaForCausalLM, names: set[str], path: Path) -> None:
        """Give each linear layer that the checkpoint (tensor `names`) stores quantized the
        parameters it stores for it; the layers it keeps at full precision stay so, except the LM
        head, which runs at INT8 as under every scheme."""
        stored: dict[str, set[str | None]] = {}
        for module in quantized_modules(names):
            if module == "lm_head" and model.config.tie_word_embeddings:
                continue  # the output layer of tied embeddings is the embedding table
            target, shard = model.route(f"{module}.weight")
            stored.setdefault(target.removesuffix(".weight"), set()).add(shard)
        linears = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
        if unknown := sorted(stored.keys() - linears.keys()):
            raise ValueError(f"quantized modules in {path} fit no layer of the model: {unknown[:3]}")
        for name, layer in linears.items():
            shards = stored.get(name, set())
            if shards and shards != set(layer.shard_sizes):
                raise ValueError(f"{path} quantizes some of the projections fused into {name} and not the others")
            if shards:
                layer.quantization = self.layer_quantization()
                layer.load_as(CompressedWeights(self))
            elif layer is not model.lm_head:
                layer.quantization = None  # the checkpoint keeps this layer at full precision


def _engine_scheme(args: QuantizationArgs) -> tuple[str, int | None]:
    if args.type == "int" and not args.dynamic:
        if args.num_bits == 8 and args.strategy == "channel" and args.symmetric:
            return "int8", None
        if args.num_bits == 4 and args.strategy == "group":
            return "int4", args.group_size
    raise ValueError(
        f"compressed-tensors weights {args.model_dump()} are not supported: the engine runs 8-bit symmetric "
        "per-channel (W8A16) and 4-bit group-wise (W4A16, symmetric or with zero points) integer weights"
    )


def checkpoint_quantization(config: PretrainedConfig) -> CheckpointQuantization | None:
    """The quantization a model's config.json declares; None for a full-precision model."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(
            f"checkpoints quantized with {method!r} are not supported; the engine loads {QUANT_METHOD} checkpoints "
            "(W4A16, W8A16, as llm-compressor writes them) and quantizes full-precision ones itself"
        )
    for unsupported in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(unsupported):
            raise ValueError(f"compressed-tensors checkpoints with a {unsupported} are not supported")
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(raw)
    found: set[tuple[str, int | None, str]] = set()
    for name, group in parsed.config_groups.items():
        if group.input_activations is not None or group.output_activations is not None or group.weights is None:
            raise ValueError(
                f"compressed-tensors group {name!r} quantizes activations; "
                "the engine runs weight-only schemes (W4A16, W8A16)"
            )
        fmt = group.format or parsed.format
        if fmt not in READ_FORMATS:
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported; supported: {', '.join(READ_FORMATS)}"
            )
        found.add((*_engine_scheme(group.weights), fmt))
    if len(found) != 1:
        raise ValueError(
            f"a checkpoint mixing quantization schemes or formats ({sorted(found, key=str)}) is not supported"
        )
    ((scheme, group_size, fmt),) = found
    return CheckpointQuantization(scheme, group_size, next(iter(parsed.config_groups.values())).weights, fmt)


def resolve_scheme(
    requested: str, group_size: int, checkpoint: CheckpointQuantization | None, path: Path
) -> tuple[str, int]:
    """The scheme to run: the requested one for a full-precision model; the checkpoint's for a
    quantized one, where `none` (the default) follows the checkpoint and anything else must match."""
    if checkpoint is None:
        return requested, group_size
    matches = requested == checkpoint.scheme and (checkpoint.group_size is None or checkpoint.group_size == group_size)
    if requested != "none" and not matches:
        asked = requested + (f" group {group_size}" if requested == "int4" else "")
        raise ValueError(
            f"{path} is a {QUANT_METHOD} {checkpoint.describe()} checkpoint, but --quantization {asked} was asked: "
            "leave --quantization unset (none) to run the checkpoint's scheme, or quantize a full-precision model"
        )
    return checkpoint.scheme, checkpoint.group_size or group_size


def quantized_modules(names: set[str]) -> set[str]:
    """The checkpoint modules stored quantized: those with a `weight_scale`."""
    return {name.removesuffix(".weight_scale") for name in names if name.endswith(".weight_scale")}


class CompressedWeights(CheckpointFormat):
    """A linear layer's integers, scales and zero points as a compressed-tensors checkpoint stores
    them: each tensor is unpacked into the layer's rows as it loads, and the whole goes into the
    layer's low-bit form as it is once all are in."""

    def __init__(self, checkpoint: CheckpointQuantization) -> None:
        self.checkpoint = checkpoint
        self.packed = checkpoint.format == "pack-quantized"
        self.values = "weight_packed" if self.packed else "weight"  # the int formats keep `weight`, as int8

    def create_weights(self, layer: Linear) -> None:
        # The checkpoint's `weight_shape` (packed formats) repeats the model's; _unpack checks the
        # packed width against it instead, so the loader passes it by.
        args = self.checkpoint.args
        out_features, in_features = layer.out_features, layer.in_features
        # Rounded up as the format stores a short last group, so that its scales load and the INT4
        # layer refuses the group size with its own message (it must divide the input width).
        groups = 1 if args.strategy == "channel" else -(-in_features // args.group_size)
        unpack = functools.partial(_unpack, bits=args.num_bits)
        layer.register_parameter(
            self.values,
            layer.checkpoint_parameter(
                out_features, in_features, dtype=torch.int8, lazy=True, decode=unpack if self.packed else _int8
            ),
        )
        layer.weight_scale = layer.checkpoint_parameter(out_features, groups, dtype=torch.float32, lazy=True)
        if not args.symmetric:  # packed along the output dimension in the packed format
            layer.weight_zero_point = layer.checkpoint_parameter(
                out_features,
                groups,
                dtype=torch.int8,
                lazy=True,
                decode=functools.partial(unpack, packed_dim=0) if self.packed else None,
            )

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = (layer._parameters.pop(name).data for name in (self.values, "weight_scale"))
        zero_point = layer._parameters.pop("weight_zero_point", None)
        assert layer.quantization is not None
        layer.quantization.load_quantized(layer, q, scale, None if zero_point is None else zero_point.data)


def _unpack(packed: torch.Tensor, shape: torch.Size, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Signed values of `shape` from the int32 words they are packed into along `packed_dim`."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    words = list(shape)
    words[packed_dim] = math.ceil(shape[packed_dim] * bits / 32)
    if list(packed.shape) != words:
        raise ValueError(
            f"packed values of shape {tuple(packed.shape)} do not hold {bits}-bit values of shape {tuple(shape)}"
        )
    return unpack_from_int32(packed, bits, shape, packed_dim=packed_dim)


def _int8(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if values.dtype != torch.int8:
        raise ValueError(f"unpacked compressed-tensors weights must be int8, got {values.dtype}")
    return values
