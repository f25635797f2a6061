"""What a runtime holds on each GPU beside the weights and the KV pool: the reserve, counted the way
that runtime counts it, since the KV pool is what is left.

Our engine is told its pool (`kv_cache_memory_bytes`); its reserve is sizing.runtime_reserve_bytes.

vLLM measures its own pool at start-up from `--gpu-memory-utilization` (the plan renders no pool
for it: an over-estimate would be a pod that runs out of memory): per GPU,
    KV = utilization × the total CUDA reports − weights − activation peak − non-torch − CUDA graphs,
where the activation peak is what its profiling step allocated at `max_num_batched_tokens` tokens
and `max_num_seqs` sampled rows, non-torch memory is the CUDA context's growth and, under tensor
parallelism, NCCL's and the custom all-reduce's buffers, and the CUDA-graph memory is its own
estimate of the captured graphs, subtracted before the pool since vLLM 0.21. The constants are
calibrated on public vLLM start-up logs that print each term (tests/operator/planning/
vllm_startup_logs.json, checked by test_vllm_memory.py; bench/RESULTS.md has the table):
- the activation peak is the sampler's (its worst case sorts `max_num_seqs` rows of fp32 logits over
  the whole vocabulary on every rank: ~15-16 bytes per logit measured) or, when larger, the forward
  pass's MLP intermediates at `max_num_batched_tokens`; a mixture of experts keeps its fused-MoE
  workspace allocated past the forward pass, so there the two add up;
- non-torch memory is 0.24-0.46 GiB on one GPU and 2.06-2.21 GiB per GPU under TP 2 and 4, a
  little more with more GPUs;
- CUDA graphs take 0.5-1.8 GiB per GPU, growing with the layers captured, more with experts.
Sparse attention (DeepSeek V3.2, GLM-5) adds what its model and backends allocate beside (read in
vLLM 0.33's code, not in a log): a top-k index buffer of `max_num_batched_tokens` rows at loading,
and a prefill workspace of a few max_model_len latents (sparse_mla_prefill_workspace_factor), which
the runner's one workspace shares with the fused-MoE one, so that the larger of the two is held.
"""

from __future__ import annotations

from typing import NamedTuple

from kvpilot.operator.api.spec import Architecture
from kvpilot.operator.planning import sizing

# Bytes per logit of the sampler's profiling run (top-k/top-p over every row: fp32 logits, their
# sorted copy, int64 indices, softmax): the logs measure 14.9-16.0, the highest is taken.
SAMPLER_BYTES_PER_LOGIT = 16
# The forward pass's live tensors at the MLP: the gate/up projection (2 × intermediate), the
# activation (1 ×), and the hidden states in and out (2 × hidden), 16-bit.
FORWARD_INTERMEDIATES = 3
FORWARD_HIDDEN_STATES = 2
NON_TORCH_BYTES = int(0.3 * sizing.GiB)
NON_TORCH_TP_BYTES = int(2.0 * sizing.GiB)
NON_TORCH_PER_TP_GPU_BYTES = int(0.04 * sizing.GiB)
# Loading allocates a little beyond the weights' bytes (rotary caches, allocator rounding): the
# logs' "Model loading took" is 0.0-0.15 GiB over the parameters' bytes per GPU.
LOADING_BYTES = int(0.1 * sizing.GiB)
CUDA_GRAPH_BASE_BYTES = 460 * sizing.MiB
CUDA_GRAPH_PER_LAYER_BYTES = 15 * sizing.MiB
CUDA_GRAPH_EXPERTS_BYTES = 600 * sizing.MiB
# Sparse attention's top-k index buffer (DeepseekV2Model.topk_indices_buffer): an int32 per row and
# selected token. Its prefill workspace: this many max_model_len 16-bit latents (the factor vLLM picks
# up to 256k tokens, and beyond), 576 values each (flashmla_sparse.get_prefill_workspace_size).
TOPK_INDEX_BYTES = 4
SPARSE_WORKSPACE_FACTOR = 5
SPARSE_WORKSPACE_LONG_FACTOR = 2
SPARSE_WORKSPACE_LONG_TOKENS = 256 * 1024
SPARSE_WORKSPACE_LATENT_BYTES = 576 * 2


class Reserve(NamedTuple):
    """One GPU's memory beside the weights and the KV pool, by what holds it."""

    loading: int
    activation: int
    non_torch: int
    cuda_graphs: int

    @property
    def total(self) -> int:
        return self.loading + self.activation + self.non_torch + self.cuda_graphs

    def describe(self) -> str:
        parts = (
            (self.loading, "loading"),
            (self.activation, "activation peak"),
            (self.non_torch, "non-torch"),
            (self.cuda_graphs, "CUDA graphs"),
        )
        return " + ".join(f"{name} {value / sizing.GiB:.2f}" for value, name in parts if value) + " GiB"


def mlp_width(arch: Architecture) -> int:
    """The MLP intermediate one token passes through in a layer (its experts' together), from the
    parameters one token multiplies with, less the attention, the norms and the embedding."""
    head, hidden = arch.head_size, arch.hidden_size
    q, kv = arch.attention_heads * head, arch.kv_heads * head
    attention = hidden * (q + 2 * kv) + q * hidden + 2 * hidden
    outside = arch.vocab_size * hidden * (1 if arch.tie_word_embeddings else 2) + hidden
    per_layer = (arch.parameters_per_token - outside) / arch.layers - attention
    return max(0, int(per_layer / (3 * hidden)))


def _sparse_attention(arch: Architecture, batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """Sparse attention's top-k index buffer and prefill workspace on each GPU (0, 0 without an indexer)."""
    if arch.indexer is None:
        return 0, 0
    long = max_model_len > SPARSE_WORKSPACE_LONG_TOKENS
    factor = SPARSE_WORKSPACE_LONG_FACTOR if long else SPARSE_WORKSPACE_FACTOR
    return (
        batched_tokens * arch.indexer.top_k * TOPK_INDEX_BYTES,
        factor * max_model_len * SPARSE_WORKSPACE_LATENT_BYTES,
    )


def vllm_reserve(arch: Architecture, batched_tokens: int, max_num_seqs: int, tp: int, max_model_len: int) -> Reserve:
    """What vLLM holds on each of a replica's `tp` GPUs beside weights and KV (module docstring)."""
    experts = arch.active_parameters is not None
    sampler = min(max_num_seqs, batched_tokens) * arch.vocab_size * SAMPLER_BYTES_PER_LOGIT
    width = FORWARD_INTERMEDIATES * mlp_width(arch) / tp + FORWARD_HIDDEN_STATES * arch.hidden_size
    forward = int(batched_tokens * width * sizing.BYTES_PER_VALUE)
    graphs = CUDA_GRAPH_BASE_BYTES + arch.layers * CUDA_GRAPH_PER_LAYER_BYTES
    index_buffer, workspace = _sparse_attention(arch, batched_tokens, max_model_len)
    return Reserve(
        loading=LOADING_BYTES + index_buffer,
        activation=max(sampler + forward if experts else max(sampler, forward), workspace),
        non_torch=NON_TORCH_TP_BYTES + tp * NON_TORCH_PER_TP_GPU_BYTES if tp > 1 else NON_TORCH_BYTES,
        cuda_graphs=graphs + (CUDA_GRAPH_EXPERTS_BYTES if experts else 0),
    )
