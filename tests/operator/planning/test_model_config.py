"""A model's Architecture from its config.json: the parameters counted as transformers' own modules
hold them (built on the meta device from the same config), the KV geometry as vLLM's own ModelConfig
allocates it, and every family or feature the planner does not size refused with its reason."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from e2e.hub_server import HubServer
from kvpilot.engine.model.loader import load_config
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec, ServingSpec
from kvpilot.operator.planning import latency, placement, recurrent, sizing
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.model_config import FAMILIES, WRAPPERS, read_config
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.runtimes.vllm import VLLM_CAPABILITIES
from tests.operator.hub.checkpoints import write_sharded
from tests.vllm import env

# Small shapes of every family, with the options that change the count: biases, tied heads, an
# explicit head_dim, experts (routed, shared, dense layers between them).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Tiny hybrids with what changes the count: a dense layer among Qwen3-Next's experts, Mamba-2 groups,
# Granite 4.0-H's experts beside its shared MLP (or none), biases, "auto" Mamba heads, Falcon-H1's
# mamba_d_ssm (left out: its config class's 1024) and gated norm.
GRANITE_4_H = {
    **TINY,
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "attention", "mamba", "mamba"],
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "shared_intermediate_size": 80,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
FALCON_H1 = {
    **TINY,
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "mamba_d_ssm": 96,
    "mamba_n_heads": 6,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
}
GATED_DELTANET = {
    **TINY,
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
}
QWEN_EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
TINY_COUNTED_HYBRIDS = {
    "granite-4.0-h-moe-biases": {**GRANITE_4_H, "mamba_proj_bias": True, "attention_bias": True},
    "granite-4.0-h-dense-auto-heads": {
        **GRANITE_4_H,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_hidden_layers": 3,
        "num_local_experts": 0,
        "mamba_d_head": "auto",
        "mamba_conv_bias": False,
    },
    "falcon-h1": FALCON_H1,
    "falcon-h1-default-d-ssm-gated-norm": {
        **{k: v for k, v in FALCON_H1.items() if k != "mamba_d_ssm"},
        "mamba_n_heads": 16,
        "mamba_d_head": "auto",
        "mamba_rms_norm": True,
        "tie_word_embeddings": True,
    },
    "qwen3-next": {**GATED_DELTANET, **QWEN_EXPERTS, "architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [1]},
    # Qwen3.5's language models: Qwen3-Next's layers, with experts in every layer or a dense MLP.
    "qwen3.5-moe": {
        **GATED_DELTANET,
        **QWEN_EXPERTS,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    },
    "qwen3.5": {
        **GATED_DELTANET,
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_value_head_dim": 8,
        "tie_word_embeddings": True,
    },
    "nemotron-h": {
        **TINY,
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*-M",
        "num_hidden_layers": 4,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "head_dim": 8,
        "attention_head_dim": 8,
    },
    # Experts in layers 1 and 3 of 4, attention in layer 2; biased projections, an unbiased convolution
    # and dt's rank from hidden_size ("auto").
    "jamba": {
        **TINY,
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": "auto",
        "mamba_proj_bias": True,
        "mamba_conv_bias": False,
    },
}


# DeepSeek V3's layers, small: latent attention with q through its own rank, a dense first layer,
# routed experts and a shared one (GLM-4.7-Flash builds the same shapes).
DEEPSEEK_V3_LAYERS = {
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 24,
    "first_k_dense_replace": 1,
    "num_experts_per_tok": 2,
}
# Sparse attention's indexer, small but for its key (whole blocks of 128 FP8 values and their scale).
# transformers' classes always build the routing bias, vLLM only under topk_method noaux_tc, as the
# real configs have it.
SPARSE_INDEXER = {
    # DeepSeek's latent, the one vLLM's sparse MLA kernels take.
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 16,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
}
# Gemma 4's layers, small: 16-value sliding heads, 32-value full-attention ones, no per-layer
# embeddings unless a config asks (its config class's default is 256 values).
GEMMA4_LAYERS = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 6,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 300,
}
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-biases": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "llama-tied-head-dim": {"model_type": "llama", "tie_word_embeddings": True, "head_dim": 32},
    "llama-mha": {"model_type": "llama", "num_key_value_heads": 8},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "phi3": {"model_type": "phi3", "sliding_window": None},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2-moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],
    },
    "qwen3-moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "head_dim": 16,
    },
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "sliding_window": 128},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 128, "num_hidden_layers": 7},
    "gpt-oss": {
        "model_type": "gpt_oss",
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "deepseek-v2": {
        "model_type": "deepseek_v2",
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "moe_intermediate_size": 24,
        "first_k_dense_replace": 1,
        "num_experts_per_tok": 2,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        **DEEPSEEK_V3_LAYERS,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
    },
    # GLM-4.6/4.7's per-head q and k norms (use_qk_norm), a dense first layer, two shared experts.
    "glm4-moe-head-norms": {
        "model_type": "glm4_moe",
        "head_dim": 16,
        "use_qk_norm": True,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "moe_intermediate_size": 24,
        "first_k_dense_replace": 1,
        "num_experts_per_tok": 2,
    },
    # SmolLM3: Llama's layers, its NoPE layers among them, a tied head.
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 1, 0]},
    # Granite 3: Llama's layers with biased attention here, and its multipliers (no parameters).
    "granite": {"model_type": "granite", "attention_bias": True, "embedding_multiplier": 12.0},
    # OLMo 2: norms after attention and the MLP, q and k normed over all the heads' width.
    "olmo2": {"model_type": "olmo2"},
    # OLMo 3: OLMo 2's layers, three of every four within its window (the config class's 4096 here).
    "olmo3": {"model_type": "olmo3", "num_hidden_layers": 4},
    # Seed-OSS: biased q, k and v, and o here (attention_out_bias), 128-value heads by default.
    "seed-oss": {"model_type": "seed_oss", "attention_out_bias": True},
    # Cohere2: one norm before attention and the MLP side by side, a tied head, three windowed layers of
    # every four (the config class's 4096-token window).
    "cohere2": {"model_type": "cohere2", "num_hidden_layers": 4},
    # GLM-4-0414: biased q, k and v, four norms per layer, 128-value heads by default.
    "glm4": {"model_type": "glm4", "partial_rotary_factor": 0.5},
    # EXAONE 4.0: norms after attention and the MLP, per-head q and k norms, three windowed layers of four;
    # and its layers as layer_types names them (two windowed of 64 tokens, then full).
    "exaone4": {"model_type": "exaone4", "num_hidden_layers": 4},
    "exaone4-layer-types": {
        "model_type": "exaone4",
        "num_hidden_layers": 3,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    # GLM-4.7-Flash: latent attention (q through its own low rank) beside GLM-4.5's experts.
    "glm4-moe-lite": {"model_type": "glm4_moe_lite", **DEEPSEEK_V3_LAYERS},
    # DeepSeek V3.2: a lightning indexer in every latent-attention layer (DeepSeek Sparse Attention).
    "deepseek-v32": {"model_type": "deepseek_v32", **DEEPSEEK_V3_LAYERS, **SPARSE_INDEXER},
    # GLM-5.2: an indexer in the first two layers and every second one after (index_topk_freq).
    "glm-moe-dsa": {
        "model_type": "glm_moe_dsa",
        **DEEPSEEK_V3_LAYERS,
        **SPARSE_INDEXER,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 2,
    },
    # Norms over all the heads' q and k, experts in every layer with a routing bias.
    "minimax-m2": {
        "model_type": "minimax_m2",
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "use_routing_bias": True,
        "scoring_func": "sigmoid",
        "rotary_dim": 8,
    },
    # Gemma 4: full-attention layers (every 3rd, and the last) with K/V heads of their own and V = K
    # (attention_k_eq_v), no per-layer embeddings.
    "gemma4": {**GEMMA4_LAYERS, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
    # The config class's defaults (256-value sliding heads, 512-value full ones, a 512-token window,
    # every 6th layer and the last full) under bidirectional attention, which narrows the window to 257.
    "gemma4-defaults-bidirectional": {
        **{
            k: v
            for k, v in GEMMA4_LAYERS.items()
            if k not in ("head_dim", "global_head_dim", "sliding_window", "layer_types")
        },
        "num_hidden_layers": 7,
        "use_bidirectional_attention": "all",
    },
    # Experts beside the dense MLP, per-layer embeddings, the last 2 layers reading earlier layers' K
    # and V with double-wide MLPs, biased attention, an untied head.
    "gemma4-moe-ple-shared": {
        **GEMMA4_LAYERS,
        "num_hidden_layers": 5,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 256,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 24,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
    # Chunked local attention in layers 0 and 2 (every 2nd layer NoPE, full), experts with a shared
    # one in layer 1 (every 2nd), a dense MLP of its own size in the others.
    "llama4": {
        "model_type": "llama4_text",
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 128,
        "attention_chunk_size": 128,
        "no_rope_layer_interval": 2,
    },
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}
# Model types transformers does not know under the name a config.json gives, with the one its
# auto_map names (Kimi K2 ships DeepSeek V3's modelling code).
MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def config_of(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**TINY, "architectures": [ARCHITECTURES[overrides["model_type"]]], **overrides}


def transformers_model(config: dict[str, Any]) -> torch.nn.Module:
    """The model transformers builds from `config`, on the meta device (no memory, no weights)."""
    fields = {key: value for key, value in config.items() if key != "model_type"}
    model_type = MODEL_TYPES.get(config["model_type"], config["model_type"])
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(AutoConfig.for_model(model_type, **fields))


def stored_count(model: torch.nn.Module) -> int:
    """The values a checkpoint of `model` holds: its parameters (a tied head once) and its persistent
    buffers (DeepSeek V3's router bias is one in transformers, a parameter in vLLM)."""
    buffers = (
        buffer.numel()
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    )
    return sum(p.numel() for p in model.parameters()) + sum(buffers)


def test_every_family_is_covered_here() -> None:
    assert {ARCHITECTURES[c["model_type"]] for c in FAMILY_CONFIGS.values()} == set(FAMILIES)


def vllm_beyond_checkpoint(config: dict[str, Any]) -> int:
    """What vLLM 0.33 builds as parameters beyond a checkpoint's values, for Gemma 4 (its config or its
    language model's): a V projection in each full-attention layer whose V is its K (attention_k_eq_v,
    loaded with K's weights), less each layer's scalar, the vision tower's standardization and the
    towers' clipping bounds, buffers there. Nothing for the other families."""
    text = config.get("text_config", config)
    if text.get("model_type") != "gemma4_text":
        return 0
    vision, audio = config.get("vision_config") or {}, config.get("audio_config") or {}
    buffers = 2 * vision["hidden_size"] if vision.get("standardize") else 0
    # The towers' clipped linears keep four bounds each: 7 in a vision layer, 10 in an audio layer.
    buffers += 4 * 7 * vision["num_hidden_layers"] if vision.get("use_clipped_linears") else 0
    buffers += 4 * 10 * audio.get("num_hidden_layers", 12) if audio and audio.get("use_clipped_linears", True) else 0
    built = AutoConfig.for_model("gemma4_text", **{k: v for k, v in text.items() if k != "model_type"})
    copies = sum(
        built.hidden_size * built.per_layer_config[i].num_key_value_heads * built.per_layer_config[i].head_dim
        for i, kind in enumerate(built.layer_types)
        if kind == "full_attention" and built.attention_k_eq_v and built.kv_sharing_modes[i] != "reuse"
    )
    return copies - built.num_hidden_layers - buffers


GEMMA4 = {name for name, c in FAMILY_CONFIGS.items() if c["model_type"] == "gemma4_text"}


@pytest.mark.parametrize("name", sorted(GEMMA4))
def test_gemma4_is_counted_as_vllm_builds_it_and_its_kv_as_transformers_caches_it(name: str) -> None:
    """Gemma 4 against transformers' modules: the parameters (with vllm_beyond_checkpoint), the K and V
    each layer that keeps its own caches (the full-attention layers' own heads), the layers that read
    another's, and its sliding windows."""
    config = config_of(FAMILY_CONFIGS[name])
    read = read_config(config, "test")
    assert not isinstance(read, str), read
    model, arch = transformers_model(config), read.architecture
    assert arch.parameters == stored_count(model) + vllm_beyond_checkpoint(config)
    layers = [m.self_attn for m in model.model.layers]
    kv_width = [layer.k_proj.out_features for layer in layers if not layer.is_kv_shared_layer]
    assert sizing.kv_bytes_per_token(arch) == sum(2 * width * 2 for width in kv_width)
    kinds = model.config.layer_types
    shared = Counter(kinds[i] for i, layer in enumerate(layers) if layer.is_kv_shared_layer)
    expected = (shared["full_attention"], shared["sliding_attention"])
    found = (arch.shared_kv.full_layers, arch.shared_kv.sliding_layers) if arch.shared_kv else (0, 0)
    assert found == expected
    assert (arch.sliding_window, arch.windowed_layers) == (
        model.config.sliding_window,
        kinds.count("sliding_attention"),
    )
    assert (arch.active_parameters is not None) == ("num_experts" in config)


@pytest.mark.parametrize("name", [name for name in FAMILY_CONFIGS if name not in GEMMA4])
def test_parameters_and_kv_geometry_are_as_transformers_builds_the_model(name: str) -> None:
    config = config_of(FAMILY_CONFIGS[name])
    read = read_config(config, "test")
    assert not isinstance(read, str), read
    model = transformers_model(config)
    assert read.architecture.parameters == stored_count(model)
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
    arch = read.architecture
    kv_width = arch.kv_heads * arch.head_size
    if hasattr(attention, "kv_a_proj_with_mqa"):  # latent attention: one latent, its rotary part with it
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        assert attention.kv_a_proj_with_mqa.out_features == arch.latent_dim == latent
        # Sparse attention: an FP8 key and its scale in each layer that runs an indexer.
        indexers = [m.self_attn.indexer for m in model.model.layers if getattr(m.self_attn, "indexer", None)]
        keys = sum(indexer.wk.out_features + indexer.wk.out_features // 128 * 4 for indexer in indexers)
        assert sizing.kv_bytes_per_token(arch) == arch.layers * arch.latent_dim * 2 + keys
        assert (arch.indexer.layers if arch.indexer else 0) == len(indexers)
        return
    if hasattr(attention, "qkv_proj"):  # Phi-3 fuses the three
        assert attention.qkv_proj.out_features == arch.attention_heads * arch.head_size + 2 * kv_width
    else:
        assert attention.k_proj.out_features == attention.v_proj.out_features == kv_width
    assert sizing.kv_bytes_per_token(arch) == 2 * arch.layers * arch.kv_heads * arch.head_size * 2
    if "moe" in name or name in ("mixtral", "gpt-oss", "llama4", "minimax-m2"):
        assert arch.active_parameters is not None and arch.active_parameters < arch.parameters
    else:
        assert arch.active_parameters is None
    # transformers names Llama 4's local layers chunked_attention, the others' sliding_attention.
    local = "chunked_attention" if arch.chunked else "sliding_attention"
    sliding = [t for t in model.config.layer_types if t == local] if name in WINDOWED else []
    assert (arch.sliding_window, arch.windowed_layers) == (WINDOWED.get(name), len(sliding))
    assert arch.chunked == (name == "llama4")


# The families whose windows vLLM 0.33 allocates, and the window each tiny config gives.
# The window each windowed family's tiny config is planned with: vLLM's (Cohere2's: the config's 4096 and the token).
WINDOWED = {
    "gemma2": 128,
    "gemma3": 128,
    "gpt-oss": 128,
    "llama4": 128,
    "olmo3": 4096,
    "cohere2": 4097,
    "exaone4": 4096,
    "exaone4-layer-types": 64,
}


QWEN_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_heads": 4,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
# Tiny configs of every multimodal wrapper: the language model's and the vision tower's, with the
# options that change the count (SigLIP's pooling head; LLaVA's projector biases and feature layers).
VISION = {"hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4}
QWEN3_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_heads": 4,
    "out_hidden_size": 64,
    "patch_size": 16,
    "num_position_embeddings": 16,
}
GEMMA4_VISION = {
    **VISION,
    "model_type": "gemma4_vision",
    "num_key_value_heads": 4,
    "head_dim": 8,
    "patch_size": 4,
    "position_embedding_size": 16,
}
WRAPPER_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("gemma3", {"vision_config": {**VISION, "image_size": 56, "patch_size": 14}, "mm_tokens_per_image": 4}),
    "gemma3-no-head": (
        "gemma3",
        {"vision_config": {**VISION, "image_size": 56, "patch_size": 14, "vision_use_head": False}},
    ),
    "llava": ("llama", {"model_type": "llava", "vision_config": {**VISION, "image_size": 28, "patch_size": 14}}),
    "llava-unbiased-layers": (
        "llama",
        {
            "model_type": "llava",
            "vision_config": {**VISION, "image_size": 28, "patch_size": 14},
            "multimodal_projector_bias": False,
            "vision_feature_layer": [-2, -1],
        },
    ),
    "llava-next": (
        "llama",
        {
            "model_type": "llava_next",
            "vision_config": {**VISION, "image_size": 28, "patch_size": 14},
            "image_grid_pinpoints": [[28, 28]],
        },
    ),
    # Mistral3Config ties the head unless told (transformers 5); the checkpoints' language models do not.
    "mistral3": (
        "mistral",
        {
            "model_type": "mistral3",
            "vision_config": {**VISION, "image_size": 56, "patch_size": 14},
            "tie_word_embeddings": False,
        },
    ),
    "mistral3-biased-layers": (
        "mistral",
        {
            "model_type": "mistral3",
            "vision_config": {**VISION, "image_size": 56, "patch_size": 14},
            "multimodal_projector_bias": True,
            "vision_feature_layer": [-2, -1],
            "spatial_merge_size": 1,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-vl": ("qwen2", {"model_type": "qwen2_5_vl", "vision_config": QWEN_VISION}),
    # Qwen3-VL's tower: learned positions, LayerNorms, deepstack mergers (three where left out).
    "qwen3-vl": (
        "qwen3",
        {"model_type": "qwen3_vl", "vision_config": {**QWEN3_VISION, "deepstack_visual_indexes": [0]}},
    ),
    "qwen3-vl-default-deepstack": ("qwen3", {"model_type": "qwen3_vl", "vision_config": {**QWEN3_VISION, "depth": 25}}),
    "qwen3-vl-moe": (
        "qwen3-moe",
        {"model_type": "qwen3_vl_moe", "vision_config": {**QWEN3_VISION, "deepstack_visual_indexes": [1]}},
    ),
    # Qwen3.5's: Qwen3-VL's without deepstack, over a hybrid language model.
    # Tied as its language model is (vLLM reads text_config's flag, transformers the top level's).
    "qwen3.5": ("qwen3.5", {"model_type": "qwen3_5", "vision_config": QWEN3_VISION, "tie_word_embeddings": True}),
    "qwen3.5-moe": (
        "qwen3.5-moe",
        {"model_type": "qwen3_5_moe", "vision_config": QWEN3_VISION, "tie_word_embeddings": False},
    ),
    # Gemma 4's tower: a linear patch embedding, a position table per axis, layers with q/k norms.
    "gemma4": ("gemma4", {"model_type": "gemma4", "vision_config": GEMMA4_VISION}),
    # E2B's and E4B's audio tower beside it: subsampling convolutions, conformer layers, clipped linears.
    "gemma4-audio": (
        "gemma4",
        {
            "model_type": "gemma4",
            "vision_config": {**GEMMA4_VISION, "use_clipped_linears": True, "standardize": True},
            "audio_config": {
                "model_type": "gemma4_audio",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "subsampling_conv_channels": [8, 4],
                "conv_kernel_size": 3,
                "output_proj_dims": 48,
            },
        },
    ),
    "llama4": (
        "llama4",
        {
            "model_type": "llama4",
            "vision_config": {
                **VISION,
                "image_size": 28,
                "patch_size": 14,
                "projector_input_dim": 24,
                "projector_output_dim": 24,
                "vision_output_dim": 24,
                "pixel_shuffle_ratio": 0.5,
            },
        },
    ),
}
WRAPPER_ARCHITECTURES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
}
# The language model of each wrapper above: a family's tiny config, or a tiny hybrid's.
WRAPPER_TEXT_MODEL_TYPES = {"qwen3": "qwen3_vl_text", "qwen3-moe": "qwen3_vl_moe_text"}
# Qwen2.5-VL's positions in 3 sections of a head's rotary half (the tiny head's 8 values: 4).
MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}


def test_every_wrapper_is_covered_here() -> None:
    assert {WRAPPER_ARCHITECTURES[c.get("model_type", "gemma3")] for _, c in WRAPPER_CONFIGS.values()} == set(WRAPPERS)


@pytest.mark.parametrize("name", WRAPPER_CONFIGS)
def test_a_multimodal_wrapper_counts_its_vision_tower_as_transformers_builds_it(name: str) -> None:
    family, wrapper = WRAPPER_CONFIGS[name]
    text = (
        TINY_HYBRIDS[family]
        if family in TINY_HYBRIDS
        else config_of(FAMILY_CONFIGS["llama-biases" if family == "llama" else family])
    )
    model_type = wrapper.get("model_type", "gemma3")
    text_model_type = {"model_type": WRAPPER_TEXT_MODEL_TYPES[family]} if family in WRAPPER_TEXT_MODEL_TYPES else {}
    config = {
        **wrapper,
        "architectures": [WRAPPER_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "text_config": {key: value for key, value in text.items() if key != "architectures"}
        | (MROPE if family in ("qwen2", "qwen3", "qwen3-moe") else {})
        | text_model_type,
    }
    read = read_config(config, "test")
    assert not isinstance(read, str), read
    arch = read.architecture
    text_only = read_config(text, "test")
    assert not isinstance(text_only, str)
    assert arch.parameters == stored_count(transformers_model(config)) + vllm_beyond_checkpoint(config)
    assert arch.vision_parameters == arch.parameters - text_only.architecture.parameters
    # A text token goes through the language model only; its KV rule is the language model's.
    assert arch.parameters_per_token == text_only.architecture.parameters_per_token
    assert sizing.kv_layout(arch) == sizing.kv_layout(text_only.architecture)


def test_the_embedded_models_real_config_counts_the_catalogs_parameters(model_dir: Path) -> None:
    # The catalog's figure is the checkpoint's own (safetensors metadata); the config is the
    # embedded model's, as its conversion wrote it.
    read = read_config(json.loads((model_dir / "config.json").read_text()), "embedded")
    assert not isinstance(read, str), read
    catalog = MODELS["smollm2-135m"]
    # The catalog leaves out the norms every GPU of a tensor-parallel group holds whole (a one-GPU model).
    unlisted = {"source", "replicated_parameters"}
    assert read.architecture.model_dump(exclude=unlisted) == catalog.model_dump(exclude=unlisted)


# Qwen3's use_sliding_window from layer 1 of 3: windows beside full attention, which vLLM refuses.
# Configs vLLM 0.33 cannot load (test_vllm_cannot_load_the_configs_the_planner_refuses_as_unloadable).
UNLOADABLE = {
    "exaone4-lllg": config_of({**FAMILY_CONFIGS["exaone4"], "sliding_window_pattern": "LLLG"}),
    "exaone4-no-window": config_of({**FAMILY_CONFIGS["exaone4"], "sliding_window": None}),
}
MIXED_QWEN_WINDOWS = config_of(
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 256, "max_window_layers": 1}
)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (MIXED_QWEN_WINDOWS, "which vLLM 0.33 refuses to load"),
        (
            {**TINY, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512},
            "DeepseekV3ForCausalLM: config.json's qk_nope_head_dim is None",
        ),
        ({"architectures": ["Idefics3ForConditionalGeneration"], "text_config": TINY}, "does not count"),
        (config_of({**FAMILY_CONFIGS["llama4"], "no_rope_layers": [1, 0]}), "no_rope_layers names 2 layers of 3"),
        (config_of({**FAMILY_CONFIGS["llama4"], "attention_chunk_size": 0}), "the window is 0"),
        # EXAONE 4.0 layers transformers' config class (and so vLLM) cannot derive.
        (UNLOADABLE["exaone4-lllg"], "'LLLG' without layer_types"),
        (UNLOADABLE["exaone4-no-window"], "sliding_window null without layer_types"),
        ({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": TINY}, "has no vision_config"),
        (
            {"architectures": ["LlavaForConditionalGeneration"], "text_config": {**TINY, "model_type": "qwen2"}},
            "over a qwen2 language model is not read yet",
        ),
        ({**TINY}, "(no architectures) is not"),
        (
            config_of({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}}),
            "'bitsandbytes' is not sized yet",
        ),
        (config_of({"model_type": "llama", "num_hidden_layers": 0}), "num_hidden_layers is 0"),
        (config_of({"model_type": "llama", "num_key_value_heads": 3}), "not a multiple of kvHeads"),
        # vLLM 0.33 builds Falcon-H1's out projection without the bias this checkpoint would hold.
        (
            {**FALCON_H1, "projectors_bias": True},
            "FalconH1ForCausalLM (parameters not counted: projectors_bias is not counted yet) keeps a state",
        ),
    ],
)
def test_what_the_planner_does_not_size_is_refused_with_its_reason(config: dict[str, Any], refusal: str) -> None:
    read = read_config(config, "test")
    assert isinstance(read, str) and refusal in read, read


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_type": "mistral", "sliding_window": 256},  # Mistral-7B-v0.1's window: no layer_types
        {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 256},  # max_window_layers 28 > 3
        {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 256},
    ],
)
def test_a_window_vllm_does_not_allocate_is_full_attention(overrides: dict[str, Any]) -> None:
    read = read_config(config_of(overrides), "t")
    assert not isinstance(read, str), read
    assert read.architecture.sliding_window is None and sizing.kv_layout(read.architecture).sliding_groups == 0


