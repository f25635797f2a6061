"""A model's Architecture read from its Hugging Face `config.json`, for the families whose KV cache
the planner sizes exactly as the runtimes allocate it: every layer full attention with grouped (or
multi-) query heads, dense or a mixture of experts.

The parameters are counted from the config the way the model's modules hold them (embedding, each
layer's attention, MLP or experts and norms, the final norm, an untied LM head), so a checkpoint's
weights are sized without reading its files; tests/operator/planning/test_model_config.py checks the
count against transformers' own modules built from the same config. A family this module does not
describe, or a feature of one that changes the KV rule (sliding-window or interleaved attention,
latent attention, linear-attention or Mamba layers, a multimodal wrapper), is refused with the
reason (`UnsupportedArchitecture`), never planned as if it were plain attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvpilot.operator.api.spec import Architecture, CheckpointQuantization


class Family(NamedTuple):
    """What one `architectures[0]` holds beside the common decoder layer."""

    tie_default: bool  # tie_word_embeddings when the config leaves it out (the config class's default)
    qkv_bias: bool = False  # q, k and v projections carry a bias whatever attention_bias says
    head_norms: bool = False  # q_norm and k_norm over each head (Qwen3)
    experts: str | None = None  # the MoE layout: "mixtral", "qwen2_moe" or "qwen3_moe"
    # Sliding windows the family's modelling code ignores unless the config turns them on.
    window_flag: str | None = None


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(tie_default=False),
    "MistralForCausalLM": Family(tie_default=False),
    "Qwen2ForCausalLM": Family(tie_default=False, qkv_bias=True, window_flag="use_sliding_window"),
    "Qwen3ForCausalLM": Family(tie_default=False, head_norms=True, window_flag="use_sliding_window"),
    "Phi3ForCausalLM": Family(tie_default=False),
    "MixtralForCausalLM": Family(tie_default=False, experts="mixtral"),
    "Qwen2MoeForCausalLM": Family(
        tie_default=False, qkv_bias=True, experts="qwen2_moe", window_flag="use_sliding_window"
    ),
    "Qwen3MoeForCausalLM": Family(
        tie_default=False, head_norms=True, experts="qwen3_moe", window_flag="use_sliding_window"
    ),
}

# quantization_config.quant_method -> the scheme a checkpoint stores (spec.model.quantization).
CHECKPOINT_SCHEMES: dict[str, CheckpointQuantization] = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


class ModelConfig(NamedTuple):
    architecture: Architecture
    quantization: CheckpointQuantization | None  # the scheme the checkpoint is stored in


class _Shape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json's {key} is {value!r}, not a positive integer")
    return value


def _unsupported(config: Mapping[str, Any], name: str, family: Family) -> str | None:
    """Why `config` cannot be sized as full attention over grouped-query heads, None when it can."""
    window = config.get("sliding_window")
    # A window as long as the context holds every token: full attention (Ministral's 32768).
    binds = window is not None and window < int(config.get("max_position_embeddings") or 0)
    windowed = binds and (family.window_flag is None or bool(config.get(family.window_flag)))
    if windowed or (config.get("layer_types") and set(config["layer_types"]) != {"full_attention"}):
        return f"{name} holds sliding-window layers (sliding_window {window}), which the planner does not size yet"
    quantization = config.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") not in CHECKPOINT_SCHEMES:
        method = quantization.get("quant_method")
        return f"{name}: a checkpoint quantized with {method!r} is not sized yet ({', '.join(CHECKPOINT_SCHEMES)} are)"
    return None


def _attention(config: Mapping[str, Any], family: Family, shape: _Shape) -> int:
    """One layer's attention parameters: q, k, v, o, their biases, and per-head norms."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    weights = shape.hidden * (q + 2 * kv) + q * shape.hidden
    if config.get("attention_bias"):
        biases = q + 2 * kv + shape.hidden
    else:
        biases = q + 2 * kv if family.qkv_bias else 0
    return weights + biases + (2 * shape.head_dim if family.head_norms else 0)


