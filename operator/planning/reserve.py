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
Sparse attention (DeepSeek V3.2, GLM-5) adds what its model and backends allocate (read in vLLM
0.33's code, not in a log: sparse_attention): a top-k index buffer at loading, FlashMLA's sparse
workspace, which the runner's one workspace shares with the fused-MoE one (the larger is held), and
the indexer's scratch at the profiling run's peak.
"""

from __future__ import annotations

import math
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
# Sparse attention (read in vLLM 0.33's code): the model's top-k index buffer, an int32 per batched
# row and selected token (DeepseekV2Model.topk_indices_buffer); FlashMLA's sparse backend's workspace,
# bf16 rows of the step's queries (heads padded to 64 for a 16-bit cache) and, for an FP8 cache, a
# prefill workspace of 5 max_model_len latents (2 beyond 256k tokens) and three more query-sized
# buffers (flashmla_sparse.py); the indexer's logits scratch its profiling run allocates
# (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB) and, on several GPUs, twice the index buffer for the top-k
# exchange (sparse_attn_indexer.py).
TOPK_INDEX_BYTES = 4
SPARSE_HEAD_PADDING = 64
SPARSE_WORKSPACE_FACTOR = 5
SPARSE_WORKSPACE_LONG_FACTOR = 2
SPARSE_WORKSPACE_LONG_TOKENS = 256 * 1024
INDEXER_LOGITS_BYTES = 512 * sizing.MiB


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


class SparseAttention(NamedTuple):
    """What sparse attention holds on one GPU beside the weights and the KV pool (0s without an indexer)."""

    index_buffer: int = 0  # from loading on
    workspace: int = 0  # in the runner's one workspace, which the fused-MoE one shares
    transient: int = 0  # at the profiling run's peak only


NO_SPARSE_ATTENTION = SparseAttention()


def sparse_attention(
    arch: Architecture, batched_tokens: int, tp: int, max_model_len: int, fp8: bool
) -> SparseAttention:
    """Sparse attention's buffers on each of `tp` GPUs at `batched_tokens` a step and `max_model_len`,
    its latents in an FP8 KV cache or not (the constants above)."""
    if arch.indexer is None or arch.latent_dim is None:
        return NO_SPARSE_ATTENTION
    heads = arch.attention_heads // tp
    padded = math.ceil(heads / SPARSE_HEAD_PADDING) * SPARSE_HEAD_PADDING
    latent, rank = arch.latent_dim, arch.latent_dim - sizing.SPARSE_ROPE_VALUES
    index_buffer = batched_tokens * arch.indexer.top_k * TOPK_INDEX_BYTES
    rows = batched_tokens * (heads if fp8 else padded) * latent
    if fp8:
        long = max_model_len > SPARSE_WORKSPACE_LONG_TOKENS
        prefill = (SPARSE_WORKSPACE_LONG_FACTOR if long else SPARSE_WORKSPACE_FACTOR) * max_model_len * latent
        rows += prefill + batched_tokens * (padded * (latent + rank) + heads * rank)
    exchange = 2 * index_buffer if tp > 1 else 0
    return SparseAttention(index_buffer, rows * sizing.BYTES_PER_VALUE, INDEXER_LOGITS_BYTES + exchange)


def vllm_reserve(
    arch: Architecture, batched_tokens: int, max_num_seqs: int, tp: int, sparse: SparseAttention = NO_SPARSE_ATTENTION
) -> Reserve:
    """What vLLM holds on each of a replica's `tp` GPUs beside weights and KV (module docstring), with
    sparse attention's buffers where the model has them (sparse_attention)."""
    experts = arch.active_parameters is not None
    sampler = min(max_num_seqs, batched_tokens) * arch.vocab_size * SAMPLER_BYTES_PER_LOGIT
    width = FORWARD_INTERMEDIATES * mlp_width(arch) / tp + FORWARD_HIDDEN_STATES * arch.hidden_size
    forward = int(batched_tokens * width * sizing.BYTES_PER_VALUE)
    graphs = CUDA_GRAPH_BASE_BYTES + arch.layers * CUDA_GRAPH_PER_LAYER_BYTES
    # The workspace is held through the sampler's run; the fused-MoE workspace shares it.
    held = max(forward, sparse.workspace)
    activation = sampler + held + sparse.transient if experts or sparse.workspace else max(sampler, forward)
    return Reserve(
        loading=LOADING_BYTES + sparse.index_buffer,
        activation=activation,
        non_torch=NON_TORCH_TP_BYTES + tp * NON_TORCH_PER_TP_GPU_BYTES if tp > 1 else NON_TORCH_BYTES,
        cuda_graphs=graphs + (CUDA_GRAPH_EXPERTS_BYTES if experts else 0),
    )