def test_layer_types_give_a_llama_its_windows_as_vllm_reads_them() -> None:
    config = config_of(
        {"model_type": "llama", "sliding_window": 64, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]}
    )
    read = read_config(config, "t")
    assert not isinstance(read, str), read
    assert (read.architecture.sliding_window, read.architecture.sliding_layers) == (64, 2)


def test_a_checkpoint_stored_quantized_names_its_scheme() -> None:
    read = read_config(config_of({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}), "t")
    assert not isinstance(read, str) and read.quantization == "awq"
    assert read_config(config_of({"model_type": "llama"}), "t").quantization is None  # type: ignore[union-attr]


def _compressed(*groups: tuple[str, int, bool]) -> dict[str, Any]:
    """A llm-compressor quantization_config with one group per (weight type, bits, activations)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            f"group_{i}": {
                "targets": ["Linear"],
                "weights": {"type": kind, "num_bits": bits, "strategy": "channel"},
                "input_activations": {"type": kind, "num_bits": bits, "dynamic": True} if acts else None,
            }
            for i, (kind, bits, acts) in enumerate(groups)
        },
    }


@pytest.mark.parametrize(
    ("groups", "scheme"),
    [
        ((("float", 8, True),), "fp8"),  # FP8-dynamic (RedHatAI's *-FP8-dynamic)
        ((("float", 8, False),), "fp8"),
        ((("int", 8, True),), "w8a8"),  # *-quantized.w8a8
        ((("int", 8, False),), "int8"),  # W8A16
        ((("int", 4, False),), "int4"),  # *-quantized.w4a16
    ],
)
def test_a_compressed_tensors_checkpoint_names_the_scheme_of_its_groups(
    groups: tuple[tuple[str, int, bool], ...], scheme: str
) -> None:
    read = read_config(config_of({"model_type": "llama", "quantization_config": _compressed(*groups)}), "t")
    assert not isinstance(read, str) and read.quantization == scheme


@pytest.mark.parametrize(
    ("groups", "refusal"),
    [
        ((("int", 4, True),), "4-bit int weights and quantized activations"),
        ((("float", 4, False),), "4-bit float weights"),
        ((("int", 8, False), ("int", 4, False)), "groups of 2 schemes (int4, int8)"),
    ],
)
def test_a_compressed_tensors_scheme_the_planner_does_not_size_is_refused(
    groups: tuple[tuple[str, int, bool], ...], refusal: str
) -> None:
    read = read_config(config_of({"model_type": "llama", "quantization_config": _compressed(*groups)}), "t")
    assert isinstance(read, str) and refusal in read, read


def _loads(config: dict[str, Any], folder: Path) -> bool:
    """Whether our engine's loader takes `config` (it refuses the model types it does not build)."""
    (folder / "config.json").write_text(json.dumps(config))
    try:
        load_config(folder)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_the_planner_plans_for_our_engine_only_the_model_classes_its_loader_builds(name: str, tmp_path: Path) -> None:
    """A pod of runtime kvpilot whose model the engine would refuse at start is never rendered: every
    family vLLM runs is planned for vLLM, and for our engine only where its loader takes the config."""
    config = config_of(FAMILY_CONFIGS[name])
    read = read_config(config, "t")
    assert not isinstance(read, str), read
    architecture = read.architecture.model_dump(by_alias=True, exclude_none=True)
    model = {"name": name, "architecture": architecture}
    planned = {
        runtime: plan(
            InferenceServiceSpec.model_validate(
                {"runtime": runtime, "model": model, "accelerator": {"type": "H100-80GB"}}
            )
        )
        for runtime in ("kvpilot", "vllm")
    }
    assert planned["vllm"].fits, planned["vllm"].reason
    refused = planned["kvpilot"].failure == "UnsupportedByRuntime"
    assert refused != _loads(config, tmp_path), planned["kvpilot"].reason
    assert refused or planned["kvpilot"].fits, planned["kvpilot"].reason


