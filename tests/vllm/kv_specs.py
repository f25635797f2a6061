"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: each stdin line is a
case {"id", "config": a config.json}; each stdout line is what vLLM's own ModelConfig makes of it:
the layers, KV heads and head size it allocates the KV cache by, and what it sees beyond plain
attention (latent attention, a sliding window, hybrid or attention-free layers), or the error.

Beside those, the KV cache spec every attention layer of the model reports (the model built on the
meta device: no memory, no weights) and what vLLM's own KV cache planning makes of them with
`block_size` tokens per block, as its CUDA backends take them, `max_num_batched_tokens` under async
scheduling (its GPU default) and `available` bytes: its groups, blocks, and the blocks one
max_model_len sequence takes. The checkpoint's quantization_config is left out of that build (this
CPU-only venv has no kernels for FP8 or MXFP4 layers; the KV cache stays in the model's dtype).

The model folder holds only the config.json, so nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import get_model_architecture
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
AVAILABLE = 40 * 1024**3


def kv_spec(folder: Path) -> dict[str, Any]:
    config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    parallel = ParallelConfig()
    return {
        "layers": config.get_num_layers(parallel),
        "kv_heads": config.get_num_kv_heads(parallel),
        "head_size": config.get_head_size(),
        "use_mla": bool(config.use_mla),
        "sliding_window": config.get_sliding_window(),
        "hybrid": bool(getattr(config, "is_hybrid", False)),
        "attention_free": bool(getattr(config, "is_attention_free", False)),
        "multimodal": bool(config.is_multimodal_model),
        "max_model_len": config.max_model_len,
    }


def _layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """Every attention layer's KV cache spec, at BLOCK_SIZE (the CPU backend picks its own)."""
    with set_current_vllm_config(vllm_config):
        model_class, _ = get_model_architecture(vllm_config.model_config)
        with torch.device("meta"):
            model = model_class(vllm_config=vllm_config, prefix="")
        specs = {
            name: module.get_kv_cache_spec(vllm_config)
            for name, module in model.named_modules()
            if isinstance(module, AttentionLayerBase)
        }
    return {
        name: replace(spec, block_size=BLOCK_SIZE) if isinstance(spec, AttentionSpec) else spec
        for name, spec in specs.items()
        if spec is not None
    }


def kv_pool(folder: Path) -> dict[str, Any]:
    """The layers' specs and vLLM's planning of AVAILABLE bytes with them."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    vllm_config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK_SIZE))
    vllm_config.scheduler_config.async_scheduling = True
    # The engine core resolves it from the backends (FlashAttention: NHD); pages of one size pack the
    # same in every layout.
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    vllm_config.scheduler_config.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    specs = _layer_specs(vllm_config)
    layers = [
        {
            "kind": type(spec).__name__,
            "bytes_per_token": spec.page_size_bytes // spec.block_size if isinstance(spec, AttentionSpec) else None,
            "sliding_window": getattr(spec, "sliding_window", None),
            "max_tp_shards": getattr(spec, "max_tp_shards", None),
        }
        for spec in specs.values()
    ]
    if not specs or any(not isinstance(spec, AttentionSpec) for spec in specs.values()):
        return {"layer_specs": layers}
    groups = get_kv_cache_groups(vllm_config, specs)
    planned = get_kv_cache_config_from_groups(vllm_config, groups, AVAILABLE)
    per_request = sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes) for g in groups
    )
    return {
        "layer_specs": layers,
        "pool": {
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
            "available": AVAILABLE,
            "groups": [type(g.kv_cache_spec).__name__ for g in groups],
            "num_blocks": planned.num_blocks,
            "blocks_per_request": per_request,
            "max_model_len": model.max_model_len,
        },
    }


def _init_distributed() -> None:
    """One rank of one: the parallel state building a model needs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)


def main() -> None:
    _init_distributed()
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            case = json.loads(line)
            folder = Path(scratch) / case["id"]
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(case["config"]))
            try:
                found: dict[str, Any] = kv_spec(folder)
                found |= kv_pool(folder)
            except Exception as error:  # noqa: BLE001 - reported per case, for the test to show
                found = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps({"id": case["id"], **found}), flush=True)


if __name__ == "__main__":
    main()
