"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read and
checked against the base model before anything serves with it.

Only what this engine computes exactly as PEFT does is accepted: plain LoRA (and rsLoRA's scaling)
on the Llama decoder's seven projections, without biases. Everything else (DoRA, per-module rank or
alpha patterns, embeddings or the LM head as targets, extra trained modules, pickled weights) is
refused with an AdapterError that names what and why, so a bad adapter is an error on that adapter,
never wrong tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections of a Llama decoder layer as PEFT names them, and where they sit in the layer.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings that change what the adapter computes, and the one value of each that this engine runs.
_PLAIN = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message says which file and what is wrong."""


class AdapterNotFoundError(AdapterError):
    """No adapter at the path (vLLM answers these 404 rather than 400)."""


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's low-rank pair: delta = x A^T B^T * scaling."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer index, PEFT module name) -> its weights; projections the adapter leaves alone are absent.
    weights: dict[tuple[int, str], LoRAWeights]
    # Set when registered: the identity prefix-cache keys are seeded with (a new one per registration).
    lora_id: int = field(default=0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.weights.values() for t in (w.a, w.b))

    def to(self, device: torch.device) -> LoRAAdapter:
        """The same adapter with its weights on `device` (itself where they are already there)."""
        if all(w.a.device == device for w in self.weights.values()):
            return self
        weights = {key: LoRAWeights(w.a.to(device), w.b.to(device)) for key, w in self.weights.items()}
        return LoRAAdapter(self.name, self.path, self.rank, self.scaling, weights, self.lora_id)


def projection_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target projection of the base model's layers."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling (lora_alpha / r, or / sqrt(r) under rsLoRA), after checking
    that its settings are ones this engine computes."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterNotFoundError(f"No adapter found at {str(path)!r}: it has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) != plain:
            raise AdapterError(f"{file}: {key}={config[key]!r} is not supported (only {key}={plain!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{file}: {key} is not supported (one rank and one alpha for every module)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise AdapterError(f"{file}: rank {rank} is above max_lora_rank={max_rank}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_adapter(name: str, path: str, config: PretrainedConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter at `path` for a base model of `config`; weights in `dtype` on CPU."""
    folder = Path(path).expanduser()
    rank, scaling = read_config(folder, max_rank)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE} (pickled adapter_model.bin is not read)")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as weights:
            for key in weights.keys():
                match = _KEY.match(key)
                if match is None or match[2] not in TARGETS:
                    raise AdapterError(
                        f"{file}: tensor {key!r} is not a LoRA weight of a decoder projection "
                        f"(targets this engine serves: {', '.join(TARGETS)})"
                    )
                pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = weights.get_tensor(key)
    except (OSError, SafetensorError) as err:  # its own words for a truncated or foreign file
        raise AdapterError(f"{file} cannot be read as safetensors: {err}") from err
    if not pairs:
        raise AdapterError(f"{file} holds no LoRA weights")
    shapes = projection_shapes(config)
    checked = {
        key: _checked(file, key, pair, rank, shapes[key[1]], config.num_hidden_layers, dtype)
        for key, pair in pairs.items()
    }
    return LoRAAdapter(name, str(folder), rank, scaling, checked)


def _checked(
    file: Path,
    key: tuple[int, str],
    pair: dict[str, torch.Tensor],
    rank: int,
    shape: tuple[int, int],
    num_layers: int,
    dtype: torch.dtype,
) -> LoRAWeights:
    """One projection's A and B, after checking that they fit the base model's layer."""
    layer, module = key
    where = f"{file}: layers.{layer}.{module}"
    if layer >= num_layers:
        raise AdapterError(f"{where}: the base model has {num_layers} layers")
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{where} has lora_{''.join(pair)} without its pair")
    out, inp = shape
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank {rank} on a "
            f"projection of {inp} -> {out} features"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{where}: weights must be floating point, got {a.dtype} and {b.dtype}")
    return LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())