def plan_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvpilot.engine.cli", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_kvpilot_plan_reads_a_config_json_offline(tmp_path: Path) -> None:
    folder = tmp_path / "Tiny-Qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_of(FAMILY_CONFIGS["qwen3"])))
    # Our engine builds Llama's and Mistral's classes only: a Qwen3 is vLLM's to run.
    ours = plan_command("--model-config", str(folder), "--gpu", "L4")
    assert ours.returncode == 1 and "UnsupportedByRuntime" in ours.stdout, ours.stdout
    assert "it is a Qwen3ForCausalLM, and runtime kvpilot loads only LlamaForCausalLM" in ours.stdout
    run = plan_command("--model-config", str(folder), "--gpu", "L4", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["model"] == "Tiny-Qwen3" and planned["fits"]
    assert f"config.json {folder / 'config.json'}" in planned["reasons"]["model"]
    (folder / "config.json").write_text(json.dumps(MIXED_QWEN_WINDOWS))
    refused = plan_command("--model-config", str(folder / "config.json"), "--gpu", "L4")
    assert refused.returncode == 2 and "UnsupportedArchitecture" in refused.stderr, refused.stderr


def test_a_sparse_attention_model_is_rendered_with_the_blocks_and_fp8_latents_vllm_serves_it_with() -> None:
    """GLM-5 on eight H200s: vLLM's sparse MLA kernels refuse serving.blockSize's default 16 (no attention
    backend would be left), so the pod gets 64-token blocks; an FP8 KV cache holds each latent as 656
    bytes and each of the 78 indexers' keys as 132, on each of the 8 GPUs."""
    config = str(HF_CONFIGS / "zai-org--GLM-5.json")
    for kv_dtype, latent in (("model", 2 * 576), ("fp8", sizing.FP8_DS_MLA_BYTES)):
        run = plan_command(
            "--model-config", config, "--gpu", "H200", "--runtime", "vllm", "--kv-cache-dtype", kv_dtype, "--json"
        )
        assert run.returncode == 0, run.stdout + run.stderr
        planned = json.loads(run.stdout)
        assert planned["fits"] and planned["gpu_count"] == 8 and planned["block_size"] == 64
        assert "--block-size=64" in planned["args"]
        assert planned["kv_bytes_per_token"] == 8 * 78 * (latent + 132)
        assert "132-byte key in the sparse-attention indexer of 78" in planned["reasons"]["kvCache"]
    ours = plan_command("--model-config", config, "--gpu", "H200")
    assert ours.returncode == 1 and "sparse attention (a lightning indexer)" in ours.stdout, ours.stdout


def test_kvpilot_plan_reads_an_hf_repositorys_config_json_from_the_hub_as_the_operator_does(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config_of(FAMILY_CONFIGS["qwen3"])))
    with HubServer("acme/tiny-qwen3", tmp_path, token="hf_cli", gated=True) as hub:
        refused = plan_command("--model", "hf://acme/tiny-qwen3", "--gpu", "L4", env={"HF_ENDPOINT": hub.url})
        assert refused.returncode == 2, refused.stderr
        assert "ModelConfigUnavailable" in refused.stderr and "401" in refused.stderr
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_cli"}
        vllm = ("--runtime", "vllm", "--json")
        run = plan_command("--model", "hf://acme/tiny-qwen3@main", "--gpu", "L4", *vllm, env=env)
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["model"] == "tiny-qwen3" and planned["fits"]
    assert planned["reasons"]["model"] == "the checkpoint's config.json of hf://acme/tiny-qwen3@main"


