"""config.json files synthesized from the catalog's architectures, for vLLM's config builder: the
contract test's model folders hold only these (no weights, no tokenizer)."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.spec import Architecture


def _quantization_config(stored: str) -> dict[str, Any]:
    """config.json's quantization_config of a checkpoint stored as `stored`."""
    if stored in ("awq", "gptq"):
        return {"quant_method": stored, "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"} | (
            {"desc_act": False, "sym": True} if stored == "gptq" else {}
        )
    kind, bits, activations, form = {
        "int8": ("int", 8, None, "pack-quantized"),
        "int4": ("int", 4, None, "pack-quantized"),
        "w8a8": ("int", 8, "int", "int-quantized"),
        "fp8": ("float", 8, "float", "float-quantized"),
    }[stored]
    weights = {"num_bits": bits, "type": kind, "symmetric": True, "strategy": "group" if bits == 4 else "channel"}
    if bits == 4:
        weights["group_size"] = 128
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if activations:
        group["input_activations"] = {
            "num_bits": 8,
            "type": activations,
            "symmetric": True,
            "dynamic": True,
            "strategy": "token",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def config_json(arch: Architecture, stored: str | None = None) -> dict[str, Any]:
    """A Llama config.json with the catalog architecture's shapes (sizes are all vLLM's config
    builder reads; a mixture of experts is planned by its active parameters, not its layout)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": 4 * arch.hidden_size,
        "num_attention_heads": arch.attention_heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_size,
        "num_hidden_layers": arch.layers,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_context,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    if stored is not None:
        config["quantization_config"] = _quantization_config(stored)
    return config


def eagle_head(target: Architecture) -> Architecture:
    """An EAGLE head for `target`: one of its decoder layers with its embedding and LM head (as
    the published EAGLE-LLaMA heads are shaped)."""
    tables = (1 if target.tie_word_embeddings else 2) * target.vocab_size * target.hidden_size
    per_layer = (target.parameters - tables) // target.layers
    return target.model_copy(update={"layers": 1, "parameters": tables + per_layer, "active_parameters": None})
