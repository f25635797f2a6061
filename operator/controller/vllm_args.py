"""The plan as vLLM's command line: `vllm serve MODEL --flag ...` for its official image.

The same numbers our engine gets, under vLLM's flag names. The KV pool is passed as bytes per GPU
(`--kv-cache-memory-bytes`, which vLLM takes in place of `--gpu-memory-utilization`), so vLLM
allocates what the plan counted instead of profiling its own share. A checkpoint stored quantized
gets no `--quantization`: vLLM reads the scheme from its config.json and picks the fastest kernel
for the GPU (Marlin for AWQ/GPTQ where it runs), which naming the method would override.
tests/operator/controller/test_vllm_contract.py parses every rendered argv with vLLM's own parser
and config builder.
"""

from __future__ import annotations

import json

from kvpilot.engine.config import EngineConfig
from kvpilot.operator.api.names import PORT
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning.gpus import find_gpu

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
        method = "draft_model" if plan.speculative == "draft" else "eagle"
        return {"method": method, "model": draft_model, "num_speculative_tokens": plan.num_speculative_tokens}
    return None


def vllm_args(spec: InferenceServiceSpec, plan: Plan, model: str, draft_model: str | None = None) -> list[str]:
    """The `vllm serve` arguments carrying the plan's numbers; `model` and `draft_model` are where
    the pod holds their files."""
    gpu = find_gpu(str(plan.gpu))
    args = [
        model,
        "--host=0.0.0.0",
        f"--port={PORT}",
        f"--served-model-name={spec.model.served_model_name or spec.model.name}",
        f"--max-model-len={plan.max_model_len}",
        f"--max-num-seqs={plan.max_num_seqs}",
        f"--max-num-batched-tokens={plan.max_num_batched_tokens}",
        f"--block-size={plan.block_size}",
        "--enable-prefix-caching",
        f"--tensor-parallel-size={plan.gpu_count}",
        f"--kv-cache-memory-bytes={plan.kv_pool_bytes // plan.gpu_count}",
    ]
    if gpu is not None and not gpu.bf16:
        args.append("--dtype=float16")
    if spec.model.quantization is None and plan.quantization != "none":
        args.append(f"--quantization={plan.quantization}")
    speculative = speculative_config(plan, draft_model)
    if speculative is not None:
        args.append("--speculative-config=" + json.dumps(speculative, separators=(",", ":")))
    return args