def test_kvpilot_plan_reads_a_draft_models_config_json_from_the_hub_too(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((HF_CONFIGS / "meta-llama--Llama-3.2-3B.json").read_text())
    common = ("--model", "llama-3-8b", "--gpu", "H100-80GB", "--speculative", "draft", "--json")
    with HubServer("meta-llama/Llama-3.2-3B", tmp_path, token="hf_cli", gated=True) as hub:
        env = {"HF_ENDPOINT": hub.url}
        refused = plan_command(*common, "--draft-model", "hf://meta-llama/Llama-3.2-3B", env=env)
        assert refused.returncode == 2, refused.stderr
        assert "ModelConfigUnavailable: serving.draftModel: hf://meta-llama/Llama-3.2-3B: " in refused.stderr
        assert "401" in refused.stderr
        run = plan_command(*common, "--draft-model", "hf://meta-llama/Llama-3.2-3B", env={**env, "HF_TOKEN": "hf_cli"})
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["fits"] and planned["speculative"] == "draft"
    assert planned["draft_weight_bytes"] == 3_212_749_824 * 2  # Llama-3.2-3B's parameters at 16 bits


def test_kvpilot_plan_reads_a_draft_models_config_json_offline(tmp_path: Path) -> None:
    folder = tmp_path / "Llama-3.2-3B"
    folder.mkdir()
    (folder / "config.json").write_text((HF_CONFIGS / "meta-llama--Llama-3.2-3B.json").read_text())
    common = ("--model", "llama-3-8b", "--gpu", "H100-80GB", "--speculative", "draft", "--json")
    # No hub answers here: the config given is the one planned, the folder its source.
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    run = plan_command(*common, "--draft-model-config", str(folder), env=offline)
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["fits"] and planned["draft_model"] == str(folder.resolve())
    assert planned["draft_weight_bytes"] == 3_212_749_824 * 2
    named = ("--draft-model", "hf://meta-llama/Llama-3.2-3B", "--draft-model-config", str(folder / "config.json"))
    run = plan_command(*common, *named, env=offline)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["draft_model"] == "hf://meta-llama/Llama-3.2-3B"
    (folder / "config.json").write_text("{")
    broken = plan_command(*common, "--draft-model-config", str(folder), env=offline)
    assert broken.returncode == 2 and f"--draft-model-config {folder}" in broken.stderr, broken.stderr


def test_kvpilot_plan_reads_the_weights_bytes_of_a_local_checkpoint_from_its_metadata(tmp_path: Path) -> None:
    config = json.loads((HF_CONFIGS / "openai--gpt-oss-20b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 13_761_264_768}}))
    run = plan_command("--model-config", str(tmp_path), "--gpu", "H100-80GB", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["weight_bytes"] == 13_761_264_768
    # A single file: its header's tensors, the file itself never read.
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(config_of(FAMILY_CONFIGS["qwen3"])))
    save_file({"w": torch.zeros(16, 8, dtype=torch.bfloat16)}, str(tiny / "model.safetensors"))
    run = plan_command("--model-config", str(tiny / "config.json"), "--gpu", "L4", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["checkpoint_bytes"] == 16 * 8 * 2


def test_a_quantized_checkpoint_s_own_bytes_are_the_weights_vllm_holds(tmp_path: Path) -> None:
    """gpt-oss stores its experts in MXFP4 and its attention in 16 bits: no per-scheme arithmetic
    sizes it, its safetensors' total does (read from the index, as the operator does)."""
    config = json.loads((HF_CONFIGS / "openai--gpt-oss-20b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    stored = 13_761_264_768  # the checkpoint's total as its index would state it
    common = ("--model", "hf://openai/gpt-oss-20b", "--gpu", "H100-80GB", "--json")
    with HubServer("openai/gpt-oss-20b", tmp_path) as hub:
        unknown = plan_command(*common, "--runtime", "vllm", env={"HF_ENDPOINT": hub.url})
        index = {"metadata": {"total_size": stored}, "weight_map": {}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with HubServer("openai/gpt-oss-20b", tmp_path) as hub:
        vllm = plan_command(*common, "--runtime", "vllm", env={"HF_ENDPOINT": hub.url})
        ours = plan_command(*common, env={"HF_ENDPOINT": hub.url})
    refused = json.loads(unknown.stdout)
    assert refused["failure"] == "InvalidArchitecture" and "sized from its own bytes" in refused["reason"]
    planned = json.loads(vllm.stdout)
    assert planned["fits"] and planned["quantization"] == "mxfp4", planned["reason"]
    assert planned["weight_bytes"] == planned["checkpoint_bytes"] == stored
    assert "--quantization" not in " ".join(planned["args"])  # vLLM reads the scheme from config.json
    assert json.loads(ours.stdout)["failure"] == "UnsupportedByRuntime"


def test_a_checkpoint_s_mtp_modules_are_downloaded_but_not_held(tmp_path: Path) -> None:
    """DeepSeek-V3 stores a multi-token-prediction layer (61) beside its 61 decoder layers, which vLLM
    skips unless it drafts with it: read from the headers of the shard that holds it (its experts in
    FP8, its own embedding and head in 16 bits: ~15 GB, about 1.9 GB a GPU at TP 8), its bytes are in
    the download, not in the weights the plan holds."""
    (tmp_path / "config.json").write_text((HF_CONFIGS / "deepseek-ai--DeepSeek-V3.json").read_text())
    mtp = {
        "model.layers.61.mlp.experts.weight": 11_274_289_152,
        "model.layers.61.embed_tokens.weight": 1_853_358_080,
        "model.layers.61.shared_head.head.weight": 1_853_358_080,
    }
    decoder_bytes = 688_586_727_753 - sum(mtp.values())  # of the repository's total_size
    decoder = {"model.layers.0.mlp.weight": decoder_bytes}
    planned, drafting = {}, {}
    common = ("--model", "hf://deepseek-ai/DeepSeek-V3", "--gpu", "H200", "--runtime", "vllm", "--json")
    for case, last in (("mtp", mtp), ("no mtp", {name.replace(".61.", ".60."): size for name, size in mtp.items()})):
        write_sharded(tmp_path, {"model-00001-of-00002.safetensors": decoder, "model-00002-of-00002.safetensors": last})
        with HubServer("deepseek-ai/DeepSeek-V3", tmp_path) as hub:
            run = plan_command(*common, env={"HF_ENDPOINT": hub.url})
            # Drafting with them (speculative mtp) needs them in the checkpoint: vLLM refuses it otherwise.
            mtp_run = plan_command(
                *common, "--speculative", "mtp", "--num-speculative-tokens", "2", env={"HF_ENDPOINT": hub.url}
            )
        assert run.returncode == 0, run.stderr
        planned[case], drafting[case] = json.loads(run.stdout), json.loads(mtp_run.stdout)
    assert drafting["mtp"]["speculative"] == "mtp" and drafting["mtp"]["num_speculative_tokens"] == 2
    assert drafting["no mtp"]["failure"] == "NoMtpModules" and "holds none" in drafting["no mtp"]["reason"]
    held, whole = planned["mtp"], planned["no mtp"]
    assert held["fits"] and held["quantization"] == "fp8" and held["gpu_count"] == whole["gpu_count"] == 8
    assert held["checkpoint_bytes"] == whole["checkpoint_bytes"] == 688_586_727_753  # downloaded whole
    # Held as vLLM holds the rest: one copy over the 8 GPUs, with what each holds whole (its mean bytes).
    arch = read_config(json.loads((tmp_path / "config.json").read_text()), "DeepSeek-V3").architecture  # type: ignore[union-attr]
    skipped = sizing.held_by_group(arch, 688_586_727_753, 8) - sizing.held_by_group(arch, decoder_bytes, 8)
    assert whole["weight_bytes"] - held["weight_bytes"] == skipped > sum(mtp.values())
    # A larger pool (less than all of it: more sequences, whose activations the reserve counts too).
    assert held["kv_blocks"] > whole["kv_blocks"] and held["max_num_seqs"] >= whole["max_num_seqs"]


# Real config.json files of public models (hf_configs/SOURCES.tsv: where each copy was found, at
# which commit). Each is either read, with the parameters transformers' modules hold, or refused
# for the reason named here.
HF_CONFIGS = Path(__file__).parent / "hf_configs"
REFUSED = {
    "microsoft--Phi-mini-MoE-instruct": "PhiMoEForCausalLM is not",
    "tiiuae--falcon-mamba-7b": "FalconMambaForCausalLM is not",
}
# What vLLM allocates as plain attention, refused only because the planner does not count its parameters.
NOT_COUNTED = {"microsoft--Phi-mini-MoE-instruct"}
# Figures published with the models (their cards' safetensors totals), beside the catalog's.
PUBLISHED = {
    "meta-llama--Meta-Llama-3.1-8B": MODELS["llama-3-8b"].parameters,
    "meta-llama--Meta-Llama-3.1-70B": MODELS["llama-3-70b"].parameters,
    "meta-llama--Llama-3.3-70B-Instruct": MODELS["llama-3-70b"].parameters,
    "Qwen--Qwen2.5-7B-Instruct": MODELS["qwen2.5-7b"].parameters,
    "mistralai--Mixtral-8x7B-v0.1": MODELS["mixtral-8x7b"].parameters,
}

# Sizes the model cards state, rounded (total and active parameters): the count is within 2 % of each.
CARD_SIZES = {
    "meta-llama--Llama-4-Scout-17B-16E-Instruct": (109e9, 17e9),
    "meta-llama--Llama-4-Maverick-17B-128E-Instruct": (400e9, 17e9),
}


def real_configs() -> list[str]:
    return sorted(p.stem for p in HF_CONFIGS.glob("*.json"))


def test_every_real_config_has_its_source_recorded() -> None:
    rows = [line.split("\t") for line in (HF_CONFIGS / "SOURCES.tsv").read_text().splitlines()[1:]]
    assert sorted(row[0].removesuffix(".json") for row in rows) == real_configs()
    assert all(len(row) == 6 and len(row[4]) == 40 for row in rows)
    assert len(real_configs()) >= 25 and set(REFUSED) < set(real_configs())


@pytest.mark.parametrize("name", real_configs())
def test_a_real_config_is_read_as_transformers_builds_it_or_refused_with_its_reason(name: str) -> None:
    config = json.loads((HF_CONFIGS / f"{name}.json").read_text())
    read = read_config(config, name)
    if name in REFUSED:
        assert isinstance(read, str) and REFUSED[name] in read, read
        return
    assert not isinstance(read, str), read
    built = transformers_model({k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")})
    assert read.architecture.parameters == stored_count(built) + vllm_beyond_checkpoint(config)
    if name in PUBLISHED:
        assert read.architecture.parameters == PUBLISHED[name]
    if name in CARD_SIZES:
        total, active = CARD_SIZES[name]
        arch = read.architecture
        assert arch.parameters == pytest.approx(total, rel=0.02)
        assert arch.parameters_per_token == pytest.approx(active, rel=0.02)


def _wraps(name: str) -> bool:
    return "text_config" in json.loads((HF_CONFIGS / f"{name}.json").read_text())


def _language_model_of(name: str) -> dict[str, Any]:
    config = json.loads((HF_CONFIGS / f"{name}.json").read_text())
    return {**config["text_config"], "architectures": [WRAPPERS[config["architectures"][0]].language_model]}


@pytest.fixture(scope="module")
def vllm_kv_specs() -> dict[str, dict[str, Any]]:
    """What vLLM's own ModelConfig (tests/vllm/kv_specs.py, the pinned version) makes of each real config."""
    # Each built on 2, 4 and 8 GPUs too (the bytes one holds).
    split = {"weights_split": True}
    cases = [
        json.dumps({"id": n, "config": json.loads((HF_CONFIGS / f"{n}.json").read_text()), **split})
        for n in real_configs()
    ]
    # A wrapper's language model alone, as the wrapper builds it from text_config: the tower holds no
    # KV cache, and its parameters are checked against transformers' modules.
    cases += [
        json.dumps({"id": f"{n}#text", "config": _language_model_of(n), **split}) for n in real_configs() if _wraps(n)
    ]
    # The hybrids again as vLLM runs them on Hopper GPUs (FlashInfer's Gated DeltaNet prefill).
    cases += [json.dumps({"id": f"{n}@{HOPPER}", "config": hybrid_config(n), **FLASHINFER}) for n in HYBRIDS]
    # The hybrids whose state layers verify drafts again, speculating (prompt lookup: no drafter of its own).
    cases += [
        json.dumps({"id": f"{n}#ngram{'' if gpu == TRITON else '@' + HOPPER}", "config": hybrid_config(n), **extra})
        for n, gpu in SPECULATING_HYBRIDS
        for extra in [{"ngram": DRAFT_TOKENS, **(FLASHINFER if gpu == HOPPER else {})}]
    ]
    # Tiny hybrids in their checkpoints' keys: families without a real config.json among hf_configs, and
    # the options that change a count.
    cases += [json.dumps({"id": name, "config": config}) for name, config in TINY_HYBRIDS.items()]
    # Every family's tiny config, with the options that change a count.
    # Gemma 4's built on 2, 4 and 8 GPUs too: its layers of two K/V shapes, a token's KV on one GPU.
    cases += [
        json.dumps({"id": f"tiny-{name}", "config": config_of(c), **(split if name in GEMMA4 else {})})
        for name, c in FAMILY_CONFIGS.items()
    ]
    cases += [json.dumps({"id": name, "config": config}) for name, config in UNLOADABLE.items()]
    # Targets beside a draft model (SpeculativeConfig method "draft_model").
    cases += [
        json.dumps({"id": f"{target}+{draft}", "config": _config(target), "draft_model": _draft_config(draft, target)})
        for target, draft in DRAFT_PAIRS
    ]
    # A draft's KV under an FP8 KV cache.
    target, draft = FP8_DRAFT_PAIR
    config = {"config": _config(target), "draft_model": _draft_config(draft, target), "kv_cache_dtype": "fp8"}
    cases.append(json.dumps({"id": f"{target}+{draft}@fp8", **config}))
    # Chunked and sliding local layers again beside an EAGLE head.
    cases += [
        json.dumps({"id": f"{n}#eagle", "config": _language_model_of(n) if _wraps(n) else _config(n), "eagle_head": h})
        for n, h in ((n, _eagle_head_config(n)) for n in EAGLE_TARGETS)
    ]
    # The MTP modules vLLM drafts with (SpeculativeConfig method "mtp"), of each family that has them.
    cases += [json.dumps({"id": f"{name}#mtp", "config": _with_mtp(name), "mtp": True}) for name in MTP_TINY + MTP_REAL]
    cases += [json.dumps({"id": f"{name}#mtp", "config": _config(name), "mtp": True}) for name in MTP_HYBRIDS]
    # A text-only Qwen3.5 checkpoint (its language model's config alone), whose MTP layer vLLM cannot build.
    cases.append(json.dumps({"id": f"{QWEN3_5_TEXT}#text#mtp", "config": hybrid_config(QWEN3_5_TEXT), "mtp": True}))
    out = env.run("kv_specs", "\n".join(cases) + "\n")
    return {found["id"]: found for found in map(json.loads, out.splitlines())}


# A tiny config of each family whose MTP modules the planner counts (model_config.MTP_FAMILIES), with
# one module: latent attention (DeepSeek V3), grouped-query attention (GLM-4.5), sparse attention with an
# indexer in every layer (DeepSeek V3.2) and in some (GLM-5.2's index_topk_freq: the module has one).
MTP_TINY = ("deepseek-v3", "glm4-moe-head-norms", "deepseek-v32", "glm-moe-dsa")
# And real ones, each with its one module: DeepSeek-V3's 256 experts, GLM-4.5's 160.
MTP_REAL = ("deepseek-ai--DeepSeek-V3", "zai-org--GLM-4.5")


# Hybrids whose MTP modules vLLM drafts with (model_config.HYBRID_MTP): Qwen3-Next's experts (its config
# names no count), Qwen3.5's MLP and its experts (its multimodal checkpoints', as vLLM builds them).
MTP_HYBRIDS = ("Qwen--Qwen3-Next-80B-A3B-Thinking", "Qwen--Qwen3.5-27B", "Qwen--Qwen3.5-35B-A3B")
QWEN3_5_TEXT = "Qwen--Qwen3.5-27B"


def _with_mtp(name: str) -> dict[str, Any]:
    if name in MTP_REAL:
        return _config(name)
    return {**config_of(FAMILY_CONFIGS[name]), "num_nextn_predict_layers": 1}


# Models with local layers planned beside an EAGLE head: chunked (Llama 4) and sliding (gpt-oss).
SCOUT = "meta-llama--Llama-4-Scout-17B-16E-Instruct"
EAGLE_TARGETS = (SCOUT, "openai--gpt-oss-20b")


def _config(name: str) -> dict[str, Any]:
    return json.loads((HF_CONFIGS / f"{name}.json").read_text())


# Draft models beside their targets: of the target's layer shape (Llama 3.2 3B), of a narrower one
# (Llama 3.2 1B's: 64-value heads) beside full attention only, beside sliding windows (gpt-oss), and
# a draft with windows of its own beside a target with others (Gemma 3 1B beside Gemma 2 2B).
LLAMA_3_2_1B = "llama-3.2-1b (the catalog's shape)"
FP8_DRAFT_PAIR = ("meta-llama--Meta-Llama-3.1-8B", "meta-llama--Llama-3.2-3B")
DRAFT_PAIRS = (
    ("meta-llama--Meta-Llama-3.1-8B", "meta-llama--Llama-3.2-3B"),
    ("meta-llama--Meta-Llama-3.1-8B", LLAMA_3_2_1B),
    ("openai--gpt-oss-20b", "meta-llama--Llama-3.2-3B"),
    ("google--gemma-2-2b-it", "google--gemma-3-1b-it"),
)


def _draft_config(draft: str, target: str) -> dict[str, Any]:
    """`draft`'s config.json with the target's vocabulary (vLLM drafts only with the target's tokens;
    the KV cache does not depend on it)."""
    if draft == LLAMA_3_2_1B:
        shape = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64}
        config = {**_config("meta-llama--Llama-3.2-3B"), **shape, "num_attention_heads": 32}
    else:
        config = _config(draft)
    return {**config, "vocab_size": _config(target)["vocab_size"]}


def _eagle_head_config(name: str) -> dict[str, Any]:
    """An EAGLE head of one decoder layer for `name`, as vLLM's drafters read it: Llama 4's own (its
    layer past the target's, full attention: no_rope_layers pads it NoPE), else a Llama layer of the
    target's shapes."""
    text = _language_model_of(name) if _wraps(name) else _config(name)
    if _wraps(name):
        shapes = {"num_hidden_layers": 1, "moe_layers": [], "no_rope_layers": [], "interleave_moe_layer_step": 0}
        return {**text, **shapes, "architectures": ["EagleLlama4ForCausalLM"]}
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    return {
        **{key: text[key] for key in keys},
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "intermediate_size": 4 * text["hidden_size"],
        "max_position_embeddings": text["max_position_embeddings"],
    }


# The real configs of hybrids (Mamba-2, Gated DeltaNet) and a GPU vLLM runs each kernel path on.
# Qwen3.5's language models (their wrappers' text_config) planned as vLLM builds them alone.
HYBRIDS = (
    "Qwen--Qwen3-Next-80B-A3B-Thinking",
    "nvidia--Nemotron-H-56B-Base-8K",
    "ai21labs--AI21-Jamba-1.5-Mini",
    "Qwen--Qwen3.5-27B",
    "Qwen--Qwen3.5-35B-A3B",
)
HOPPER, TRITON = "H100-80GB", "L40S"
FLASHINFER = {"flashinfer_gdn": True}
HYBRID_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}
MAMBA_2 = {"mamba_n_heads": 16, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4}
TINY_HYBRIDS: dict[str, dict[str, Any]] = {
    "tiny-granite-4.0-h": {
        **HYBRID_SHAPE,
        **MAMBA_2,
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 6,
        "layer_types": ["mamba", "mamba", "attention"] * 2,
        "mamba_expand": 2,
        "num_local_experts": 0,
        "shared_intermediate_size": 512,
    },
    "tiny-falcon-h1": {
        **HYBRID_SHAPE,
        **MAMBA_2,
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "num_hidden_layers": 4,
        "head_dim": 32,
        "mamba_d_ssm": 512,
        "mamba_expand": 2,
    },
    **TINY_COUNTED_HYBRIDS,
}


def hybrid_config(name: str) -> dict[str, Any]:
    """A hybrid's language model: a tiny one, a real config.json, or a wrapper's text_config."""
    if name in TINY_HYBRIDS:
        return TINY_HYBRIDS[name]
    return _language_model_of(name) if _wraps(name) else _config(name)


def _vllm_id(name: str) -> str:
    """The vllm_kv_specs case of a hybrid's language model alone."""
    return f"{name}#text" if name not in TINY_HYBRIDS and _wraps(name) else name


@pytest.mark.parametrize(
    ("name", "gpu"),
    [(name, gpu) for name in HYBRIDS for gpu in (TRITON, HOPPER)] + [(name, TRITON) for name in TINY_HYBRIDS],
)
def test_vllm_holds_a_hybrids_per_sequence_state_as_the_planner_sizes_it(
    name: str, gpu: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    found = vllm_kv_specs[_vllm_id(name) if gpu == TRITON else f"{name}@{HOPPER}"]
    assert found["hybrid"], found
    _assert_held_as_planned(name, gpu, found, 0)


# Hybrids whose state layers verify drafts (Gated DeltaNet, Mamba-2), each on a GPU of each kernel path
# its family takes, speculating with DRAFT_TOKENS: a page and a convolution row more per draft token.
DRAFT_TOKENS = 3
SPECULATING_HYBRIDS = (
    ("Qwen--Qwen3-Next-80B-A3B-Thinking", TRITON),
    ("Qwen--Qwen3-Next-80B-A3B-Thinking", HOPPER),
    ("Qwen--Qwen3.5-35B-A3B", HOPPER),
    ("nvidia--Nemotron-H-56B-Base-8K", TRITON),
    ("tiny-granite-4.0-h", TRITON),
    ("tiny-falcon-h1", TRITON),
)


@pytest.mark.parametrize(("name", "gpu"), SPECULATING_HYBRIDS)
def test_vllm_keeps_a_speculating_hybrids_state_pages_as_the_planner_sizes_them(
    name: str, gpu: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    found = vllm_kv_specs[f"{name}#ngram" + ("" if gpu == TRITON else f"@{HOPPER}")]
    assert "error" not in found, found
    _assert_held_as_planned(name, gpu, found["ngram"], DRAFT_TOKENS)
    unspeculating = recurrent.hybrid_kv(recurrent_state_of(name), recurrent.Serving(gpu))
    pages = {layer["pages_per_sequence"] for layer in found["ngram"]["layer_specs"] if layer["kind"] == "MambaSpec"}
    assert pages == {unspeculating.layout.state_blocks + DRAFT_TOKENS}


def recurrent_state_of(name: str) -> recurrent.RecurrentState:
    state = recurrent.recurrent_state(hybrid_config(name))
    assert state is not None, name
    return state


def _assert_held_as_planned(name: str, gpu: str, found: dict[str, Any], drafts: int) -> None:
    """vLLM's layers and pool of hybrid `name` on `gpu` (`found`), speculating with `drafts` tokens, as
    the planner sizes them: one layer's state per sequence padded to one attention page, the pages a
    sequence keeps, the block, the groups and the blocks of AVAILABLE bytes."""
    state = recurrent_state_of(name)
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving(gpu, speculative_tokens=drafts))
    layers = found["layer_specs"]
    assert Counter(layer["kind"] for layer in layers) == {
        "FullAttentionSpec": state.attention_layers,
        "MambaSpec": state.layers,
    }
    attention = [layer for layer in layers if layer["kind"] == "FullAttentionSpec"]
    states = [layer for layer in layers if layer["kind"] == "MambaSpec"]
    assert {layer["bytes_per_token"] for layer in attention} == {recurrent.attention_token_bytes(state, 1, 2)}
    assert {layer["state_bytes"] for layer in states} == {hybrid.state_bytes}
    assert {layer["page_bytes"] for layer in states} == {hybrid.page_bytes}
    assert {layer["pages_per_sequence"] for layer in states} == {hybrid.layout.state_blocks}
    pool, layout = found["pool"], hybrid.layout
    assert pool["block_size"] == hybrid.block_size
    assert Counter(pool["groups"]) == {"FullAttentionSpec": layout.full_groups, "MambaSpec": layout.state_groups}
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, hybrid.block_size)
    assert pool["blocks_per_request"] == sizing.sequence_blocks(layout, pool["max_model_len"], hybrid.block_size, 0)
    if gpu == TRITON:
        # Split over 2, 4 and 8 GPUs (Triton's kernels): each holds its share of the state and, where
        # the GPUs outnumber the KV heads (Qwen3-Next's 2 at TP 4 and 8), a copy of one KV head; vLLM
        # cannot split the state over GPUs that do not divide its heads, and the planner never tries.
        read = read_config(hybrid_config(name), "t")
        assert not isinstance(read, str), read
        for tp, split in found["split"].items():
            if placement.heads_problem(read.architecture, int(tp)):
                assert "error" in split, (tp, split)
                continue
            ours = recurrent.hybrid_kv(state, recurrent.Serving(gpu, tp=int(tp), speculative_tokens=drafts))
            assert split == {"state_bytes": ours.state_bytes, "block_size": ours.block_size}, tp


# vLLM pads its embedding and LM head to whole blocks of rows (VocabParallelEmbedding).
VOCAB_PADDING = 64
# The most of a real model's weights vLLM 0.33 holds in fp32 beyond the planner's 16-bit count (on one
# GPU; on tp GPUs, its replicated fp32 routers are up to tp times that share of one GPU's).
FP32_SHARE = 0.0005


def _language_parameters(name: str) -> tuple[int, Architecture]:
    """The parameters the planner counts for the model vLLM built as `name` in vllm_kv_specs (a real
    config, a tiny hybrid, or a wrapper's language model alone: name#text), and its Architecture."""
    if name in TINY_HYBRIDS:
        config = TINY_HYBRIDS[name]
    elif name.startswith("tiny-"):
        config = config_of(FAMILY_CONFIGS[name.removeprefix("tiny-")])
    else:
        config = _config(name.removesuffix("#text"))
    read = read_config(config, "t")
    assert not isinstance(read, str), read
    arch = read.architecture
    wrapper = WRAPPERS.get(str(config["architectures"][0]))
    if wrapper is not None and wrapper.replicated_tower:  # the language model alone holds none of the towers
        arch = arch.model_copy(update={"replicated_parameters": arch.replicated_parameters - arch.vision_parameters})
    return arch.parameters - (arch.vision_parameters or 0), arch


@pytest.mark.parametrize(
    "name",
    [
        *(n for n in real_configs() if not _wraps(n) and not isinstance(read_config(_config(n), "t"), str)),
        *(f"{n}#text" for n in real_configs() if _wraps(n)),
        *TINY_HYBRIDS,
        *(f"tiny-{name}" for name in FAMILY_CONFIGS),
    ],
)
def test_vllm_builds_the_model_with_the_parameters_the_planner_counts(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """Weights as vLLM holds them: its own classes, built on the meta device, hold the parameters the
    planner counts (DeepSeek V3's router bias, Granite 4.0-H's shared MLP, Falcon-H1's mixers, ...)."""
    counted, arch = _language_parameters(name)
    padding = (-arch.vocab_size % VOCAB_PADDING) * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    built = vllm_kv_specs[name]
    assert built["parameters"] == counted + padding
    if name in TINY_HYBRIDS or name.startswith("tiny-"):
        return  # a few tiny layers, where a router is a large share of the bytes
    # In bytes: vLLM holds a few small parts in fp32 where the planner counts 16 bits (routers and
    # routing biases, Mamba's decays): GLM-4.5-Air's gate is the most, 47 MB of its 214 GB.
    sixteen_bit = sizing.BYTES_PER_VALUE * (counted + padding)
    assert sixteen_bit <= built["parameter_bytes"] <= sixteen_bit * (1 + FP32_SHARE)


@pytest.mark.parametrize(
    "name",
    [
        *(n for n in real_configs() if not _wraps(n) and not isinstance(read_config(_config(n), "t"), str)),
        *(f"{n}#text" for n in real_configs() if _wraps(n)),
    ],
)
def test_one_gpu_of_a_tensor_parallel_group_holds_the_weights_the_planner_gives_it(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """vLLM splits the weights over the GPUs but for what it holds whole on each (norms, routers,
    latent attention's down-projections: replicatedParameters) and the K and V heads it copies where
    the GPUs outnumber them: sizing.replicated_values, which the planner adds to a replica's weights.
    DeepSeek V3's GPU holds 1.8 GB (16-bit) more on 8 GPUs than an eighth of its weights."""
    counted, arch = _language_parameters(name)
    rows = (-arch.vocab_size % VOCAB_PADDING) * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    built = {int(tp): held for tp, held in vllm_kv_specs[name]["weights_split"].items() if isinstance(held, int)}
    errors = {tp: held for tp, held in vllm_kv_specs[name]["weights_split"].items() if not isinstance(held, int)}
    # gpt-oss's experts have no unquantized MoE kernel on 4 or 8 GPUs; Gemma 3 1B's one KV head and
    # Qwen2.5-7B's 28 query heads do not split over 8.
    assert 2 in built and all(int(tp) >= 4 for tp in errors), errors
    for tp, held in built.items():
        if placement.heads_problem(arch, tp):
            continue
        ours = sizing.BYTES_PER_VALUE * (counted + rows + sizing.replicated_values(arch, tp)) / tp
        assert ours <= held <= ours * (1 + FP32_SHARE * tp), (tp, held, ours)


def test_a_tensor_parallel_replica_is_planned_with_what_each_gpu_holds_whole() -> None:
    """Qwen3-235B-A22B on 8 GPUs: its routers and norms on each, and its 4 KV heads' projections
    copied to the 4 GPUs beyond them, are weights the pool does not get (1.39 GiB over the 8)."""
    read = read_config(_config("Qwen--Qwen3-235B-A22B"), "t")
    assert not isinstance(read, str), read
    arch = read.architecture
    model = {"name": "qwen3-235b", "architecture": arch.model_dump(by_alias=True, exclude_none=True)}
    spec = {"runtime": "vllm", "model": model, "accelerator": {"type": "H200", "count": 8}}
    planned = plan(InferenceServiceSpec.model_validate(spec))
    assert planned.fits and planned.gpu_count == 8, planned.reason
    copies = sizing.replicated_values(arch, 8)
    assert copies == 7 * arch.replicated_parameters + 4 * 2 * arch.head_size * arch.hidden_size * arch.layers
    assert planned.weight_bytes == sizing.BYTES_PER_VALUE * (arch.parameters + copies)


SIZED_KINDS = {"FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "ChunkedLocalAttentionSpec"}


def _beyond_what_is_sized(found: dict[str, Any]) -> bool:
    """vLLM sees layers the planner does not size (Mamba or linear-attention state, none at all), or
    another modality (which its CPU-only venv cannot even inspect)."""
    if "error" in found or found["multimodal"] or not found["layer_specs"]:
        return True
    return any(layer["kind"] not in SIZED_KINDS for layer in found["layer_specs"])


def _without_quantization(name: str) -> dict[str, Any]:
    """The config as a 16-bit checkpoint of it holds it: the KV rule is the same however the weights
    are stored."""
    config = json.loads((HF_CONFIGS / f"{name}.json").read_text())
    return {key: value for key, value in config.items() if key != "quantization_config"}


def _kv_case(name: str) -> tuple[str, dict[str, Any]]:
    """The vllm_kv_specs case of `name` and the config the planner reads for it: a real config (a
    wrapper's language model is vLLM's case) or a family's tiny config (tiny-name)."""
    if name.startswith("tiny-"):
        return name, config_of(FAMILY_CONFIGS[name.removeprefix("tiny-")])
    return (f"{name}#text" if _wraps(name) else name), _without_quantization(name)


@pytest.mark.parametrize("name", [*real_configs(), *(f"tiny-{name}" for name in FAMILY_CONFIGS)])
def test_vllm_allocates_the_kv_cache_by_the_same_layout_or_sees_what_the_planner_refuses(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    case, config = _kv_case(name)
    found = vllm_kv_specs[case]
    read = read_config(config, name)
    if isinstance(read, str):
        assert name in NOT_COUNTED or _beyond_what_is_sized(found), (read, found)
        return
    arch, layers = read.architecture, found["layer_specs"]
    if arch.state is not None:
        # A hybrid: its Architecture carries the state vLLM sees (its pool: test_vllm_holds_a_hybrids_...).
        state = recurrent.architecture_state(arch)
        assert state == recurrent.recurrent_state(hybrid_config(name)) and state is not None
        kinds = Counter(layer["kind"] for layer in layers)
        assert kinds == {"FullAttentionSpec": state.attention_layers, "MambaSpec": state.layers}
        attention = {layer["bytes_per_token"] for layer in layers if layer["kind"] == "FullAttentionSpec"}
        assert attention == {sizing.kv_bytes_per_token(arch) // state.attention_layers}
        _assert_kv_heads_per_gpu_agree(arch, found)
        return
    assert not _beyond_what_is_sized(found), found
    # Sparse attention's indexer keys: a page of their own in each layer that runs an indexer.
    keys = [layer["bytes_per_token"] for layer in layers if layer["role"] == "indexer"]
    assert keys == [arch.indexer.key_bytes] * arch.indexer.layers if arch.indexer else not keys
    assert sizing.kv_bytes_per_token(arch) == sum(layer["bytes_per_token"] for layer in layers)
    layers = [layer for layer in layers if layer["role"] != "indexer"]
    full_kind = "MLAAttentionSpec" if arch.latent_dim else "FullAttentionSpec"
    chunked = arch.chunked  # vLLM's kinds below say whether the planner told them apart rightly
    local_kind = "ChunkedLocalAttentionSpec" if chunked else "SlidingWindowSpec"
    # Layers that read another's K and V keep none (Gemma 4's last ones); the others by their kind's shape.
    kinds = {full_kind: arch.full_cache_layers, local_kind: arch.windowed_cache_layers}
    assert Counter(layer["kind"] for layer in layers) == +Counter(kinds)
    full_bytes = 2 * arch.latent_dim if arch.latent_dim else 2 * 2 * math.prod(arch.full_kv_shape)
    expected = {full_kind: full_bytes, local_kind: 2 * 2 * arch.kv_heads * arch.head_size}
    assert all(layer["bytes_per_token"] == expected[layer["kind"]] for layer in layers), layers
    windows = {layer["attention_chunk_size"] if chunked else layer["sliding_window"] for layer in layers}
    assert windows == {arch.sliding_window, None} - ({None} if arch.windowed_layers == arch.layers else set())
    if arch.latent_dim:
        # vLLM's single KV head of the latent's width, never split over tensor-parallel GPUs.
        assert (found["kv_heads"], found["head_size"]) == (1, arch.latent_dim)
        assert {layer["max_tp_shards"] for layer in layers} == {1}
    else:
        # vLLM's model-wide figures are the largest layer's where the layers differ (Gemma 4).
        widest = (max(arch.kv_heads, arch.full_kv_shape[0]), max(arch.head_size, arch.full_kv_shape[1]))
        assert (found["layers"], found["kv_heads"], found["head_size"]) == (arch.layers, *widest)
        _assert_kv_heads_per_gpu_agree(arch, found)
    # vLLM's own planning of the pool: its blocks, and the blocks one max_model_len sequence takes.
    pool, layout = found["pool"], sizing.kv_layout(arch)
    in_flight = sizing.tokens_in_flight(pool["max_num_batched_tokens"])
    assert pool["max_in_flight_tokens"] == in_flight
    assert len(pool["groups"]) == layout.full_groups + layout.sliding_groups
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, pool["block_size"])
    # A chunked group keeps the whole chunk from a block's start, a sliding one the window less one
    # and a block more (Architecture.slidingKind tells them apart).
    assert layout.chunked == chunked
    assert pool["blocks_per_request"] == sizing.sequence_blocks(
        layout, pool["max_model_len"], pool["block_size"], in_flight
    )


SPARSE = [n for n in real_configs() if "index_topk" in _config(n)]


@pytest.mark.parametrize("name", SPARSE)
def test_vllm_holds_a_sparse_attention_models_fp8_latents_and_indexer_keys_in_blocks_its_kernels_take(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """DeepSeek V3.2 and GLM-5 under an FP8 KV cache on Hopper: FlashMLA's sparse backend keeps each
    latent as 656 bytes (fp8_ds_mla), not 576, and the indexer's keys as they are in a 16-bit cache;
    both sparse backends take blocks of a multiple of 64 tokens, which the planner renders (serving.blockSize
    16 would leave vLLM no attention backend)."""
    read = read_config(_without_quantization(name), name)
    assert not isinstance(read, str), read
    arch, found = read.architecture, vllm_kv_specs[name]["sparse"]
    fp8 = found["fp8_layer_specs"]
    assert sizing.kv_bytes_per_token(arch, sizing.FP8_BYTES_PER_VALUE) == sum(layer["bytes_per_token"] for layer in fp8)
    assert {layer["bytes_per_token"] for layer in fp8 if layer["role"] != "indexer"} == {sizing.FP8_DS_MLA_BYTES}
    block = sizing.kernel_block(arch, ServingSpec().block_size)
    assert all(block % size == 0 for sizes in found["kernel_block_sizes"].values() for size in sizes), found
    assert VLLM_CAPABILITIES.block_sizes is not None and block in VLLM_CAPABILITIES.block_sizes
    # The FP8 pool in the 64-token blocks the plan renders: vLLM's blocks and a max-length sequence's.
    pool, layout = found["fp8_pool"], sizing.kv_layout(arch, sizing.FP8_BYTES_PER_VALUE)
    assert pool["block_size"] == block
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, block)
    in_flight = sizing.tokens_in_flight(pool["max_num_batched_tokens"])
    assert pool["blocks_per_request"] == sizing.sequence_blocks(layout, pool["max_model_len"], block, in_flight)
    # The catalog's GPUs with a sparse MLA backend (Hopper, Blackwell) are planned; the others refused.
    runs_on = {major for majors in found["cuda_majors"].values() for major in majors}
    for gpu in GPUS.values():
        assert (placement.kernels_problem(arch, gpu) is None) == (gpu.cuda_major in runs_on), gpu.name


@pytest.mark.parametrize("name", real_configs())
def test_vllm_plans_the_pool_of_each_gpu_of_a_tensor_parallel_group_as_the_planner_does(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """On each GPU of a group of 2, 4 and 8, vLLM's blocks of AVAILABLE bytes, its groups and the blocks
    one max_model_len sequence takes are the planner's layout on that many GPUs (a block over the
    group's GPUs: tp times one GPU's), with the KV heads copied or split per kind (Gemma 4's full
    layers' 2 or 4 heads beside its sliding ones' 8 or 16 flip which page is the widest)."""
    case, config = _kv_case(name)
    read = read_config(config, name)
    pools = vllm_kv_specs[case].get("pool_split", {})
    if isinstance(read, str) or read.architecture.state is not None:
        return  # refused; or a hybrid, whose pages test_vllm_holds_a_hybrids_per_sequence_state_... checks
    arch = read.architecture
    assert "2" in pools, name  # vLLM splits every model the planner reads over 2 GPUs
    for tp, pool in pools.items():
        layout = sizing.kv_layout(arch, 2, int(tp))
        in_flight = sizing.tokens_in_flight(pool["max_num_batched_tokens"])
        assert pool["num_blocks"] == pool["available"] * int(tp) // sizing.kv_block_bytes(layout, pool["block_size"])
        assert len(pool["groups"]) == layout.full_groups + layout.sliding_groups, tp
        blocks = sizing.sequence_blocks(layout, pool["max_model_len"], pool["block_size"], in_flight)
        assert pool["blocks_per_request"] == blocks, tp


@pytest.mark.parametrize("name", EAGLE_TARGETS)
def test_vllm_keeps_every_token_of_chunked_layers_beside_an_eagle_head_as_the_planner_sizes_it(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    found = vllm_kv_specs[f"{name}#eagle"]
    assert "error" not in found, found
    read = read_config(_without_quantization(name), name)
    assert not isinstance(read, str), read
    arch = read.architecture
    head = arch.model_copy(update={"layers": 1, "sliding_window": None, "sliding_layers": None})
    held_whole = sizing.every_token_held(arch, "eagle", head)
    # vLLM turns its hybrid KV cache manager off for Llama 4's chunks, not for gpt-oss's windows.
    assert found["eagle"]["hybrid_manager_off"] == held_whole == arch.chunked
    pool = found["eagle"]["pool"]
    head_kv = sizing.kv_bytes_per_token(head)
    layout = sizing.kv_layout(arch, draft=head_kv, every_token=held_whole, draft_arch=head)
    in_flight = pool["max_in_flight_tokens"]
    if held_whole:
        # Every layer allocated as full attention, the head's with them: one group, every token.
        assert pool["groups"] == ["FullAttentionSpec"]
        assert layout.group_bytes_per_token == sizing.kv_bytes_per_token(arch) + head_kv
    else:
        # The head's layer, shaped as the target's, joins its full-attention ones: 12 windowed and 13
        # full layers in groups of 13 (vLLM pads the windowed group).
        assert (layout.full_groups, layout.sliding_groups, layout.draft_groups) == (1, 1, ())
        assert len(pool["groups"]) == 2
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, pool["block_size"])
    assert pool["blocks_per_request"] == sizing.sequence_blocks(
        layout, pool["max_model_len"], pool["block_size"], in_flight
    )
    if not held_whole:
        return
    # Held in chunks (the hybrid manager on), the same sequence would take under a third of the bytes.
    local = sizing.kv_layout(arch, draft=head_kv, draft_arch=head)
    sequence = (pool["max_model_len"], pool["block_size"], in_flight)
    assert 3 * sizing.sequence_bytes(local, *sequence) < sizing.sequence_bytes(layout, *sequence)


@pytest.mark.parametrize(("target", "draft"), DRAFT_PAIRS)
def test_vllm_holds_a_draft_models_kv_beside_the_targets_as_the_planner_sizes_it(
    target: str, draft: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """Beside full attention only, a draft's layers share the target's blocks (one group, every block
    both models' pages); beside local layers they are grouped among the target's by spec, every page
    raised to the widest (gpt-oss's 64-value heads hold 32 tokens a block beside Llama 3.2 3B's 128)."""
    found = vllm_kv_specs[f"{target}+{draft}"]
    assert "error" not in found, found
    arch, drafted = (read_config(c, n) for c, n in ((_config(target), target), (_draft_config(draft, target), draft)))
    assert not isinstance(arch, str) and not isinstance(drafted, str), (arch, drafted)
    pool = found["draft"]["pool"]
    layout = sizing.kv_layout(
        arch.architecture, draft=sizing.kv_bytes_per_token(drafted.architecture), draft_arch=drafted.architecture
    )
    assert len(pool["groups"]) == layout.full_groups + layout.sliding_groups + sum(
        g.groups for g in layout.draft_groups
    )
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, pool["block_size"])
    assert pool["blocks_per_request"] == sizing.sequence_blocks(
        layout, pool["max_model_len"], pool["block_size"], pool["max_in_flight_tokens"]
    )
    # The windowed targets' draft layers go in groups of their own; a plain target's share its blocks.
    assert bool(layout.draft_groups) == (arch.architecture.sliding_window is not None)


@pytest.mark.parametrize("name", MTP_TINY + MTP_REAL)
def test_vllm_drafts_with_the_mtp_modules_the_planner_counts(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """vLLM's MTP drafter (DeepSeekMTP, Glm4MoeMTP) holds the parameters the planner counts (all but the
    embedding and LM head it shares with the target), and caches per token what the drafter the
    planner derives from the target caches: one layer's latent or K and V, and its indexer's keys."""
    found = vllm_kv_specs[f"{name}#mtp"]
    assert "error" not in found, found
    read = read_config(_with_mtp(name), name)
    assert not isinstance(read, str) and read.architecture.mtp is not None, read
    assert found["mtp"]["class"] in ("DeepSeekMTP", "Glm4MoeMTP")
    assert found["mtp"]["parameters"] == read.architecture.mtp.parameters
    drafter = sizing.mtp_drafter(read.architecture)
    assert sum(layer["bytes_per_token"] for layer in found["mtp"]["draft_layers"]) == sizing.kv_bytes_per_token(drafter)
    # One GPU of 1, 2, 4 and 8 holds its share and what it holds whole (eh_proj, norms, the router, the
    # latent's down-projections, the indexer), as Draft.on counts it; beyond, only the router's fp32
    # parts (a few hundred bytes in these tiny layers).
    assert set(found["mtp"]["split"]) == {"1", "2", "4", "8"}
    for tp, held in found["mtp"]["split"].items():
        ours = sizing.held_by_group(drafter, read.architecture.mtp.parameters * sizing.BYTES_PER_VALUE, int(tp)) / int(
            tp
        )
        assert ours <= held <= ours * 1.02, (tp, held, ours)
    if name in MTP_REAL:
        return
    # Without num_nextn_predict_layers, no modules; GLM-4.7-Flash's (built otherwise) are not counted.
    assert read_config(config_of(FAMILY_CONFIGS[name]), name).architecture.mtp is None  # type: ignore[union-attr]
    lite = read_config({**config_of(FAMILY_CONFIGS["glm4-moe-lite"]), "num_nextn_predict_layers": 1}, "lite")
    assert not isinstance(lite, str) and lite.architecture.mtp is None


@pytest.mark.parametrize("name", MTP_HYBRIDS)
def test_vllm_drafts_with_a_hybrids_mtp_modules_as_the_planner_sizes_them(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    """vLLM's Qwen3NextMTP / Qwen3_5(Moe)MTP holds the parameters the planner counts (all but the
    embedding and LM head it shares), one GPU of 1, 2, 4 and 8 its share, and its gated-attention layer
    caches the model's K and V per token; planned with the model's layers, that layer joins the model's
    attention groups in the blocks raised for the state pages, which keep a page per draft token."""
    found = vllm_kv_specs[f"{name}#mtp"]
    assert "error" not in found, found
    read = read_config(_config(name), name)
    assert not isinstance(read, str) and read.architecture.mtp is not None, read
    arch, mtp = read.architecture, found["mtp"]
    assert mtp["class"] in ("Qwen3NextMTP", "Qwen3_5MTP", "Qwen3_5MoeMTP")
    assert mtp["parameters"] == arch.mtp.parameters  # type: ignore[union-attr]
    drafter = sizing.mtp_drafter(arch)
    assert sum(layer["bytes_per_token"] for layer in mtp["draft_layers"]) == sizing.kv_bytes_per_token(drafter)
    for tp, held in mtp["split"].items():
        if placement.heads_problem(arch, int(tp)):
            continue
        ours = sizing.held_by_group(drafter, arch.mtp.parameters * sizing.BYTES_PER_VALUE, int(tp)) / int(tp)  # type: ignore[union-attr]
        assert ours <= held <= ours * 1.02, (tp, held, ours)
    state = recurrent_state_of(name)
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving(TRITON, speculative_tokens=1, mtp_layers=drafter.layers))
    pool, layout = mtp["pool"], hybrid.layout
    assert pool["block_size"] == hybrid.block_size
    assert Counter(pool["groups"]) == {"FullAttentionSpec": layout.full_groups, "MambaSpec": layout.state_groups}
    assert pool["num_blocks"] == pool["available"] // sizing.kv_block_bytes(layout, hybrid.block_size)
    assert pool["blocks_per_request"] == sizing.sequence_blocks(layout, pool["max_model_len"], hybrid.block_size, 0)


def test_no_mtp_modules_are_counted_for_a_text_only_qwen3_5_checkpoint(
    vllm_kv_specs: dict[str, dict[str, Any]],
) -> None:
    """vLLM 0.33 renames a text-only Qwen3.5 config qwen3_5_mtp to draft with it, and its decoder layer then
    refuses to build: the planner counts no modules there, so speculative mtp is refused before a pod is."""
    found = vllm_kv_specs[f"{QWEN3_5_TEXT}#text#mtp"]["mtp"]
    assert found["split"] and all("Invalid model_type qwen3_5_mtp" in e["error"] for e in found["split"].values())
    read = read_config(hybrid_config(QWEN3_5_TEXT), QWEN3_5_TEXT)
    assert not isinstance(read, str) and read.architecture.state is not None and read.architecture.mtp is None


@pytest.mark.parametrize("name", sorted(UNLOADABLE))
def test_vllm_cannot_load_the_configs_the_planner_refuses_as_unloadable(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    assert "error" in vllm_kv_specs[name], vllm_kv_specs[name]
    assert isinstance(read_config(UNLOADABLE[name], name), str)


def test_under_an_fp8_kv_cache_a_draft_models_kv_is_fp8_too(vllm_kv_specs: dict[str, dict[str, Any]]) -> None:
    """vLLM gives the draft's layers the target's cache dtype: a replica planned with --kv-cache-dtype
    fp8 counts the draft's K and V at one byte a value, every block both models' pages."""
    target, draft = FP8_DRAFT_PAIR
    found = vllm_kv_specs[f"{target}+{draft}@fp8"]
    assert "error" not in found, found
    drafted = read_config(_draft_config(draft, target), draft)
    assert not isinstance(drafted, str), drafted
    served = InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {"name": "llama-3-8b"},
            "accelerator": {"type": "H100-80GB"},
            "serving": {
                "kvCacheDtype": "fp8",
                "speculative": "draft",
                "draftModel": "/drafts/llama-3.2-3b",
                "draftModelArchitecture": drafted.architecture.model_dump(by_alias=True, exclude_none=True),
                "maxContextLength": 8192,
            },
        }
    )
    result = plan(served)
    assert result.fits and result.kv_cache_dtype == "fp8", result.reason
    assert result.draft_kv_bytes_per_token == sum(layer["bytes_per_token"] for layer in found["draft"]["draft_layers"])
    pool = found["draft"]["pool"]
    assert pool["available"] // (result.kv_bytes_per_token * pool["block_size"]) == pool["num_blocks"]
    # The draft's decode steps read its KV at FP8 too, and the reason says so.
    draft_mib = f"{result.draft_kv_bytes_per_token / sizing.MiB:.3g} MiB of KV per token"
    assert draft_mib in result.reasons["speculative"], result.reasons["speculative"]


def _assert_kv_heads_per_gpu_agree(arch: Architecture, found: dict[str, Any]) -> None:
    """vLLM's KV heads per GPU at each tensor-parallel size (each copied to tp / KV heads GPUs where
    they are fewer; the most of any layer's) are the planner's, and a token's KV over the replica's
    GPUs is theirs: its layers' specs on one GPU of a group that size (kv_split), or, for a case
    vLLM did not build so, its heads per GPU in every layer."""
    layers = arch.state.attention_layers if arch.state is not None else arch.layers
    widest = max(arch.kv_heads, arch.full_kv_shape[0])
    for tp, heads in found["kv_heads_per_gpu"].items():
        assert sizing.kv_heads_per_gpu(widest, int(tp)) == heads, tp
        per_gpu = found["kv_split"][tp] if tp in found.get("kv_split", {}) else layers * 2 * heads * arch.head_size * 2
        assert sizing.kv_bytes_per_token(arch, 2, int(tp)) == int(tp) * per_gpu, tp


def test_kvpilot_plan_sizes_gemma_2s_sliding_window_layers_for_vllm() -> None:
    config = HF_CONFIGS / "google--gemma-2-2b-it.json"
    run = plan_command("--model-config", str(config), "--gpu", "L4", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["fits"] and planned["runtime"] == "vllm"
    assert "sliding-window" in planned["reasons"]["kvCache"] and "4096-token window" in planned["reasons"]["kvCache"]
    arch = read_config(json.loads(config.read_text()), "t").architecture  # type: ignore[union-attr]
    layout = sizing.kv_layout(arch)
    # The pool's blocks are vLLM's: 13 sliding and 13 full layers, a group of each.
    assert (layout.sliding_groups, layout.full_groups) == (1, 1)
    assert planned["kv_blocks"] == planned["kv_pool_bytes"] // sizing.kv_block_bytes(layout, planned["block_size"])
    # Our engine runs none of it: the plan says so instead of sizing it as full attention.
    refused = plan_command("--model-config", str(config), "--gpu", "L4", "--runtime", "kvpilot")
    assert refused.returncode != 0 and "UnsupportedByRuntime" in refused.stdout + refused.stderr
    assert "sliding-window layers (window 4096)" in refused.stdout + refused.stderr


def test_kvpilot_plan_sizes_gemma_4_by_each_kind_of_layer_for_vllm() -> None:
    """Gemma 4 31B on an H100: 50 sliding-window layers of 16 KV heads x 256 and 10 full-attention ones
    of 4 x 512 (V = K, cached apart): 50 x 16 KiB + 10 x 8 KiB a token, the full layers' page at twice
    the block's tokens to match the sliding ones' (vLLM's num_gpu_blocks over the pool); a decode at
    10k tokens reads every token in the full layers and the 1024-token window in the sliding ones."""
    config = HF_CONFIGS / "google--gemma-4-31B-it.json"
    run = plan_command("--model-config", str(config), "--gpu", "H100-80GB", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["fits"] and planned["kv_bytes_per_token"] == 50 * 16 * 1024 + 10 * 8 * 1024
    kv = planned["reasons"]["kvCache"]
    assert "the full-attention ones 4 KV heads of 512 values, 2x the block size's tokens a block" in kv
    arch = read_config(json.loads(config.read_text()), "t").architecture  # type: ignore[union-attr]
    layout = sizing.kv_layout(arch)
    assert (layout.sliding_groups, layout.full_groups, layout.block_factor) == (5, 1, 2)
    assert planned["kv_blocks"] == planned["kv_pool_bytes"] // sizing.kv_block_bytes(layout, planned["block_size"])
    full, local = latency._layer_tokens(arch, 10_000)
    assert (full, local) == (10 * 10_000, 50 * 1024)
    assert latency._attention_flops(arch, 1, 10_000) == 4 * 32 * (512 * full + 256 * local)


def test_gemma_4_e2b_keeps_no_kv_in_the_layers_that_read_earlier_ones() -> None:
    """Gemma 4 E2B: of 35 layers the last 20 read earlier layers' K and V; the 15 that keep their own
    (12 sliding of one 256-value head, 3 full of one 512-value head) are its whole KV cache."""
    read = read_config(_config("google--gemma-4-E2B-it"), "t")
    assert not isinstance(read, str), read
    arch = read.architecture
    assert arch.shared_kv is not None and (arch.shared_kv.sliding_layers, arch.shared_kv.full_layers) == (16, 4)
    assert (arch.windowed_cache_layers, arch.full_cache_layers) == (12, 3)
    assert sizing.kv_bytes_per_token(arch) == 12 * 2 * 256 * 2 + 3 * 2 * 512 * 2
    assert arch.vision_parameters is not None and arch.parameters == 5_104_297_504


def test_gemma_4_saved_by_transformers_reads_its_full_layers_shape_from_per_layer_config() -> None:
    """transformers 5 saves per_layer_config in place of global_head_dim and num_global_key_value_heads
    (fine-tunes and quantized uploads carry such configs; vLLM reads them): the same model."""
    config = _config("google--gemma-4-31B-it")
    saved = transformers_model(config).config.to_dict()
    assert "global_head_dim" not in {k for k, v in saved["text_config"].items() if v is not None}
    original, resaved = read_config(config, "t"), read_config({**saved, "architectures": config["architectures"]}, "t")
    assert not isinstance(original, str) and not isinstance(resaved, str), (original, resaved)
    assert resaved.architecture == original.architecture
    # Layers of one kind in two shapes are refused, not sized as one.
    text = {**config["text_config"], "architectures": ["Gemma4ForCausalLM"]}
    mixed = {**text, "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 256}}}
    assert "more than one K/V shape" in str(read_config(mixed, "t"))


def test_gemma_4_without_sliding_layers_caches_every_layer_at_the_full_layers_shape() -> None:
    text = {**_config("google--gemma-4-31B-it")["text_config"], "architectures": ["Gemma4ForCausalLM"]}
    read = read_config({**text, "layer_types": ["full_attention"] * 60}, "t")
    assert not isinstance(read, str), read
    arch = read.architecture
    assert (arch.kv_heads, arch.head_size, arch.sliding_window) == (4, 512, None)
    assert sizing.kv_bytes_per_token(arch) == 60 * 2 * 4 * 512 * 2
    # Layers that read an earlier layer of a kind none keeps its own K and V of: refused, as vLLM does.
    orphan = {**text, "num_hidden_layers": 3, "num_kv_shared_layers": 2}
    refused = read_config({**orphan, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "t")
    assert "an earlier sliding_attention layer's K and V, of which there is none" in str(refused)


def test_gemma_4s_towers_are_whole_on_every_gpu_and_its_per_layer_table_stays_16_bit() -> None:
    """vLLM builds Gemma 4's towers from transformers' classes with every linear replicated, so each GPU
    of a group holds them whole; online FP8 leaves the per-layer embeddings' table (a lookup, E2B's 2.3B
    values) in 16 bits, as it leaves the embedding."""
    config = _config("google--gemma-4-E2B-it")
    read, text = read_config(config, "t"), read_config(_language_model_of("google--gemma-4-E2B-it"), "t")
    assert not isinstance(read, str) and not isinstance(text, str), (read, text)
    arch, language = read.architecture, text.architecture
    assert arch.vision_parameters and arch.replicated_parameters and language.replicated_parameters
    assert arch.replicated_parameters == language.replicated_parameters + arch.vision_parameters
    assert arch.lookup_parameters == 262_144 * 35 * 256
    plain = arch.model_copy(update={"lookup_parameters": None})
    fp8, plain_fp8 = sizing.weight_bytes(arch, "fp8", False), sizing.weight_bytes(plain, "fp8", False)
    assert fp8 - plain_fp8 == arch.lookup_parameters * (sizing.BYTES_PER_VALUE - sizing.BODY_BYTES_PER_WEIGHT["fp8"])


def test_a_hand_written_gemma_4_shape_is_refused_by_our_engine_and_must_keep_a_cache() -> None:
    shape = {"layers": 4, "hiddenSize": 512, "attentionHeads": 8, "kvHeads": 2, "vocabSize": 1000}
    arch = {**shape, "parameters": 20_000_000, "maxContext": 4096, "sharedKv": {"fullLayers": 2}}
    spec = {"runtime": "kvpilot", "model": {"name": "m", "architecture": arch}, "accelerator": {"type": "L4"}}
    planned = plan(InferenceServiceSpec.model_validate(spec))
    assert not planned.fits and "layers that read another layer's K and V" in planned.reason
    with pytest.raises(ValueError, match="must leave a layer that keeps its own K and V"):
        Architecture.model_validate({**arch, "sharedKv": {"fullLayers": 4}})


def test_a_hand_written_sparse_indexer_needs_latent_attention_and_is_planned_as_vllm_runs_it() -> None:
    """`architecture.indexer` written by hand: beside a latent, in at most every layer, keys of whole
    128-value blocks; planned on vLLM in 64-token blocks with its keys, refused by our engine."""
    shape = {"layers": 4, "hiddenSize": 512, "attentionHeads": 8, "kvHeads": 1, "vocabSize": 1000}
    indexer = {"heads": 4, "headDim": 128, "topK": 64, "layers": 2}
    arch = {**shape, "parameters": 20_000_000, "maxContext": 4096, "latentDim": 576, "indexer": indexer}
    for bad, problem in (
        ({"latentDim": None}, "needs latentDim"),
        ({"indexer": {**indexer, "layers": 5}}, "at most layers"),
        ({"indexer": {**indexer, "headDim": 96}}, "multiple of 128"),
    ):
        with pytest.raises(ValueError, match=problem):
            Architecture.model_validate({**arch, **bad})
    spec = {"model": {"name": "m", "architecture": arch}, "accelerator": {"type": "H100-80GB"}}
    planned = plan(InferenceServiceSpec.model_validate({**spec, "runtime": "vllm"}))
    assert planned.fits and planned.block_size == 64, planned.reason
    assert planned.kv_bytes_per_token == 4 * 576 * 2 + 2 * 132
    ours = plan(InferenceServiceSpec.model_validate({**spec, "runtime": "kvpilot"}))
    assert not ours.fits and "sparse attention (a lightning indexer)" in ours.reason
    # vLLM has no sparse MLA kernel for an L4 (compute capability 8.9): no backend, no pod.
    on_l4 = plan(InferenceServiceSpec.model_validate({**spec, "runtime": "vllm", "accelerator": {"type": "L4"}}))
    assert not on_l4.fits and "L4 (compute capability 8.x): sparse attention" in on_l4.reason
    # Nor over a latent other than DeepSeek's, which the sparse kernels the planner sizes take.
    narrow = {**spec, "model": {"name": "m", "architecture": {**arch, "latentDim": 96}}, "runtime": "vllm"}
    refused = plan(InferenceServiceSpec.model_validate(narrow))
    assert not refused.fits and "sparse attention over a 96-value latent" in refused.reason


def test_kvpilot_plan_sizes_deepseek_v3_on_8_h200s_by_its_576_value_latent() -> None:
    config = HF_CONFIGS / "deepseek-ai--DeepSeek-V3.json"
    run = plan_command("--model-config", str(config), "--gpu", "H200", "--gpus", "8", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["fits"] and planned["gpu_count"] == 8 and planned["quantization"] == "fp8"
    # Every GPU keeps the whole latent of every layer: 61 x 576 values of 2 bytes, 8 times over.
    assert planned["kv_bytes_per_token"] == 8 * 61 * 576 * 2
    assert planned["kv_blocks"] == planned["kv_pool_bytes"] // (8 * 61 * 576 * 2 * planned["block_size"])
    assert "576-value latent" in planned["reasons"]["kvCache"]


def test_qwen2_5_vl_as_first_published_holds_its_language_model_beside_the_vision_config() -> None:
    text = config_of(FAMILY_CONFIGS["qwen2"])
    flat = {**text, **MROPE, "architectures": [WRAPPER_ARCHITECTURES["qwen2_5_vl"]], "model_type": "qwen2_5_vl"}
    flat["vision_config"] = QWEN_VISION
    read = read_config(flat, "test")
    assert not isinstance(read, str), read
    assert read.architecture.parameters == stored_count(transformers_model(flat))
    nested = read_config(
        {**WRAPPER_CONFIGS["qwen2.5-vl"][1], "architectures": flat["architectures"], "text_config": text}, "t"
    )
    assert not isinstance(nested, str) and nested.architecture == read.architecture.model_copy(update={"source": "t"})


def test_kvpilot_plan_sizes_llava_with_its_vision_tower_for_vllm() -> None:
    config = HF_CONFIGS / "llava-hf--llava-1.5-7b-hf.json"
    run = plan_command("--model-config", str(config), "--gpu", "H100-80GB", "--runtime", "vllm", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    # Every parameter in 16 bits, the CLIP tower's and projector's 324,487,168 with the Llama's.
    assert planned["fits"] and planned["weight_bytes"] == 2 * 7_063_427_072
    # The language model's KV: 32 layers x 32 heads x 128 x K and V in 16 bits; its 4096 positions.
    assert (planned["kv_bytes_per_token"], planned["max_model_len"]) == (32 * 32 * 128 * 2 * 2, 4096)
    refused = plan_command("--model-config", str(config), "--gpu", "H100-80GB", "--runtime", "kvpilot")
    assert "UnsupportedByRuntime" in refused.stdout + refused.stderr and "a vision tower" in refused.stdout
