"""vLLM at one pinned version in its official image, driven by the same plan through its own flags
(controller/vllm_args.py); tests/operator/controller/test_vllm_contract.py parses every rendered
argv with that version's own parser and config builder.
"""

from __future__ import annotations

from kvpilot.engine.config import EngineCapabilities
from kvpilot.operator.runtimes.runtime import Runtime

VLLM_VERSION = "0.33.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"

# What the plan uses of vLLM: on load it quantizes a 16-bit checkpoint to FP8 (W8A8, dynamic
# activation scales; the planner offers it only on GPUs with FP8 tensor cores), and it reads
# compressed-tensors (W8A16, FP8, W8A8, W4A16), AWQ and GPTQ checkpoints, choosing their kernels
# itself. Its quantized layers multiply with low-bit kernels (Marlin, Machete, CUTLASS), and it keeps
# the embedding and the LM head in 16 bits. Speculation: prompt n-grams, a draft model, and an EAGLE
# head (serving.draftModel under `speculative: eagle`).
VLLM_CAPABILITIES = EngineCapabilities(
    quantization=("none", "fp8"),
    speculative=("off", "ngram", "draft", "eagle"),
    dtypes=("auto", "bfloat16", "float16"),
    checkpoint_quantization=("int8", "fp8", "w8a8", "int4", "awq", "gptq"),
    tensor_parallel_sizes=(1, 2, 4, 8),
    # Its CUDA attention backends (FlashAttention, FlashInfer) take multiples of 16; the three every
    # backend of this version lists are offered.
    block_sizes=(16, 32, 64),
    low_bit_gpu_matmuls=True,
    quantized_lm_head=False,
)

RUNTIME = Runtime(name="vllm", capabilities=VLLM_CAPABILITIES, image=VLLM_IMAGE)
