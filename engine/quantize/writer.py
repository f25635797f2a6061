"""Writing compressed-tensors checkpoints (`quantize_checkpoint`, the `kvpilot quantize` command).

The body's linear layers of a full-precision folder are written in `pack-quantized`, through
compressed-tensors' own compressor, with the LM head left at full precision (llm-compressor's
default `ignore: [lm_head]`; the engine runs it at INT8 as it always does). INT8 holds exactly the
values `--quantization int8` computes at load time. INT4 is asymmetric min-max per group with
integer zero points in [-8, 7], as the format (and vLLM's kernels) require: a group's 16 levels are
multiples of its step, so they include 0. The engine's own load-time INT4 keeps a float zero per
group instead (any 16 evenly spaced levels, as GGUF's Q4_1), which the format cannot store. By
default (`awq`) the weights are first rescaled and clipped by AWQ's search (kvpilot.engine.quantize.awq)
against exactly this quantizer; `rtn` quantizes them as they are. The engine reads the result back
through kvpilot.engine.model.compressed_tensors.
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

from kvpilot.engine.model.compressed_tensors import checkpoint_quantization
from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import load_config, load_model, load_tokenizer, resolve_model, tensor_names
from kvpilot.engine.model.quantization import Int8WeightOnly
from kvpilot.engine.quantize.awq import AwqReport, apply_awq, checkpoint_tensors
from kvpilot.engine.quantize.calibration import PASSAGES

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from transformers import PretrainedConfig

WRITE_FORMAT = "pack-quantized"
_INDEX_FILE = "model.safetensors.index.json"
# How `kvpilot quantize` picks INT4 values: AWQ's calibrated scale and clipping search, or plain
# round-to-nearest (min-max per group).
METHODS = ("awq", "rtn")


def weight_args(scheme: str, group_size: int) -> QuantizationArgs:
    """The compressed-tensors weight arguments of an engine scheme."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme == "int8":
        return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    if scheme == "int4":
        return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)
    raise ValueError(f"a quantized checkpoint is int8 or int4, not {scheme!r}")


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
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linears = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module is not model.lm_head
    }
    return {name for name in names if model.route(name)[0] in linears}


def _int4_qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max bf16 scales and integer zero points per group, [out, in / group], as compressed-tensors
    computes them (bf16: the dtype the engine's kernels read, so loading stores them unchanged)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out_features, in_features = weight.shape
    g = args.group_size
    if in_features % g:
        raise ValueError(f"int4 group size {g} does not divide a layer's input width {in_features}")
    groups = weight.view(out_features, in_features // g, g)
    scale, zero_point = calculate_qparams(
        groups.amin(-1), groups.amax(-1), args.model_copy(update={"scale_dtype": torch.bfloat16})
    )
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


def _awq_tensors(
    source: Path, config: PretrainedConfig, args: QuantizationArgs
) -> tuple[dict[str, torch.Tensor], AwqReport]:
    """The full-precision model's tensors after AWQ's scale and clipping search for this INT4
    checkpoint's quantizer, under their checkpoint names."""
    model = load_model(source, config, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(passage, add_special_tokens=False) for passage in PASSAGES]
    report = apply_awq(model, prompts, functools.partial(int4_round_trip, args=args), args.group_size)
    return checkpoint_tensors(model), report


def quantize_checkpoint(
    model: str | None, output: Path, scheme: str, group_size: int, method: str | None = None
) -> QuantizeReport:
    """Write `model` (a supported full-precision folder, or the embedded model) to `output` as a
    compressed-tensors checkpoint: body linear layers quantized, everything else as it was (with
    `awq`, the norms and projections its scales fold into rescaled). `method` defaults to awq for
    int4 and rtn for int8."""
    from compressed_tensors.quantization import QuantizationScheme

    source = resolve_model(model)
    config = load_config(source)
    if checkpoint_quantization(config) is not None:
        raise ValueError(f"{source} is already quantized")
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"{output} exists and is not empty")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {source}")
    method = _method(scheme, method)
    qscheme = QuantizationScheme(targets=["Linear"], weights=weight_args(scheme, group_size), format=WRITE_FORMAT)
    start = time.perf_counter()
    transformed, awq = _awq_tensors(source, config, qscheme.weights) if method == "awq" else ({}, None)
    awq_seconds = time.perf_counter() - start

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-"))
    try:
        sizes = _write(source, files, tmp, _linear_weight_names(config, tensor_names(files)), transformed, qscheme)
        if output.exists():
            output.rmdir()
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return QuantizeReport(output, scheme, method, *sizes, awq, awq_seconds)


def _method(scheme: str, method: str | None) -> str:
    method = method or ("awq" if scheme == "int4" else "rtn")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; methods: {', '.join(METHODS)}")
    if method == "awq" and scheme != "int4":
        raise ValueError("awq calibrates int4 checkpoints; int8 is written round-to-nearest (--method rtn)")
    return method


def _write(
    source: Path,
    files: list[Path],
    folder: Path,
    linear_weights: set[str],
    transformed: dict[str, torch.Tensor],
    qscheme: QuantizationScheme,
) -> tuple[int, int, int]:
    """The checkpoint in `folder`: each of `files` with its `linear_weights` compressed (from their
    `transformed` values where AWQ rewrote them), the source's other files, the index and the
    quantization config. Returns the layers compressed, their fp16 bytes and their stored bytes."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != _INDEX_FILE:
            shutil.copy2(item, folder / item.name)
    layers = fp16_bytes = stored_bytes = 0
    weight_map: dict[str, str] = {}
    for file in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                original = checkpoint.get_tensor(name)
                tensor = transformed.get(name, original)
                if name not in linear_weights:
                    tensors[name] = tensor.to(original.dtype)
                    continue
                compressed = _compress(tensor, qscheme)
                layers += 1
                fp16_bytes += tensor.numel() * 2
                stored_bytes += sum(t.numel() * t.element_size() for t in compressed.values())
                tensors.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in compressed.items()})
        save_file(tensors, folder / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (source / _INDEX_FILE).is_file():
        (folder / _INDEX_FILE).write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
    qconfig = QuantizationConfig(
        config_groups={"group_0": qscheme}, format=WRITE_FORMAT, quantization_status="compressed", ignore=["lm_head"]
    )
    ModelCompressor(quantization_config=qconfig).update_config(str(folder))
    return layers, fp16_bytes, stored_bytes


def report_line(report: QuantizeReport) -> str:
    line = (
        f"wrote {report.output}: {report.layers} linear layers at {report.scheme} ({report.method}), "
        f"{report.stored_bytes / 2**20:.1f} MiB stored vs {report.fp16_bytes / 2**20:.1f} MiB at fp16 "
        f"({report.stored_bytes / report.fp16_bytes:.3f}x)"
    )
    if report.awq is not None:
        groups = report.awq.groups
        ratio = sum(g.awq_error / g.rtn_error for g in groups) / len(groups)
        line += (
            f"; awq on {report.awq.tokens} calibration tokens in {report.awq_seconds:.0f} s: layer output error "
            f"{ratio:.2f}x round-to-nearest's (mean over {len(groups)} layer groups)"
        )
    return line
