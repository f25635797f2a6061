"""kvpilot's own engine: `kvpilot serve`, its capabilities declared by the engine (engine/contract/config.py).

Its arguments are rendered from the engine's own config models, so every flag is one `kvpilot serve`
has and every value one it accepts; a plan asking for something the engine lacks raises here (a
pydantic ValidationError, a ValueError) instead of becoming a pod that exits at start.
"""

from __future__ import annotations

from kvpilot.engine.contract.config import CAPABILITIES, EMBEDDED_MODEL, EngineConfig, ServerConfig, serve_argv
from kvpilot.operator.api.names import PORT
from kvpilot.operator.api.spec import CPU_TYPE
from kvpilot.operator.runtimes.runtime import Launch, Runtime


def engine_args(launch: Launch) -> list[str]:
    """The `kvpilot serve` arguments carrying the plan's numbers."""
    spec, plan = launch.spec, launch.plan
    server = ServerConfig(
        host="0.0.0.0",
        port=PORT,
        served_model_name=spec.model.served_model_name or spec.model.name,
        vllm_compatible_metrics=True,
        grace_period=float(launch.drain_seconds),
    )
    dtype = {"dtype": "float16"} if launch.float16 else {}
    # On a CPU the engine's KV pool is its own setting (on a GPU it is what the memory leaves), its
    # dtype its own choice by the node's CPU flags, as it chose where the profile was measured, and
    # its C++ kernels (and a compiled decode step) kept in a writable cache folder.
    cpu = (
        {"device": "cpu", "kv_cache_memory_bytes": plan.kv_pool_bytes, "compile_cache_dir": launch.compile_cache_dir}
        if plan.gpu == CPU_TYPE
        else {}
    )
    if plan.compile_decode:
        cpu.update(compile_decode=True)
    if not cpu and plan.quantization in CAPABILITIES.cpu_only_quantization:
        raise ValueError(
            f"quantization {plan.quantization} runs on CPUs only: the engine would refuse it on {plan.gpu}"
        )
    engine = EngineConfig(
        **dtype,
        **cpu,
        model=launch.model,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        block_size=plan.block_size,
        gpu_memory_utilization=plan.gpu_memory_utilization,
        # A checkpoint stored quantized runs as stored: the engine's `none` follows the checkpoint
        # (scheme and group size), where naming the scheme would also pin a group size it may not have.
        quantization="none" if spec.model.quantization else plan.quantization,
        speculative=plan.speculative,
        **({"num_speculative_tokens": plan.num_speculative_tokens} if plan.num_speculative_tokens else {}),
        **({"draft_model": launch.draft_model} if launch.draft_model else {}),
        **lora_fields(launch),
    )
    return serve_argv(server, engine)


def lora_fields(launch: Launch) -> dict[str, object]:
    """The engine's adapter slots for spec.adapters (its flags are vLLM's names); the adapters
    themselves are loaded while it runs (`/v1/load_lora_adapter`), so that adding one restarts no pod."""
    lora = launch.plan.lora
    if lora is None:
        return {}
    return {
        "enable_lora": True,
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras,
    }


RUNTIME = Runtime(
    name="kvpilot",
    capabilities=CAPABILITIES,
    image=None,
    command=("kvpilot", "serve"),
    args=engine_args,
    ready_path="/ready",
    api_key_env="KVPILOT_API_KEY",
    # `--model` is a folder with config.json, or the embedded model's name.
    builtin_models=(EMBEDDED_MODEL,),
    # Adapters are planned for it once its config has the LoRA flags (an engine without them would
    # refuse the argv).
    lora="enable_lora" in EngineConfig.model_fields,
    # Its draft model runs no adapter (the engine refuses speculative draft with enable_lora); n-grams need none.
    lora_speculative=("off", "ngram"),
)
