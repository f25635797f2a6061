"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: each stdin line is a
case {"id", "config": a config.json}; each stdout line is what vLLM's own ModelConfig makes of it:
the layers, KV heads and head size it allocates the KV cache by, and what it sees beyond plain
attention (latent attention, a sliding window, hybrid or attention-free layers), or the error.

The model folder holds only the config.json, so nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm.config import ModelConfig, ParallelConfig


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


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            case = json.loads(line)
            folder = Path(scratch) / case["id"]
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(case["config"]))
            try:
                found: dict[str, Any] = kv_spec(folder)
            except Exception as error:  # noqa: BLE001 - reported per case, for the test to show
                found = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps({"id": case["id"], **found}), flush=True)


if __name__ == "__main__":
    main()
