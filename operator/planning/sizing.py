"""The serving maths as small pure functions over bytes, seconds and tokens.

The rules: KV bytes per token = 2 × layers × KV heads × head dim × bytes, summed over the kinds of
layers that keep their own (a sequence holds them in blocks of its layers' groups: KVLayout); KV pool =
memory × utilization − weights − reserve; prefill is compute-bound, decode bandwidth-bound;
latency = TTFT + (N − 1) × TPOT.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from kvpilot.engine.contract.config import EngineCapabilities, EngineConfig
from kvpilot.operator.api.spec import FP8_DS_MLA_BYTES, SPARSE_BLOCK_MULTIPLE, Architecture

GiB = 1024**3
MiB = 1024**2

# The weights as the engine holds them (engine/model/: llama.py, quantization.py). Unquantized,
# every parameter is one 16-bit value (a tied LM head shares the embedding's). Quantized, only the
# decoder layers' linear weights take the scheme: the embedding and the norms stay 16-bit, and the
# LM head is INT8 under every scheme (its own copy even when tied to the embedding).
BYTES_PER_VALUE = 2
# INT8: one byte per weight plus a bf16 scale per output row (2 bytes per row of thousands of
# weights: left out). INT4: two weights per byte plus a bf16 scale and a bf16 zero per group of
# input columns, the engine's default group, which the operator never overrides.
INT8_BYTES_PER_WEIGHT = 1
INT4_BYTES_PER_WEIGHT = 0.5
INT4_GROUP = int(EngineConfig.model_fields["quantization_group_size"].default)
INT4_SCALE_ZERO_BYTES = 2 * BYTES_PER_VALUE
# AWQ and GPTQ checkpoints: 4-bit weights with a 16-bit scale and a packed 4-bit zero per group of
# 128 (their common group size). FP8: one byte per weight and a scale per tensor or row.
CHECKPOINT_INT4_GROUP = 128
AWQ_GPTQ_SCALE_ZERO_BYTES = BYTES_PER_VALUE + 0.5
BODY_BYTES_PER_WEIGHT: dict[str, float] = {
    "int8": INT8_BYTES_PER_WEIGHT,
    "w8a8": INT8_BYTES_PER_WEIGHT,
    "fp8": INT8_BYTES_PER_WEIGHT,
    "int4": INT4_BYTES_PER_WEIGHT + INT4_SCALE_ZERO_BYTES / INT4_GROUP,
    "awq": INT4_BYTES_PER_WEIGHT + AWQ_GPTQ_SCALE_ZERO_BYTES / CHECKPOINT_INT4_GROUP,
    "gptq": INT4_BYTES_PER_WEIGHT + AWQ_GPTQ_SCALE_ZERO_BYTES / CHECKPOINT_INT4_GROUP,
}
# Schemes whose bytes per weight differ by layer (MXFP4 quantizes a mixture of experts' experts, not
# its attention), so no per-scheme arithmetic holds: sized from the checkpoint's own bytes only.
SIZED_FROM_CHECKPOINT = ("mxfp4",)
# The KV cache stays 16-bit whatever the weights are (our engine has no KV quantization), unless the
# plan stores it as FP8 (vLLM's --kv-cache-dtype fp8): one byte per value.
KV_BYTES_PER_VALUE = 2
FP8_BYTES_PER_VALUE = 1
# A sparse-attention layer's latent in an FP8 KV cache: on Hopper vLLM 0.33 serves it on FlashMLA's
# sparse backend as fp8_ds_mla (FP8_DS_MLA_BYTES), not one byte a value; Blackwell's FlashInfer backend
# keeps 576 bytes, which the plan does not count on (it sizes the larger). The latent's rotary values.
SPARSE_ROPE_VALUES = 64
# The CUDA compute capabilities whose sparse MLA backends the planner sizes (placement.kernels_problem):
# Hopper's (FlashAttention's, FlashMLA's, FlashInfer's) and Blackwell's; and the latent they take.
SPARSE_MLA_CUDA_MAJORS = (9, 10)
SPARSE_LATENT_VALUES = 576

# CUDA context, cuBLAS workspaces and allocator slack: vLLM measures 0.5-1.5 GiB outside the
# weights and the KV cache on a single GPU before any activation.
RUNTIME_OVERHEAD_BYTES = 1 * GiB
# Peak live activations per token in the budgeted forward pass, in units of hidden size: FP16
# residual, norm, QKV and MLP intermediates (~12 hidden-sized tensors × 2 bytes).
ACTIVATION_BYTES_PER_HIDDEN = 24

# Fractions of the spec sheet that real kernels reach: large GEMMs in prefill sustain about half
# of peak tensor throughput; decode streams weights at about 80% of peak bandwidth.
PREFILL_COMPUTE_EFFICIENCY = 0.5
DECODE_BANDWIDTH_EFFICIENCY = 0.8


def _embedding_norms_body(arch: Architecture) -> tuple[int, int, int]:
    """Parameters of the embedding, of the norms, and of the decoder layers' linear weights (with an
    EAGLE-3 head's LM head, which is over its draft vocabulary); lookup tables beside the embedding
    (Architecture.lookupParameters) are in none of them."""
    embedding = arch.vocab_size * arch.hidden_size
    norms = (2 * arch.layers + 1) * arch.hidden_size  # two per decoder layer and the final one
    head = 0 if arch.tie_word_embeddings or arch.eagle3_head else embedding
    return embedding, norms, arch.parameters - embedding - norms - head - (arch.lookup_parameters or 0)


def architecture_problem(arch: Architecture) -> str | None:
    """Why sizing cannot use `arch` (the CRD's schema admits it, but the numbers contradict each
    other), None when it can."""
    if arch.head_size < 1:
        return (
            f"hiddenSize {arch.hidden_size} / attentionHeads {arch.attention_heads} leaves no head dimension: "
            "set headDim"
        )
    embedding, norms, body = _embedding_norms_body(arch)
    if body <= 0:
        tied = "" if arch.tie_word_embeddings else " and the LM head"
        return (
            f"parameters {arch.parameters:,} is not more than the embedding{tied} and the norms alone "
            f"({arch.parameters - body:,}: vocabSize x hiddenSize each)"
        )
    if arch.parameters_per_token > arch.parameters:
        return f"activeParameters {arch.parameters_per_token:,} > parameters {arch.parameters:,}"
    return None


class HeldAs(NamedTuple):
    """How an engine holds the unquantized weights: `bytes_per_value` each (4 on a CPU without bf16
    arithmetic, which holds them in fp32); `packed` in oneDNN's layout, which holds a tied LM head
    twice (the embedding's rows and the head's packed copy); `plain_beside_packed` where it compiles
    its decode step, which keeps every plain linear weight beside its packed copy for the graph."""

    bytes_per_value: int = BYTES_PER_VALUE
    packed: bool = False
    plain_beside_packed: bool = False


SIXTEEN_BIT = HeldAs()  # a GPU's: 16-bit values, plain


def weight_bytes(
    arch: Architecture, quantization: str, quantized_lm_head: bool = True, held: HeldAs = SIXTEEN_BIT
) -> int:
    """Bytes of the weights the engine holds for `arch` at `quantization`, the unquantized parts
    `held` as its device holds them (HeldAs); a runtime that leaves the LM head unquantized (vLLM)
    holds it in 16 bits, untied or not."""
    if quantization in SIZED_FROM_CHECKPOINT:
        loaded = arch.loaded_checkpoint_bytes
        if loaded is None:
            raise ValueError(checkpoint_problem(arch, quantization))  # plan() refuses such a spec first
        return loaded
    bytes_per_value, packed, plain_beside_packed = held
    embedding, norms, body = _embedding_norms_body(arch)
    if quantization == "none":
        copies = 0
        if packed:
            copies = body + embedding if plain_beside_packed else embedding if arch.tie_word_embeddings else 0
        return (arch.parameters + copies) * bytes_per_value
    if quantized_lm_head:
        head = embedding * INT8_BYTES_PER_WEIGHT + arch.vocab_size * BYTES_PER_VALUE  # + a scale per row
    else:
        head = 0 if arch.tie_word_embeddings else embedding * bytes_per_value
    unquantized = embedding + norms + (arch.lookup_parameters or 0)
    return int(unquantized * bytes_per_value + head + body * BODY_BYTES_PER_WEIGHT[quantization])


def checkpoint_problem(arch: Architecture, stored: str | None) -> str | None:
    """Why a checkpoint stored at `stored` cannot be sized, None when it can."""
    if stored in SIZED_FROM_CHECKPOINT and arch.checkpoint_bytes is None:
        return (
            f"a checkpoint stored as {stored} is sized from its own bytes (the safetensors' total), which are not "
            "known here: plan it from its hf:// source, or set model.architecture.checkpointBytes"
        )
    return None


def replicated_values(arch: Architecture, tp: int) -> int:
    """What a tensor-parallel group of `tp` GPUs holds beyond one copy of the weights, in values: what
    vLLM holds whole on every GPU (replicatedParameters) once more on each of the other tp - 1, and
    the K and V projections of the KV heads it copies to the GPUs that outnumber them (one head each)."""
    if tp == 1:
        return 0
    copies = (tp - 1) * (arch.replicated_parameters or 0)
    if arch.latent_dim is not None:
        return copies
    for layers, (kv_heads, head) in _cache_kinds(arch):
        if tp > kv_heads:
            copies += (tp - kv_heads) * 2 * head * arch.hidden_size * layers
    return copies


def _cache_kinds(arch: Architecture) -> tuple[tuple[int, tuple[int, int]], ...]:
    """The layers that keep K and V of their own, full-attention ones and windowed ones, each with its
    K/V heads and head dimension."""
    return (arch.full_cache_layers, arch.full_kv_shape), (arch.windowed_cache_layers, (arch.kv_heads, arch.head_size))


def held_by_group(arch: Architecture, weights: int, tp: int) -> int:
    """`weights` (one copy of the model's) as a tensor-parallel group of `tp` GPUs holds them: with
    its replicated values (replicated_values) at the weights' mean bytes per value."""
    return weights + replicated_values(arch, tp) * weights // arch.parameters


def allreduce_seconds(bytes_per_gpu: float, gpus: int, link_bytes_per_s: float, latency_s: float) -> float:
    """One ring all-reduce of a `bytes_per_gpu` tensor over `gpus`: each GPU sends and receives
    2 (n - 1) / n of it over its link, after a fixed per-call latency; free on one GPU."""
    if gpus == 1:
        return 0.0
    return latency_s + 2 * (gpus - 1) / gpus * bytes_per_gpu / link_bytes_per_s


def decode_weight_bytes(arch: Architecture, quantization: str, runtime: EngineCapabilities) -> int:
    """Bytes of weights one decode step moves on a GPU. A runtime without low-bit GPU matmuls
    (this build: `CAPABILITIES.low_bit_gpu_matmuls`) dequantizes each quantized layer's weight to a
    16-bit copy for its matmul, written and read back beside the stored weight, so there
    quantization buys memory, not decode speed."""
    stored = weight_bytes(arch, quantization, runtime.quantized_lm_head)
    if quantization == "none" or runtime.low_bit_gpu_matmuls:
        return stored
    embedding, _, body = _embedding_norms_body(arch)
    # The LM head is quantized too (INT8), and dequantized the same way.
    return stored + 2 * BYTES_PER_VALUE * (body + embedding)


def kv_heads_per_gpu(kv_heads: int, tp: int) -> int:
    """The KV heads each of `tp` GPUs holds: its share, or one where the GPUs outnumber the heads
    (vLLM copies each head to tp / KV heads GPUs: ModelConfig.get_num_kv_heads)."""
    return max(1, kv_heads // tp)


def _layer_bytes_per_token(arch: Architecture, bytes_per_value: int, tp: int, windowed: bool = False) -> int:
    """One token's KV in one full-attention layer (or, `windowed`, one windowed layer) over a replica's
    `tp` GPUs: K and V of each GPU's KV heads (the GPUs split the heads, or copy them where they
    outnumber them), or latent attention's one latent, which vLLM keeps whole on every GPU."""
    if arch.latent_dim is not None:
        packed = arch.indexer is not None and bytes_per_value == FP8_BYTES_PER_VALUE
        return (FP8_DS_MLA_BYTES if packed else arch.latent_dim * bytes_per_value) * tp
    kv_heads, head = (arch.kv_heads, arch.head_size) if windowed else arch.full_kv_shape
    return 2 * kv_heads_per_gpu(kv_heads, tp) * tp * head * bytes_per_value


def layer_kv_bytes(arch: Architecture) -> tuple[int, int]:
    """One token's K and V (or latent) in one full-attention layer and in one windowed layer, 16-bit, on one GPU."""
    return _layer_bytes_per_token(arch, KV_BYTES_PER_VALUE, 1), _layer_bytes_per_token(
        arch, KV_BYTES_PER_VALUE, 1, True
    )


def indexer_bytes_per_token(arch: Architecture, tp: int = 1) -> int:
    """A token's keys in every layer's sparse-attention indexer (Architecture.indexer), whole on each of
    the `tp` GPUs, in FP8 with their scales whatever the KV cache's dtype; 0 without one."""
    return arch.indexer.layers * arch.indexer.key_bytes * tp if arch.indexer is not None else 0


def kv_bytes_per_token(arch: Architecture, bytes_per_value: int = KV_BYTES_PER_VALUE, tp: int = 1) -> int:
    """A token's KV in every layer that keeps its own: 2 (K and V) × layers × KV heads × head dim ×
    bytes (GQA/MQA shrink it through KV heads; Gemma 4's full-attention layers have heads of their
    own), or layers × the latent × bytes on each of the `tp` GPUs under latent attention, with a
    sparse-attention indexer's keys beside it."""
    # A hybrid's state layers keep no K and V per token (their state is per sequence: planning/recurrent.py),
    # nor do layers that read an earlier layer's (Architecture.sharedKv).
    full = arch.full_cache_layers * _layer_bytes_per_token(arch, bytes_per_value, tp)
    windowed = arch.windowed_cache_layers * _layer_bytes_per_token(arch, bytes_per_value, tp, windowed=True)
    return full + windowed + indexer_bytes_per_token(arch, tp)


def mtp_drafter(arch: Architecture) -> Architecture:
    """`arch`'s MTP modules (Architecture.mtp) as a drafter of their own: the model's layers, that many
    (each a full-attention layer with its own latent or K and V, and an indexer where the model has
    one), of their parameters; the embedding and the LM head are the target's (Draft.shared_values)."""
    modules = arch.mtp
    if modules is None:
        raise ValueError("no MTP modules")  # choices.mtp_draft refuses such a model first
    indexer = arch.indexer.model_copy(update={"layers": modules.layers}) if arch.indexer is not None else None
    return Architecture(
        layers=modules.layers,
        hidden_size=arch.hidden_size,
        attention_heads=arch.attention_heads,
        kv_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        parameters=modules.parameters,
        active_parameters=modules.active_parameters,
        replicated_parameters=modules.replicated_parameters or None,
        max_context=arch.max_context,
        latent_dim=arch.latent_dim,
        indexer=indexer,
        source=f"the MTP modules of {arch.source or 'the model'}",
    )


def beyond_plain_decoder(arch: Architecture) -> str | None:
    """What `arch` holds beyond a decoder whose every layer attends to the whole sequence over K and
    V heads, text only; None when nothing."""
    features = [
        f"{'chunked local attention' if arch.chunked else 'sliding-window'} layers "
        f"({'chunk' if arch.chunked else 'window'} {arch.sliding_window})"
        if arch.sliding_window is not None
        else "",
        "latent attention (MLA)" if arch.latent_dim is not None else "",
        "sparse attention (a lightning indexer)" if arch.indexer is not None else "",
        "full-attention layers with K/V heads of their own" if arch.full_attention is not None else "",
        "layers that read another layer's K and V" if arch.shared_kv is not None else "",
        "a vision tower" if arch.vision_parameters is not None else "",
        f"{arch.state.layers} {arch.state.kind} layers that keep a state per sequence"
        if arch.state is not None
        else "",
    ]
    return ", ".join(f for f in features if f) or None


# vLLM schedules a step while the previous one runs (async scheduling, its default with one pipeline
# stage), and a sliding-window layer frees blocks only behind processed tokens: it keeps up to two
# steps of tokens beyond its window (VllmConfig.max_in_flight_tokens).
STEPS_IN_FLIGHT = 2


class KVLayout(NamedTuple):
    """The KV cache as vLLM 0.33 lays it out (v1/core/kv_cache_planning.py): the layers of each kind
    (full attention, sliding window, a per-sequence state: planning/recurrent.py) in groups of one
    size, every group with its own block table over one pool of blocks, a block `block_size` tokens
    of the widest group's layers."""

    group_bytes_per_token: int  # one token in the widest group's layers (and the draft's, if any)
    full_groups: int  # groups that keep every token of a sequence
    sliding_groups: int  # groups that keep only the window (and the tokens in flight)
    window: int | None
    state_groups: int = 0  # groups of layers that keep a state per sequence, whatever its length
    state_blocks: int = 0  # the blocks one sequence's state takes in each of them
    chunked: bool = False  # the sliding groups' window is a chunk (ChunkedLocalAttentionSpec)
    # Layers whose K and V are shaped otherwise (a draft's beside local layers, Gemma 4's full-attention
    # layers beside its sliding ones) go in groups of their own (kv_layout), and every page is raised to
    # the widest: a full group's block then holds `block_factor` times block_size tokens, a sliding
    # group's `sliding_block_factor` times.
    block_factor: int = 1
    sliding_block_factor: int = 1
    draft_groups: tuple[LayerGroups, ...] = ()


class LayerGroups(NamedTuple):
    """Layers of one kind in groups: a draft model's of their own (KVLayout.draft_groups), or the
    target's as sequence_blocks counts them."""

    groups: int
    window: int | None  # None: every token
    chunked: bool
    block_factor: int


def group_size(kinds: list[int]) -> int:
    """How many layers vLLM puts in each group, given the layers of each kind: the smallest kind's
    count, or the largest's when it is under 1.5 times the smallest (get_kv_cache_groups: fewer
    padding layers); the last group of a kind is padded."""
    present = [count for count in kinds if count]
    smallest, largest = min(present), max(present)
    return largest if 2 * largest < 3 * smallest else smallest


def every_token_held(arch: Architecture, speculative: str, draft: Architecture | None) -> bool:
    """Whether vLLM 0.33 keeps every token in `arch`'s local layers too, under the `speculative` mode
    with `draft`: VllmConfig turns its hybrid KV cache manager off where chunked local attention
    meets an EAGLE-style drafter (speculative_config.use_eagle(), MTP's too; sliding windows alone keep it on),
    and unify_hybrid_kv_cache_specs then allocates the local layers as full attention wherever a
    full-attention layer is among the target's or the draft's (Llama 4's NoPE layers always are)."""
    if not arch.chunked or speculative not in ("eagle", "mtp") or draft is None:
        return False
    return arch.windowed_layers < arch.layers or draft.windowed_layers < draft.layers


def kv_layout(
    arch: Architecture,
    bytes_per_value: int = KV_BYTES_PER_VALUE,
    tp: int = 1,
    draft: int = 0,
    every_token: bool = False,
    draft_arch: Architecture | None = None,
) -> KVLayout:
    """How vLLM groups `arch`'s layers on `tp` GPUs, with a draft model's `draft` bytes per token
    beside every block's (its KV slot for each of the target's). A mix of kinds is split into groups
    of the smaller kind's count, or of the larger's when it is under 1.5 times the smaller (vLLM's
    rule, padding the last group of a kind). `every_token` (every_token_held): the local layers are
    held as full attention, all in one group. Where the target's or the draft's (`draft_arch`) layers
    are local, the draft's are grouped by vLLM's rule among the target's, and so are a target's
    layers of two shapes (_grouped)."""
    layer = _layer_bytes_per_token(arch, bytes_per_value, tp)
    # A sparse-attention indexer's keys are pages of their own in the same group (vLLM's
    # UniformTypeKVCacheSpecs: every layer's page in each block).
    keys = indexer_bytes_per_token(arch, tp)
    if every_token:
        return KVLayout(arch.layers * layer + keys + draft, full_groups=1, sliding_groups=0, window=None)
    windowed = arch.windowed_cache_layers
    if draft_arch is not None and (windowed or draft_arch.windowed_layers):
        return _grouped(arch, draft_arch, bytes_per_value, tp)
    if windowed and _layer_bytes_per_token(arch, bytes_per_value, tp, windowed=True) != layer:
        return _grouped(arch, None, bytes_per_value, tp)
    full = arch.full_cache_layers
    size = group_size([full, windowed])
    return KVLayout(
        group_bytes_per_token=size * layer + keys + draft,
        full_groups=math.ceil(full / size),
        sliding_groups=math.ceil(windowed / size),
        window=arch.sliding_window if windowed else None,
        chunked=arch.chunked and bool(windowed),
    )


class _Kind(NamedTuple):
    """Layers vLLM 0.33 gives one KV cache spec: K and V of the same shape, held the same way."""

    layer_bytes: int  # one token in one layer, over the replica's GPUs
    window: int | None
    chunked: bool


def _target_kinds(arch: Architecture, bytes_per_value: int, tp: int) -> tuple[_Kind, _Kind]:
    """`arch`'s full-attention kind and its local one (the full one again where it has no window)."""
    full = _Kind(_layer_bytes_per_token(arch, bytes_per_value, tp), None, False)
    if arch.sliding_window is None:
        return full, full
    local = _layer_bytes_per_token(arch, bytes_per_value, tp, windowed=True)
    return full, _Kind(local, arch.sliding_window, arch.chunked)


def _kinds(arch: Architecture, bytes_per_value: int, tp: int) -> Counter[_Kind]:
    full, local = _target_kinds(arch, bytes_per_value, tp)
    found = Counter({full: arch.full_cache_layers})
    found[local] += arch.windowed_cache_layers
    return +found


def _grouped(arch: Architecture, draft: Architecture | None, bytes_per_value: int, tp: int) -> KVLayout:
    """The layout of a target with layers of two shapes, or beside a draft's layers, either with local
    layers, as vLLM 0.33 plans the KV cache of both (get_kv_cache_groups): the layers of each spec
    (K and V shaped and held alike: a draft's of the target's shape join its) in groups of one size by
    the rule above; every page raised to the widest by holding more tokens per block
    (unify_kv_cache_spec_page_size), so that each block of the pool is that many layers' widest page."""
    target = _kinds(arch, bytes_per_value, tp)
    drafted = _kinds(draft, bytes_per_value, tp) if draft is not None else Counter[_Kind]()
    kinds = target + drafted
    size = group_size(list(kinds.values()))
    widest = max(kind.layer_bytes for kind in kinds)

    def factor(kind: _Kind) -> int:
        # A page that does not divide the widest is padded to it, its block unchanged.
        return widest // kind.layer_bytes if widest % kind.layer_bytes == 0 else 1

    full, local = _target_kinds(arch, bytes_per_value, tp)
    return KVLayout(
        group_bytes_per_token=size * widest,
        full_groups=math.ceil(kinds[full] / size),
        sliding_groups=math.ceil(kinds[local] / size) if arch.sliding_window is not None else 0,
        window=arch.sliding_window,
        chunked=arch.chunked,
        block_factor=factor(full),
        sliding_block_factor=factor(local),
        draft_groups=tuple(
            LayerGroups(math.ceil(kinds[k] / size), k.window, k.chunked, factor(k)) for k in drafted if k not in target
        ),
    )


def kernel_block(arch: Architecture, block_size: int) -> int:
    """The tokens per block vLLM 0.33 runs `arch` with, given serving.blockSize: a sparse-attention
    model's raised to SPARSE_BLOCK_MULTIPLE (its sparse backends refuse a smaller one, and then no
    attention backend is left); the block size as given for the others."""
    return max(block_size, SPARSE_BLOCK_MULTIPLE) if arch.indexer is not None else block_size


def kv_block_bytes(layout: KVLayout, block_size: int) -> int:
    """Bytes of one block of the pool: vLLM divides the pool's memory by this (num_gpu_blocks)."""
    return layout.group_bytes_per_token * block_size


def tokens_in_flight(max_num_batched_tokens: int) -> int:
    return STEPS_IN_FLIGHT * max_num_batched_tokens


def sequence_blocks(layout: KVLayout, tokens: int, block_size: int, in_flight: int) -> int:
    """Blocks one sequence of `tokens` takes: every token's in each full group, its state's in each
    state group; in each sliding group the window less one plus the `in_flight` tokens (at most the
    sequence), and a block more for a window that starts inside a block
    (SlidingWindowSpec.max_admission_blocks_per_request); in each chunked group the whole chunk plus
    the tokens in flight (at most the sequence), from a block's start: a chunk starts at a multiple
    of its size, a multiple of the block size (vLLM's local-attention metadata asserts it)
    (ChunkedLocalAttentionSpec.max_admission_blocks_per_request). A draft's groups of their own
    count the same way, each at its own tokens per block."""
    target = LayerGroups(layout.full_groups, None, False, layout.block_factor)
    local = LayerGroups(layout.sliding_groups, layout.window, layout.chunked, layout.sliding_block_factor)
    groups = (target, *((local,) if layout.window is not None else ()), *layout.draft_groups)
    held = sum(_held_blocks(g, tokens, block_size, in_flight) for g in groups)
    return held + layout.state_groups * layout.state_blocks


def _held_blocks(groups: LayerGroups, tokens: int, block_size: int, in_flight: int) -> int:
    """The blocks a sequence of `tokens` takes in `groups` (sequence_blocks)."""
    block = block_size * groups.block_factor
    if groups.window is None:
        return groups.groups * blocks_per_sequence(tokens, block)
    if groups.chunked:
        return groups.groups * blocks_per_sequence(min(groups.window + in_flight, tokens), block)
    held = min(groups.window - 1 + in_flight, tokens)
    return groups.groups * (blocks_per_sequence(held, block) + 1)


def sequence_bytes(layout: KVLayout, tokens: int, block_size: int, in_flight: int) -> int:
    return kv_block_bytes(layout, block_size) * sequence_blocks(layout, tokens, block_size, in_flight)


def runtime_reserve_bytes(arch: Architecture, max_num_batched_tokens: int) -> int:
    """Memory neither weights nor KV: runtime overhead plus the peak activations of one step."""
    activations = max_num_batched_tokens * arch.hidden_size * ACTIVATION_BYTES_PER_HIDDEN
    return RUNTIME_OVERHEAD_BYTES + activations


def kv_pool_bytes(memory_bytes: int, utilization: float, weights: int, reserve: int) -> int:
    """What is left for the KV cache; negative when the weights alone do not fit."""
    return int(memory_bytes * utilization) - weights - reserve


def blocks_per_sequence(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def sequences_that_fit(
    pool_bytes: int, layout: KVLayout, tokens_per_sequence: int, block_size: int = 1, in_flight: int = 0
) -> int:
    """Sequences of `tokens_per_sequence` whose KV blocks fit in the pool (paged: whole blocks only),
    as vLLM counts its concurrency (get_max_concurrency_for_kv_cache_config); `in_flight`: the
    tokens a sliding-window group keeps beyond its window (tokens_in_flight)."""
    if pool_bytes <= 0:
        return 0
    blocks = pool_bytes // kv_block_bytes(layout, block_size)
    return int(blocks // sequence_blocks(layout, tokens_per_sequence, block_size, in_flight))


def prefill_seconds(
    parameters_per_token: int, tokens: float, ops_per_s: float, efficiency: float = PREFILL_COMPUTE_EFFICIENCY
) -> float:
    """Compute-bound: 2 FLOPs per parameter per prompt token; `efficiency` is the share of
    `ops_per_s` reached (1 for a measured rate)."""
    return 2 * parameters_per_token * tokens / (ops_per_s * efficiency)


class Rates(NamedTuple):
    """What a device reads and computes per second; `measured` rates are what kernels reached (no
    spec-sheet efficiency applies)."""

    bandwidth: float
    ops_per_s: float
    measured: bool = False


def decode_step_seconds(
    bytes_read: float, parameters_per_token: int, batch: float, rates: Rates, overhead_s: float = 0.0
) -> float:
    """One decode step: bandwidth-bound (weights + KV read once) until the batch is so large
    that its 2 × params × batch FLOPs take longer; spec-sheet figures at their usual efficiencies,
    measured ones as they are; plus `overhead_s`, the runtime's own work per step."""
    memory = bytes_read / (rates.bandwidth * (1.0 if rates.measured else DECODE_BANDWIDTH_EFFICIENCY))
    compute_efficiency = 1.0 if rates.measured else PREFILL_COMPUTE_EFFICIENCY
    compute = 2 * parameters_per_token * batch / (rates.ops_per_s * compute_efficiency)
    # A measured device's overhead may be negative (planning/cpus.py); no step beats reading its weights.
    return max(memory, max(memory, compute) + overhead_s)


def request_latency(ttft: float, tpot: float, output_tokens: int) -> float:
    """TTFT + (N − 1) × TPOT: the first token comes out of prefill."""
    return ttft + (output_tokens - 1) * tpot
