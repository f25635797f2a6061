"""Quantized checkpoints in the compressed-tensors format (what llm-compressor writes and vLLM loads).

Reading: a model folder whose config.json has a `quantization_config` with `quant_method:
compressed-tensors` and weight-only integer schemes (W8A16: 8 bits, symmetric, one scale per output
channel; W4A16: 4 bits, one scale and optionally an integer zero point per group of input columns)
loads without re-calibration: each quantized module's stored integers, scales and zero points go
into the engine's low-bit buffers as they are (`LinearQuantization.load_quantized`). Formats:
`pack-quantized` (values packed into int32, as llm-compressor writes weight-only schemes) and
`int-quantized` / `naive-quantized` (one int8 per value).

Writing (`quantize_checkpoint`, the `kvpilot quantize` command): the body's linear layers of a
full-precision folder in `pack-quantized`, through compressed-tensors' own compressor, with the LM
head left at full precision (llm-compressor's default `ignore: [lm_head]`; the engine runs it at
INT8 as it always does). INT8 holds exactly the values `--quantization int8` computes at load time.
INT4 is asymmetric min-max per group with integer zero points in [-8, 7], as the format (and vLLM's
kernels) require: a group's 16 levels are multiples of its step, so they include 0. The engine's
own load-time INT4 keeps a float zero per group instead (any 16 evenly spaced levels, as GGUF's
Q4_1), which the format cannot store. By default (`awq`) the weights are first rescaled and clipped
by AWQ's search (kvpilot.engine.model.awq) against exactly this quantizer; `rtn` quantizes them as
they are.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.quantization import Int8WeightOnly, LinearQuantization, for_scheme

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from transformers import PretrainedConfig

    from kvpilot.engine.model.awq import AwqReport

QUANT_METHOD = "compressed-tensors"
WRITE_FORMAT = "pack-quantized"
READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# What a quantized module stores in place of its `weight` (the int formats keep `weight`, as int8);
# its other tensors (a bias) load as usual.
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")
_INDEX_FILE = "model.safetensors.index.json"
# How `kvpilot quantize` picks INT4 values: AWQ's calibrated scale and clipping search, or plain
# round-to-nearest (min-max per group).
METHODS = ("awq", "rtn")


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


def weight_args(scheme: str, group_size: int) -> QuantizationArgs:
    """The compressed-tensors weight arguments of an engine scheme."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme == "int8":
        return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    if scheme == "int4":
        return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)
    raise ValueError(f"a quantized checkpoint is int8 or int4, not {scheme!r}")


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


# -- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizeReport:
    output: Path
    scheme: str
    method: str
    layers: int  # checkpoint linear modules quantized
    fp16_bytes: int  # their weights at 2 bytes per value
    stored_bytes: int  # what the checkpoint stores for them (values, scales, zero points, shapes)
    awq: AwqReport | None
    awq_seconds: float


def _linear_weight_names(config: PretrainedConfig, names: set[str]) -> set[str]:
    """The checkpoint tensors that the engine's body linear layers load (not the LM head)."""
    from kvpilot.engine.model.llama import LlamaForCausalLM
    from kvpilot.engine.model.loader import route

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linears = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Linear) and module is not model.lm_head}
    return {name for name in names if route(name, model.packed_modules)[0] in linears}


