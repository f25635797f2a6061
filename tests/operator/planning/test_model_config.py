"""A model's Architecture from its config.json: the parameters counted as transformers' own modules
hold them (built on the meta device from the same config), the KV geometry as vLLM's own ModelConfig
allocates it, and every family or feature the planner does not size refused with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from e2e.hub_server import HubServer
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.model_config import FAMILIES, read_config
from kvpilot.operator.planning.models import MODELS
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
}


def config_of(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**TINY, "architectures": [ARCHITECTURES[overrides["model_type"]]], **overrides}


def transformers_model(config: dict[str, Any]) -> torch.nn.Module:
    """The model transformers builds from `config`, on the meta device (no memory, no weights)."""
    fields = {key: value for key, value in config.items() if key != "model_type"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))


def test_every_family_is_covered_here() -> None:
    assert {ARCHITECTURES[c["model_type"]] for c in FAMILY_CONFIGS.values()} == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILY_CONFIGS)
def test_parameters_and_kv_geometry_are_as_transformers_builds_the_model(name: str) -> None:
    config = config_of(FAMILY_CONFIGS[name])
    read = read_config(config, "test")
    assert not isinstance(read, str), read
    model = transformers_model(config)
    # parameters() yields a tied head once, as the count does.
    assert read.architecture.parameters == sum(p.numel() for p in model.parameters())
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
    arch = read.architecture
    kv_width = arch.kv_heads * arch.head_size
    if hasattr(attention, "qkv_proj"):  # Phi-3 fuses the three
        assert attention.qkv_proj.out_features == arch.attention_heads * arch.head_size + 2 * kv_width
    else:
        assert attention.k_proj.out_features == attention.v_proj.out_features == kv_width
    assert sizing.kv_bytes_per_token(arch) == 2 * arch.layers * arch.kv_heads * arch.head_size * 2
    if "moe" in name or name == "mixtral":
        assert arch.active_parameters is not None and arch.active_parameters < arch.parameters
    else:
        assert arch.active_parameters is None


def test_the_embedded_models_real_config_counts_the_catalogs_parameters(model_dir: Path) -> None:
    # The catalog's figure is the checkpoint's own (safetensors metadata); the config is the
    # embedded model's, as its conversion wrote it.
    read = read_config(json.loads((model_dir / "config.json").read_text()), "embedded")
    assert not isinstance(read, str), read
    catalog = MODELS["smollm2-135m"]
    assert read.architecture.model_dump(exclude={"source"}) == catalog.model_dump(exclude={"source"})


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (config_of({"model_type": "mistral", "sliding_window": 256}), "sliding-window layers (sliding_window 256)"),
        (config_of({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 256}), "sliding-window"),
        (
            config_of({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"] * 2}),
            "sliding-window",
        ),
        ({**TINY, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "DeepseekV3ForCausalLM is not"),
        ({"architectures": ["LlavaForConditionalGeneration"], "text_config": TINY}, "text_config"),
        ({**TINY}, "(no architectures) is not"),
        (
            config_of({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}}),
            "'bitsandbytes' is not sized yet",
        ),
        (config_of({"model_type": "llama", "num_hidden_layers": 0}), "num_hidden_layers is 0"),
        (config_of({"model_type": "llama", "num_key_value_heads": 3}), "not a multiple of kvHeads"),
    ],
)
def test_what_the_planner_does_not_size_is_refused_with_its_reason(config: dict[str, Any], refusal: str) -> None:
    read = read_config(config, "test")
    assert isinstance(read, str) and refusal in read, read


def test_a_window_as_long_as_the_context_is_full_attention() -> None:
    read = read_config(config_of({"model_type": "mistral", "sliding_window": TINY["max_position_embeddings"]}), "t")
    assert not isinstance(read, str), read


def test_a_checkpoint_stored_quantized_names_its_scheme() -> None:
    read = read_config(config_of({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}), "t")
    assert not isinstance(read, str) and read.quantization == "awq"
    assert read_config(config_of({"model_type": "llama"}), "t").quantization is None  # type: ignore[union-attr]


def plan_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvpilot.engine.cli", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_kvpilot_plan_reads_a_config_json_offline(tmp_path: Path) -> None:
    folder = tmp_path / "Tiny-Qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_of(FAMILY_CONFIGS["qwen3"])))
    run = plan_command("--model-config", str(folder), "--gpu", "L4", "--json")
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["model"] == "Tiny-Qwen3" and planned["fits"]
    assert f"config.json {folder / 'config.json'}" in planned["reasons"]["model"]
    (folder / "config.json").write_text(json.dumps(config_of({"model_type": "mistral", "sliding_window": 256})))
    refused = plan_command("--model-config", str(folder / "config.json"), "--gpu", "L4")
    assert refused.returncode == 2 and "UnsupportedArchitecture" in refused.stderr, refused.stderr


def test_kvpilot_plan_reads_an_hf_repositorys_config_json_from_the_hub_as_the_operator_does(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config_of(FAMILY_CONFIGS["qwen3"])))
    with HubServer("acme/tiny-qwen3", tmp_path, token="hf_cli", gated=True) as hub:
        refused = plan_command("--model", "hf://acme/tiny-qwen3", "--gpu", "L4", env={"HF_ENDPOINT": hub.url})
        assert refused.returncode == 2, refused.stderr
        assert "ModelConfigUnavailable" in refused.stderr and "401" in refused.stderr
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_cli"}
        run = plan_command("--model", "hf://acme/tiny-qwen3@main", "--gpu", "L4", "--json", env=env)
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    assert planned["model"] == "tiny-qwen3" and planned["fits"]
    assert planned["reasons"]["model"] == "the checkpoint's config.json of hf://acme/tiny-qwen3@main"


# Real config.json files of public models (hf_configs/SOURCES.tsv: where each copy was found, at
# which commit). Each is either read, with the parameters transformers' modules hold, or refused
# for the reason named here.
HF_CONFIGS = Path(__file__).parent / "hf_configs"
REFUSED = {
    "Qwen--Qwen3-Next-80B-A3B-Thinking": "Qwen3NextForCausalLM is not",  # linear-attention layers
    "deepseek-ai--DeepSeek-R1": "DeepseekV3ForCausalLM is not",  # MLA
    "deepseek-ai--DeepSeek-V2-Lite-Chat": "DeepseekV2ForCausalLM is not",
    "deepseek-ai--DeepSeek-V3": "DeepseekV3ForCausalLM is not",
    "moonshotai--Kimi-K2-Instruct": "DeepseekV3ForCausalLM is not",
    "google--gemma-2-2b-it": "Gemma2ForCausalLM is not",  # interleaved sliding windows
    "google--gemma-3-1b-it": "Gemma3ForCausalLM is not",
    "openai--gpt-oss-20b": "GptOssForCausalLM is not",
    "openai--gpt-oss-120b": "GptOssForCausalLM is not",
    "llava-hf--llava-1.5-7b-hf": "text_config",
    "microsoft--Phi-mini-MoE-instruct": "PhiMoEForCausalLM is not",
    "mistralai--Mistral-7B-v0.1": "sliding-window layers (sliding_window 4096)",
    "nvidia--Nemotron-H-56B-Base-8K": "NemotronHForCausalLM is not",  # Mamba layers
    "tiiuae--falcon-mamba-7b": "FalconMambaForCausalLM is not",
}
# Figures published with the models (their cards' safetensors totals), beside the catalog's.
PUBLISHED = {
    "meta-llama--Meta-Llama-3.1-8B": MODELS["llama-3-8b"].parameters,
    "meta-llama--Meta-Llama-3.1-70B": MODELS["llama-3-70b"].parameters,
    "meta-llama--Llama-3.3-70B-Instruct": MODELS["llama-3-70b"].parameters,
    "Qwen--Qwen2.5-7B-Instruct": MODELS["qwen2.5-7b"].parameters,
    "mistralai--Mixtral-8x7B-v0.1": MODELS["mixtral-8x7b"].parameters,
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
    built = transformers_model({k: v for k, v in config.items() if k != "quantization_config"})
    assert read.architecture.parameters == sum(p.numel() for p in built.parameters())
    if name in PUBLISHED:
        assert read.architecture.parameters == PUBLISHED[name]


@pytest.fixture(scope="module")
def vllm_kv_specs() -> dict[str, dict[str, Any]]:
    """What vLLM's own ModelConfig (tests/vllm/kv_specs.py, the pinned version) makes of each real config."""
    cases = [
        json.dumps({"id": n, "config": json.loads((HF_CONFIGS / f"{n}.json").read_text())}) for n in real_configs()
    ]
    out = env.run("kv_specs", "\n".join(cases) + "\n")
    return {found["id"]: found for found in map(json.loads, out.splitlines())}


def _beyond_plain_attention(found: dict[str, Any]) -> bool:
    """vLLM sees latent attention, a window shorter than the context, linear-attention, Mamba or no
    attention layers, or another modality (which its CPU-only venv cannot even inspect)."""
    window = found.get("sliding_window")
    shorter = window is not None and window < found["max_model_len"]
    return "error" in found or any(found[k] for k in ("use_mla", "hybrid", "attention_free", "multimodal")) or shorter


@pytest.mark.parametrize("name", real_configs())
def test_vllm_allocates_the_kv_cache_by_the_same_geometry_or_sees_what_the_planner_refuses(
    name: str, vllm_kv_specs: dict[str, dict[str, Any]]
) -> None:
    found = vllm_kv_specs[name]
    read = read_config(json.loads((HF_CONFIGS / f"{name}.json").read_text()), name)
    if isinstance(read, str):
        assert _beyond_plain_attention(found), (read, found)
        return
    arch = read.architecture
    assert not _beyond_plain_attention(found), found
    assert (found["layers"], found["kv_heads"], found["head_size"]) == (arch.layers, arch.kv_heads, arch.head_size)
    assert sizing.kv_bytes_per_token(arch) == 2 * found["layers"] * found["kv_heads"] * found["head_size"] * 2