def _mlp(config: Mapping[str, Any], hidden: int, intermediate: int) -> int:
    """A gated MLP: gate, up and down projections (and their biases where mlp_bias)."""
    return 3 * hidden * intermediate + ((2 * intermediate + hidden) if config.get("mlp_bias") else 0)


def _moe(config: Mapping[str, Any], layout: str, hidden: int) -> tuple[int, int, set[int]]:
    """A mixture-of-experts layer's parameters, those one token uses, and the dense layers' indexes."""
    if layout == "mixtral":
        experts, active = _int(config, "num_local_experts"), _int(config, "num_experts_per_tok")
        size, dense = _int(config, "intermediate_size"), set[int]()
    else:
        experts, active = _int(config, "num_experts"), _int(config, "num_experts_per_tok")
        size = _int(config, "moe_intermediate_size")
        step = int(config.get("decoder_sparse_step") or 1)
        layers = _int(config, "num_hidden_layers")
        dense = set(config.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    expert = _mlp(config, hidden, size)
    shared = 0
    if layout == "qwen2_moe":
        # One shared expert beside the routed ones, gated by a scalar per token.
        shared = _mlp(config, hidden, _int(config, "shared_expert_intermediate_size")) + hidden
    router = hidden * experts
    return router + experts * expert + shared, router + active * expert + shared, dense


def _parameters(config: Mapping[str, Any], family: Family, shape: _Shape, tied: bool) -> tuple[int, int]:
    """All parameters and those one token's forward pass multiplies with (fewer under experts)."""
    layers, vocab = _int(config, "num_hidden_layers"), _int(config, "vocab_size")
    per_layer = _attention(config, family, shape) + 2 * shape.hidden  # two norms
    total = active = layers * per_layer
    dense = _mlp(config, shape.hidden, _int(config, "intermediate_size")) if family.experts != "mixtral" else 0
    if family.experts is None:
        total += layers * dense
        active += layers * dense
    else:
        moe, moe_active, dense_layers = _moe(config, family.experts, shape.hidden)
        sparse = layers - len(dense_layers)
        total += sparse * moe + len(dense_layers) * dense
        active += sparse * moe_active + len(dense_layers) * dense
    outside = vocab * shape.hidden * (1 if tied else 2) + shape.hidden  # embedding, LM head, final norm
    return total + outside, active + outside


def read_config(config: Mapping[str, Any], source: str) -> ModelConfig | str:
    """The Architecture (and the checkpoint's stored scheme) of a config.json, or why it cannot be
    planned from it; `source` says where the config came from."""
    name = str((config.get("architectures") or ["(no architectures)"])[0])
    family = FAMILIES.get(name)
    if "text_config" in config:
        return f"{name} wraps a language model with other modalities (text_config); not sized yet"
    if family is None:
        return f"{name} is not an architecture the planner reads ({', '.join(FAMILIES)}); set spec.model.architecture"
    problem = _unsupported(config, name, family)
    if problem is not None:
        return problem
    try:
        heads = _int(config, "num_attention_heads")
        hidden = _int(config, "hidden_size")
        kv_heads = _int(config, "num_key_value_heads") if "num_key_value_heads" in config else heads
        head_dim = _int(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
        tied = bool(config.get("tie_word_embeddings", family.tie_default))
        shape = _Shape(hidden, heads, kv_heads, head_dim)
        total, active = _parameters(config, family, shape, tied)
        architecture = Architecture(
            layers=_int(config, "num_hidden_layers"),
            hidden_size=hidden,
            attention_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_int(config, "vocab_size"),
            parameters=total,
            active_parameters=active if active != total else None,
            max_context=_int(config, "max_position_embeddings"),
            tie_word_embeddings=tied,
            source=source,
        )
    except ValueError as error:  # pydantic's ValidationError is one
        return f"{name}: {error}"
    method = (config.get("quantization_config") or {}).get("quant_method")
    return ModelConfig(architecture, CHECKPOINT_SCHEMES.get(method) if method else None)