def _int4_qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max bf16 scales and integer zero points per group, [out, in / group], as compressed-tensors
    computes them (bf16: the dtype the engine's kernels read, so loading stores them unchanged)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out_features, in_features = weight.shape
    g = args.group_size
    if in_features % g:
        raise ValueError(f"int4 group size {g} does not divide a layer's input width {in_features}")
    groups = weight.view(out_features, in_features // g, g)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args.model_copy(update={"scale_dtype": torch.bfloat16}))
    return scale.to(torch.bfloat16), zero_point


def int4_round_trip(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """What an INT4 checkpoint stores for `weight` ([out, in]), read back: (q - zp) x scale, fp32."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    w = weight.float()
    scale, zero_point = _int4_qparams(w, args)
    return fake_quantize(w, scale.float(), zero_point, args)


def _compress(weight: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """One linear weight in compressed-tensors' packed form."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    args = scheme.weights
    assert args is not None
    w = weight.float()
    state = {"weight": w}
    if args.num_bits == 8:
        state["weight_scale"] = Int8WeightOnly.channel_scales(w)
    else:
        state["weight_scale"], state["weight_zero_point"] = _int4_qparams(w, args)
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def _awq_tensors(source: Path, config: PretrainedConfig, args: QuantizationArgs) -> tuple[dict[str, torch.Tensor], AwqReport]:
    """The full-precision model's tensors after AWQ's scale and clipping search for this INT4
    checkpoint's quantizer, under their checkpoint names."""
    from kvpilot.engine.calibration import PASSAGES
    from kvpilot.engine.model.awq import apply_awq, checkpoint_tensors
    from kvpilot.engine.model.loader import load_model, load_tokenizer

    model = load_model(source, config, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(passage, add_special_tokens=False) for passage in PASSAGES]
    report = apply_awq(model, prompts, functools.partial(int4_round_trip, args=args), args.group_size)
    return checkpoint_tensors(model), report


def quantize_checkpoint(model: str | None, output: Path, scheme: str, group_size: int, method: str | None = None) -> QuantizeReport:
    """Write `model` (a supported full-precision folder, or the embedded model) to `output` as a
    compressed-tensors checkpoint: body linear layers quantized, everything else as it was (with
    `awq`, the norms and projections its scales fold into rescaled). `method` defaults to awq for
    int4 and rtn for int8."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    from kvpilot.engine.model.loader import load_config, resolve_model

    source = resolve_model(model)
    config = load_config(source)
    if checkpoint_quantization(config) is not None:
        raise ValueError(f"{source} is already quantized")
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"{output} exists and is not empty")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {source}")
    method = method or ("awq" if scheme == "int4" else "rtn")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; methods: {', '.join(METHODS)}")
    if method == "awq" and scheme != "int4":
        raise ValueError("awq calibrates int4 checkpoints; int8 is written round-to-nearest (--method rtn)")
    qscheme = QuantizationScheme(targets=["Linear"], weights=weight_args(scheme, group_size), format=WRITE_FORMAT)
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            names.update(checkpoint.keys())
    linear_weights = _linear_weight_names(config, names)
    start = time.perf_counter()
    transformed, awq = _awq_tensors(source, config, qscheme.weights) if method == "awq" else ({}, None)
    awq_seconds = time.perf_counter() - start

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-"))
    layers = fp16_bytes = stored_bytes = 0
    weight_map: dict[str, str] = {}
    try:
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name != _INDEX_FILE:
                shutil.copy2(item, tmp / item.name)
        for file in files:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(file, framework="pt") as checkpoint:
                for name in checkpoint.keys():
                    original = checkpoint.get_tensor(name)
                    tensor = transformed.get(name, original)
                    if name not in linear_weights:
                        tensors[name] = tensor.to(original.dtype)
                        continue
                    module = name.removesuffix(".weight")
                    compressed = _compress(tensor, qscheme)
                    layers += 1
                    fp16_bytes += tensor.numel() * 2
                    stored_bytes += sum(t.numel() * t.element_size() for t in compressed.values())
                    tensors.update({f"{module}.{key}": value for key, value in compressed.items()})
            save_file(tensors, tmp / file.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
        if (source / _INDEX_FILE).is_file():
            (tmp / _INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, format=WRITE_FORMAT, quantization_status="compressed",
                                     ignore=["lm_head"])
        ModelCompressor(quantization_config=qconfig).update_config(str(tmp))
        if output.exists():
            output.rmdir()
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return QuantizeReport(output, scheme, method, layers, fp16_bytes, stored_bytes, awq, awq_seconds)


def report_line(report: QuantizeReport) -> str:
    line = (f"wrote {report.output}: {report.layers} linear layers at {report.scheme} ({report.method}), "
            f"{report.stored_bytes / 2**20:.1f} MiB stored vs {report.fp16_bytes / 2**20:.1f} MiB at fp16 "
            f"({report.stored_bytes / report.fp16_bytes:.3f}x)")
    if report.awq is not None:
        groups = report.awq.groups
        ratio = sum(g.awq_error / g.rtn_error for g in groups) / len(groups)
        line += (f"; awq on {report.awq.tokens} calibration tokens in {report.awq_seconds:.0f} s: layer output error "
                 f"{ratio:.2f}x round-to-nearest's (mean over {len(groups)} layer groups)")
    return line
