"""Quantized checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM loads).

Reading: a model folder whose config.json has a `quantization_config` with `quant_method:
compressed-tensors` and weight-only integer schemes (W8A16: 8 bits, symmetric, one scale per output
channel; W4A16: 4 bits, one scale and optionally an integer zero point per group of input columns)
loads without re-calibration: each quantized module's stored integers, scales and zero points go
into the engine's low-bit buffers as they are (`LinearQuantization.load_quantized`). Formats:
`pack-quantized` (values packed into int32, as llm-compressor writes weight-only schemes) and
`int-quantized` / `naive-quantized` (one int8 per value).

Writing them is an offline tool's job: kvpilot.engine.quantize.writer (`kvpilot quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.model.quantization import LinearQuantization, for_scheme

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs
    from transformers import PretrainedConfig

QUANT_METHOD = "compressed-tensors"
READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# What a quantized module stores in place of its `weight` (the int formats keep `weight`, as int8);
# its other tensors (a bias) load as usual.
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")


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


def _engine_scheme(args: QuantizationArgs) -> tuple[str, int | None]:
    if args.type == "int" and not args.dynamic:
        if args.num_bits == 8 and args.strategy == "channel" and args.symmetric:
            return "int8", None
        if args.num_bits == 4 and args.strategy == "group":
            return "int4", args.group_size
    raise ValueError(f"compressed-tensors weights {args.model_dump()} are not supported: the engine runs 8-bit symmetric "
                     "per-channel (W8A16) and 4-bit group-wise (W4A16, symmetric or with zero points) integer weights")


def checkpoint_quantization(config: PretrainedConfig) -> CheckpointQuantization | None:
    """The quantization a model's config.json declares; None for a full-precision model."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"checkpoints quantized with {method!r} are not supported; the engine loads {QUANT_METHOD} checkpoints "
                         "(W4A16, W8A16, as llm-compressor writes them) and quantizes full-precision ones itself")
    for unsupported in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(unsupported):
            raise ValueError(f"compressed-tensors checkpoints with a {unsupported} are not supported")
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(raw)
    found: set[tuple[str, int | None, str]] = set()
    for name, group in parsed.config_groups.items():
        if group.input_activations is not None or group.output_activations is not None or group.weights is None:
            raise ValueError(f"compressed-tensors group {name!r} quantizes activations; the engine runs weight-only schemes (W4A16, W8A16)")
        fmt = group.format or parsed.format
        if fmt not in READ_FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {', '.join(READ_FORMATS)}")
        found.add((*_engine_scheme(group.weights), fmt))
    if len(found) != 1:
        raise ValueError(f"a checkpoint mixing quantization schemes or formats ({sorted(found, key=str)}) is not supported")
    (scheme, group_size, fmt), = found
    return CheckpointQuantization(scheme, group_size, next(iter(parsed.config_groups.values())).weights, fmt)


def resolve_scheme(requested: str, group_size: int, checkpoint: CheckpointQuantization | None, path: Path) -> tuple[str, int]:
    """The scheme to run: the requested one for a full-precision model; the checkpoint's for a
    quantized one, where `none` (the default) follows the checkpoint and anything else must match."""
    if checkpoint is None:
        return requested, group_size
    matches = requested == checkpoint.scheme and (checkpoint.group_size is None or checkpoint.group_size == group_size)
    if requested != "none" and not matches:
        asked = requested + (f" group {group_size}" if requested == "int4" else "")
        raise ValueError(f"{path} is a {QUANT_METHOD} {checkpoint.describe()} checkpoint, but --quantization {asked} was asked: "
                         "leave --quantization unset (none) to run the checkpoint's scheme, or quantize a full-precision model")
    return checkpoint.scheme, checkpoint.group_size or group_size


def quantized_modules(names: set[str]) -> set[str]:
    """The checkpoint modules stored quantized: those with a `weight_scale`."""
    return {name.removesuffix(".weight_scale") for name in names if name.endswith(".weight_scale")}


def split_name(name: str) -> tuple[str, str]:
    """`model.layers.0.mlp.up_proj.weight_packed` -> (`model.layers.0.mlp.up_proj`, `weight_packed`)."""
    module, _, suffix = name.rpartition(".")
    return module, suffix


def decode(tensors: dict[str, torch.Tensor], checkpoint: CheckpointQuantization) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A quantized module's (signed int8 values [out, in], scales, integer zero points or None)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    bits = checkpoint.args.num_bits
    scale = tensors["weight_scale"]
    zero_point = tensors.get("weight_zero_point")
    if "weight_packed" in tensors:
        shape = torch.Size(tensors["weight_shape"].tolist())
        q = unpack_from_int32(tensors["weight_packed"], bits, shape)
        if zero_point is not None:  # packed along the output dimension in this format
            zero_point = unpack_from_int32(zero_point, bits, torch.Size((shape[0], scale.shape[-1])), packed_dim=0)
    else:
        q = tensors["weight"]
        if q.dtype != torch.int8:
            raise ValueError(f"a {checkpoint.format} weight must be int8, got {q.dtype}")
    return q, scale, zero_point


def join_shards(shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decoded shards of a fused layer (q, k, v; gate, up) as one, rows in shard order."""
    qs, scales, zeros = zip(*shards)
    if len({z is None for z in zeros}) > 1:
        raise ValueError("the shards of a fused layer mix symmetric and zero-point quantization")
    return torch.cat(qs), torch.cat(scales), None if zeros[0] is None else torch.cat(zeros)
