"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: each stdin line is a
case {"id", "argv", "models": {path in argv: config.json}, "env": the container's variables (optional)};
each stdout line is what vLLM's own `serve` parser, `validate_parsed_serve_args` and
`create_engine_config` made of it, or the error.

The model folders hold only the config.json synthesized by the test (`--skip-tokenizer-init`), so
nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm import envs
from vllm.config.lora import LoRAConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

SERVE = ServeSubcommand()
PARSER = FlexibleArgumentParser(prog="vllm")
SERVE.subparser_init(PARSER.add_subparsers())


def numbers(argv: list[str]) -> dict[str, Any]:
    """What `vllm serve ARGV` configures, up to where it would start the engine."""
    args = PARSER.parse_args(["serve", *argv, "--skip-tokenizer-init"])
    if args.model_tag is not None:  # as `vllm serve` does: the positional model wins
        args.model = args.model_tag
    SERVE.validate(args)
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    speculative = config.speculative_config
    return {
        "model": config.model_config.model,
        "served_model_name": args.served_model_name,
        "host": args.host,
        "port": args.port,
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "kv_cache_dtype": config.cache_config.cache_dtype,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "quantization": config.model_config.quantization,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "speculative_method": speculative.method if speculative else None,
        "num_speculative_tokens": speculative.num_speculative_tokens if speculative else None,
        "draft_model": speculative.model if speculative and speculative.method != "ngram" else None,
        **_lora(config.lora_config),
    }


def _lora(lora: LoRAConfig | None) -> dict[str, Any]:
    """The adapter slots vLLM configured (None each without --enable-lora)."""
    return {
        "max_loras": lora.max_loras if lora else None,
        "max_lora_rank": lora.max_lora_rank if lora else None,
        "max_cpu_loras": lora.max_cpu_loras if lora else None,
    }


def runtime_lora_updating(env: dict[str, str]) -> bool:
    """Whether vLLM, in the container's environment, serves /v1/load_lora_adapter (its own reading of
    VLLM_ALLOW_RUNTIME_LORA_UPDATING, outside the cache of variables a running server keeps)."""
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        return bool(envs.environment_variables["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]())
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            case = json.loads(line)
            argv = list(case["argv"])
            folders = {}
            for index, (path, config) in enumerate(case["models"].items()):
                folder = Path(scratch) / f"{case['id']}-{index}"
                folder.mkdir()
                (folder / "config.json").write_text(json.dumps(config))
                folders[path] = str(folder)
            # Where the pod holds the files -> the folder holding the synthesized config.json.
            for path, folder in folders.items():
                argv = [arg.replace(path, folder) for arg in argv]
            try:
                result: dict[str, Any] = {"id": case["id"], "ok": True, **numbers(argv)}
                result["runtime_lora_updating"] = runtime_lora_updating(case.get("env", {}))
                result["model"] = next((p for p, f in folders.items() if f == result["model"]), result["model"])
                result["draft_model"] = next(
                    (p for p, f in folders.items() if f == result["draft_model"]), result["draft_model"]
                )
            except (Exception, SystemExit) as error:  # noqa: BLE001 - each case's refusal is the test's to report
                result = {"id": case["id"], "ok": False, "error": f"{type(error).__name__}: {error}"}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
