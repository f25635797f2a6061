"""Transformer architectures of common models, copied from each model's Hugging Face config.json.

Only what sizing needs: the KV cache depends on layers, KV heads and head dim; weights on the
parameter count (from the model card / safetensors metadata); prefill compute on the parameters a
token actually uses (fewer than the total for a mixture of experts).
"""

from __future__ import annotations

import re

from kvpilot.operator.api.spec import HF_SCHEME, SOURCE_PATTERN, Architecture

HF_CONFIG_URL = "https://huggingface.co/{repo}/blob/main/config.json"


def _hf(repo: str) -> str:
    return HF_CONFIG_URL.format(repo=repo)


MODELS: dict[str, Architecture] = {
    "llama-2-7b": Architecture(
        layers=32,
        hidden_size=4096,
        attention_heads=32,
        kv_heads=32,
        vocab_size=32000,
        parameters=6_738_415_616,
        max_context=4096,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Llama-2-7b-hf"),
    ),
    "llama-2-13b": Architecture(
        layers=40,
        hidden_size=5120,
        attention_heads=40,
        kv_heads=40,
        vocab_size=32000,
        parameters=13_015_864_320,
        max_context=4096,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Llama-2-13b-hf"),
    ),
    "llama-2-70b": Architecture(
        layers=80,
        hidden_size=8192,
        attention_heads=64,
        kv_heads=8,
        vocab_size=32000,
        parameters=68_976_648_192,
        max_context=4096,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Llama-2-70b-hf"),
    ),
    "llama-3-8b": Architecture(
        layers=32,
        hidden_size=4096,
        attention_heads=32,
        kv_heads=8,
        vocab_size=128256,
        parameters=8_030_261_248,
        max_context=8192,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Meta-Llama-3-8B"),
    ),
    "llama-3-70b": Architecture(
        layers=80,
        hidden_size=8192,
        attention_heads=64,
        kv_heads=8,
        vocab_size=128256,
        parameters=70_553_706_496,
        max_context=8192,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Meta-Llama-3-70B"),
    ),
    # max_position_embeddings is 32768; attention uses a 4096-token sliding window, which this
    # sizing ignores (it over-reserves KV for contexts beyond 4096, never under-reserves).
    "mistral-7b": Architecture(
        layers=32,
        hidden_size=4096,
        attention_heads=32,
        kv_heads=8,
        vocab_size=32000,
        parameters=7_241_732_096,
        max_context=32768,
        hf_architecture="MistralForCausalLM",
        source=_hf("mistralai/Mistral-7B-v0.1"),
    ),
    "mixtral-8x7b": Architecture(
        layers=32,
        hidden_size=4096,
        attention_heads=32,
        kv_heads=8,
        vocab_size=32000,
        parameters=46_702_792_704,
        active_parameters=12_900_000_000,
        max_context=32768,
        hf_architecture="MixtralForCausalLM",
        source=_hf("mistralai/Mixtral-8x7B-v0.1")
        + " ; active 12.9B per token: https://mistral.ai/news/mixtral-of-experts",
    ),
    "qwen2.5-7b": Architecture(
        layers=28,
        hidden_size=3584,
        attention_heads=28,
        kv_heads=4,
        head_dim=128,
        vocab_size=152064,
        parameters=7_615_616_512,
        max_context=32768,
        hf_architecture="Qwen2ForCausalLM",
        source=_hf("Qwen/Qwen2.5-7B-Instruct"),
    ),
    "qwen2.5-72b": Architecture(
        layers=80,
        hidden_size=8192,
        attention_heads=64,
        kv_heads=8,
        head_dim=128,
        vocab_size=152064,
        parameters=72_706_203_648,
        max_context=32768,
        hf_architecture="Qwen2ForCausalLM",
        source=_hf("Qwen/Qwen2.5-72B-Instruct"),
    ),
    # Small models of the Llama-2 and Llama-3 vocabularies: the usual draft models for their
    # families' large ones (serving.draftModel).
    "tinyllama-1.1b": Architecture(
        layers=22,
        hidden_size=2048,
        attention_heads=32,
        kv_heads=4,
        vocab_size=32000,
        parameters=1_100_048_384,
        max_context=2048,
        hf_architecture="LlamaForCausalLM",
        source=_hf("TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ),
    "llama-3.2-1b": Architecture(
        layers=16,
        hidden_size=2048,
        attention_heads=32,
        kv_heads=8,
        head_dim=64,
        vocab_size=128256,
        parameters=1_235_814_400,
        max_context=131072,
        tie_word_embeddings=True,
        hf_architecture="LlamaForCausalLM",
        source=_hf("meta-llama/Llama-3.2-1B-Instruct"),
    ),
    "smollm2-135m": Architecture(
        layers=30,
        hidden_size=576,
        attention_heads=9,
        kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        parameters=134_515_008,
        max_context=8192,
        tie_word_embeddings=True,
        hf_architecture="LlamaForCausalLM",
        source=_hf("HuggingFaceTB/SmolLM2-135M-Instruct"),
    ),
}


_VARIANT_SUFFIXES = re.compile(r"(-(instruct|chat|hf|v\d+(\.\d+)*))+$")


def _key(name: str) -> str:
    # Accept what people type and what Hugging Face repos are called: "meta-llama/Llama-2-7b-hf",
    # "Meta-Llama-3-8B-Instruct", "SmolLM2-135M-Instruct" all name a catalog architecture.
    key = name.lower().rsplit("/", 1)[-1].replace("_", "-").replace("meta-llama-3", "llama-3")
    return _VARIANT_SUFFIXES.sub("", key)


_BY_KEY: dict[str, Architecture] = {_key(name): arch for name, arch in MODELS.items()}


def find_model(name: str) -> Architecture | None:
    """A catalog architecture by model or repo name; None when unknown."""
    return _BY_KEY.get(_key(name))


# The repository a catalog entry's numbers were copied from: its `source` starts with that
# config.json's URL (mixtral's adds a second reference after it).
_REPO_IN_URL = re.compile(re.escape(HF_CONFIG_URL).replace(re.escape("{repo}"), "([^/ ]+/[^/ ]+)"))


def catalog_repo(name: str) -> str | None:
    """The Hugging Face repository of the catalog model `name`, None when it has none recorded."""
    found = _REPO_IN_URL.match(MODELS[name].source)
    return found.group(1) if found else None


def hub_repo(name: str) -> str | None:
    """The Hub repository (org/repo[@revision]) a model name stands for: the name itself when it
    is one, else the catalog model it names exactly, by its key or its repository's name; None
    otherwise. Not by find_model's looser match: `Meta-Llama-3-8B-Instruct` finds llama-3-8b's
    architecture, but llama-3-8b's repository holds the base model's weights, not the instruct's."""
    if "/" in name:
        return name if re.fullmatch(SOURCE_PATTERN, HF_SCHEME + name) else None
    for key in MODELS:
        repo = catalog_repo(key)
        if repo is not None and name.lower() in (key, repo.rsplit("/", 1)[-1].lower()):
            return repo
    return None
