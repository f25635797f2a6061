"""vLLM at one pinned version in its official image, driven by the same plan through its own flags:
`vllm serve MODEL --flag ...`. tests/operator/controller/test_vllm_contract.py parses every rendered
argv with that version's own parser and config builder.

The same numbers our engine gets, under vLLM's flag names, but for the KV pool: vLLM measures it at
start from `--gpu-memory-utilization` (what is left after its weights, profiled activations,
non-torch memory and CUDA graphs), which the plan predicts as vLLM counts it (planning/reserve.py)
and status.planAccuracy.kvBlocks compares with what each engine allocated. Passing the plan's
bytes (`--kv-cache-memory-bytes`) would skip vLLM's own check: a pool predicted too large would be a
pod that runs out of memory. A checkpoint stored quantized
gets no `--quantization`: vLLM reads the scheme from its config.json and picks the fastest kernel
for the GPU (Marlin for AWQ/GPTQ where it runs), which naming the method would override.
"""

from __future__ import annotations

import json

from kvpilot.engine.contract.config import EngineCapabilities, EngineConfig
from kvpilot.operator.api.names import PORT
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.runtimes.runtime import Launch, Runtime

VLLM_VERSION = "0.33.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"

# What the plan uses of vLLM: on load it quantizes a 16-bit checkpoint to FP8 (W8A8, dynamic
# activation scales; the planner offers it only on GPUs with FP8 tensor cores), and it reads
# compressed-tensors (W8A16, FP8, W8A8, W4A16), AWQ and GPTQ checkpoints, choosing their kernels
# itself. Its quantized layers multiply with low-bit kernels (Marlin, Machete, CUTLASS), and it keeps
# the embedding and the LM head in 16 bits. Speculation: prompt n-grams, a draft model, an EAGLE
# head, EAGLE-1 or EAGLE-3 (serving.draftModel under `speculative: eagle`), and the checkpoint's own
# multi-token-prediction modules (`speculative: mtp`).
VLLM_CAPABILITIES = EngineCapabilities(
    quantization=("none", "fp8"),
    speculative=("off", "ngram", "draft", "eagle", "mtp"),
    dtypes=("auto", "bfloat16", "float16"),
    checkpoint_quantization=("int8", "fp8", "w8a8", "int4", "awq", "gptq", "mxfp4"),
    tensor_parallel_sizes=(1, 2, 4, 8),
    # Its CUDA attention backends (FlashAttention, FlashInfer) take multiples of 16; the three every
    # backend of this version lists are offered.
    block_sizes=(16, 32, 64),
    low_bit_gpu_matmuls=True,
    quantized_lm_head=False,
    measures_kv_pool=True,
    holds_checkpoint_as_stored=True,
    kv_cache_dtypes=("model", "fp8"),
)

# The n-gram lengths our engine proposes with, so that both runtimes speculate alike.
NGRAM_MAX = int(EngineConfig.model_fields["ngram_prompt_lookup_max"].default)
NGRAM_MIN = int(EngineConfig.model_fields["ngram_prompt_lookup_min"].default)


def speculative_config(plan: Plan, draft_model: str | None) -> dict[str, object] | None:
    """vLLM's --speculative-config for the plan's mode; None when the plan does not speculate."""
    if plan.speculative == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": plan.num_speculative_tokens,
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": NGRAM_MIN,
        }
    if plan.speculative in ("draft", "eagle"):
        method = "draft_model" if plan.speculative == "draft" else "eagle3" if plan.eagle3_head else "eagle"
        return {"method": method, "model": draft_model, "num_speculative_tokens": plan.num_speculative_tokens}
    if plan.speculative == "mtp":
        return {"method": "mtp", "num_speculative_tokens": plan.num_speculative_tokens}
    return None


def vllm_args(launch: Launch) -> list[str]:
    """The `vllm serve` arguments carrying the plan's numbers."""
    spec, plan = launch.spec, launch.plan
    args = [
        launch.model,
        "--host=0.0.0.0",
        f"--port={PORT}",
        f"--served-model-name={spec.model.served_model_name or spec.model.name}",
        f"--max-model-len={plan.max_model_len}",
        f"--max-num-seqs={plan.max_num_seqs}",
        f"--max-num-batched-tokens={plan.max_num_batched_tokens}",
        f"--block-size={plan.block_size}",
        "--enable-prefix-caching",
        f"--tensor-parallel-size={plan.gpu_count}",
        f"--gpu-memory-utilization={plan.gpu_memory_utilization:g}",
    ]
    if plan.kv_cache_dtype == "fp8":
        args.append("--kv-cache-dtype=fp8")
    if launch.float16:
        args.append("--dtype=float16")
    if spec.model.quantization is None and plan.quantization != "none":
        args.append(f"--quantization={plan.quantization}")
    speculative = speculative_config(plan, launch.draft_model)
    if speculative is not None:
        args.append("--speculative-config=" + json.dumps(speculative, separators=(",", ":")))
    return args + lora_args(plan)


def lora_args(plan: Plan) -> list[str]:
    """The adapter slots of spec.adapters; the adapters themselves are loaded while the engine runs
    (`/v1/load_lora_adapter`), so that adding one restarts no pod."""
    if plan.lora is None:
        return []
    return [
        "--enable-lora",
        f"--max-loras={plan.lora.max_loras}",
        f"--max-lora-rank={plan.lora.max_lora_rank}",
        f"--max-cpu-loras={plan.lora.max_cpu_loras}",
    ]


RUNTIME = Runtime(
    name="vllm",
    capabilities=VLLM_CAPABILITIES,
    image=VLLM_IMAGE,
    command=("vllm", "serve"),
    args=vllm_args,
    ready_path="/health",
    api_key_env="VLLM_API_KEY",
    # The files are local (image, PVC or the download's cache): vLLM never asks the hub, and sends
    # no usage report from the cluster.
    env=(("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")),
    # Runtime LoRA updating: /v1/load_lora_adapter and /v1/unload_lora_adapter, which vLLM serves only
    # with it (off unless asked for).
    lora_env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),),
    ships_downloader=False,
    lora=True,
    # Its drafters run without the adapters, the target with them; an MTP drafter beside adapters was
    # never checked against vLLM's config (the models that have one have no LoRA here), so not offered.
    lora_speculative=tuple(mode for mode in VLLM_CAPABILITIES.speculative if mode != "mtp"),
)
