"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: each stdin line is a case
{"id", "config": a Llama config.json, "max_loras", "max_lora_rank"}; each stdout line the bytes of the
LoRA slots vLLM's own LoRAModelManager allocates for that model (every lora_a_stacked and
lora_b_stacked of the modules it wraps) and the modules it wrapped.

The model is built on the CPU with vLLM's own LlamaForCausalLM in one process (tensor-parallel size 1),
its weights left as allocated: nothing is read or downloaded.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.model_manager import LoRAModelManager
from vllm.model_executor.models.llama import LlamaForCausalLM

MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 256


def slots(folder: Path, case: dict[str, Any], first: bool) -> dict[str, Any]:
    """The bytes of the slots vLLM allocates for the case's model and LoRA settings."""
    (folder / "config.json").write_text(json.dumps(case["config"]))
    config = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        enable_lora=True,
        max_loras=case["max_loras"],
        max_lora_rank=case["max_lora_rank"],
        max_model_len=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enforce_eager=True,
    ).create_engine_config()
    with set_current_vllm_config(config):
        if first:  # one process group for all the cases
            init_distributed_environment(1, 0, f"file://{folder}/group", 0, "gloo")
            initialize_model_parallel(1, 1)
        torch.set_default_dtype(config.model_config.dtype)
        model = LlamaForCausalLM(vllm_config=config)
        manager = LoRAModelManager(
            model,
            MAX_NUM_SEQS,
            MAX_NUM_BATCHED_TOKENS,
            case["config"]["vocab_size"],
            config.lora_config,
            torch.device("cpu"),
            config,
        )
    tensors = [tensor for module in manager.modules.values() for tensor in _stacked(module)]
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "modules": sorted({name.rsplit(".", 1)[-1] for name in manager.modules}),
    }


def _stacked(module: torch.nn.Module) -> list[torch.Tensor]:
    """A wrapped module's slot tensors (a tuple per output slice in the fused projections)."""
    found = []
    for name in ("lora_a_stacked", "lora_b_stacked"):
        value = getattr(module, name, None)
        found += list(value) if isinstance(value, (tuple, list)) else [value] if value is not None else []
    return found


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for index, line in enumerate(sys.stdin):
            case = json.loads(line)
            folder = Path(scratch) / case["id"]
            folder.mkdir()
            print(json.dumps({"id": case["id"], **slots(folder, case, index == 0)}), flush=True)


if __name__ == "__main__":
    main()
