"""Layers that keep a state per sequence instead of K and V per token (Mamba and Mamba-2 mixers,
Gated DeltaNet linear attention), and the KV cache of a hybrid model as vLLM 0.33 lays it out beside them.

vLLM holds each such layer's state (a short convolution window and the recurrent state) in one page
per sequence, in the same pool of blocks as the attention layers' K and V: it raises the attention
block size until an attention page (block size x one token's K and V in one layer) holds the state
(`Platform._align_hybrid_block_size`), pads the state to that page, and groups the layers of each
kind as it groups full and sliding-window attention (sizing.KVLayout). With prefix caching (which
the operator always renders) a sequence keeps 2 state pages per group plus a checkpoint page where
the layer exports one (MambaSpec.max_memory_usage_bytes, mamba_cache_mode "align"). Speculating
with k draft tokens, a Mamba-2 or Gated DeltaNet layer keeps k more convolution rows in its page and
k more pages per sequence (MambaSpec.num_speculative_blocks): one state per verified draft.
tests/operator/planning/test_recurrent.py checks each number against vLLM's own code run on the real
config.json files of tests/operator/planning/hf_configs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvpilot.operator.api.spec import Architecture, StateLayers
from kvpilot.operator.planning import sizing

# Attention backends on CUDA (FlashAttention, FlashInfer) take blocks of any multiple of 16 tokens:
# vLLM's hybrid block size is a multiple of it.
KERNEL_BLOCK_ALIGNMENT = 16
# FlashInfer's Gated DeltaNet prefill (vLLM's choice on Hopper, SM 9.x) exports the state from inside
# a prefill at multiples of 64 tokens (vllm/v1/attention/backends/gdn_attn.py), so under prefix
# caching the block is a multiple of 64 and each sequence keeps one more state page (its checkpoint).
# Elsewhere (Ampere, Ada) the Triton kernels run and neither holds. Blackwell takes FlashInfer only
# with a CUDA 13 runtime and 128-value key heads; which runtime the deployed image has is not known
# here, so B200 is planned as Triton's (unverified).
FLASHINFER_GDN_ALIGNMENT = 64
FLASHINFER_GDN_GPUS = ("H100-80GB", "H200")
# State pages a sequence keeps per group under prefix caching: the running state and the last full
# block's (MambaSpec.max_memory_usage_bytes in "align" mode), besides a checkpoint page.
ALIGN_MODE_PAGES = 2
FP32_BYTES = 4
# The state layers vLLM 0.33 verifies drafts through: its Mamba (1) mixer decodes one token per
# sequence and step, whatever the scheduler sends it (mamba_mixer.py has no draft path).
SPECULATING_KINDS = ("mamba2", "gated_deltanet")


class RecurrentState(NamedTuple):
    """What one of a model's state layers holds per sequence, before tensor parallelism splits it."""

    # "mamba2" (Nemotron-H, Granite 4.0-H, Falcon-H1), "mamba1" (Jamba) or "gated_deltanet" (Qwen3-Next, Qwen3.5)
    kind: str
    layers: int  # the layers that keep it
    attention_layers: int  # the full-attention layers beside them
    conv_channels: int  # the short convolution's channels (split over the GPUs)
    conv_width: int  # tokens the convolution keeps: its kernel less one
    groups: int  # Mamba-2's B/C groups, each conv_group_channels wide (0: none)
    conv_group_channels: int
    heads: int  # the recurrent state's heads (split over the GPUs)
    head_values: int  # one head's recurrent state
    fp32_state: bool  # the recurrent state in fp32 (Nemotron-H's default, Qwen3.5's config), else in the model's dtype
    kv_heads: int  # the attention layers' K and V heads
    head_dim: int


def _count(types: list[str], kind: str) -> int:
    return sum(1 for t in types if t == kind)


def _nemotron_h(config: Mapping[str, Any]) -> RecurrentState:
    """Nemotron-H: hybrid_override_pattern names each layer (M: Mamba-2, *: attention, -: MLP)."""
    pattern = str(config["hybrid_override_pattern"])
    heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    state = int(config["ssm_state_size"])
    return RecurrentState(
        kind="mamba2",
        layers=pattern.count("M"),
        attention_layers=pattern.count("*"),
        conv_channels=heads * head_dim,
        conv_width=int(config["conv_kernel"]) - 1,
        groups=int(config["n_groups"]),
        conv_group_channels=2 * state,
        heads=heads,
        head_values=head_dim * state,
        # vLLM's NemotronHForCausalLMConfig: the config's mamba_ssm_cache_dtype, else float32.
        fp32_state=config.get("mamba_ssm_cache_dtype", "float32") == "float32",
        kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config.get("attention_head_dim") or config["hidden_size"] // config["num_attention_heads"]),
    )


def _gated_deltanet(config: Mapping[str, Any]) -> RecurrentState:
    """Qwen3-Next: layer_types (else every full_attention_interval-th layer full) of
    linear_attention (Gated DeltaNet) and full_attention."""
    layers = int(config["num_hidden_layers"])
    interval = int(config.get("full_attention_interval") or 4)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    key_heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    key_dim, value_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    return RecurrentState(
        kind="gated_deltanet",
        layers=_count(types, "linear_attention"),
        attention_layers=_count(types, "full_attention"),
        conv_channels=2 * key_heads * key_dim + value_heads * value_dim,
        conv_width=int(config["linear_conv_kernel_dim"]) - 1,
        groups=0,
        conv_group_channels=0,
        heads=value_heads,
        head_values=value_dim * key_dim,
        # In the model's dtype unless vLLM is told otherwise (--mamba-ssm-cache-dtype, never rendered).
        fp32_state=False,
        kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config["head_dim"]),
    )


def _qwen3_5(config: Mapping[str, Any]) -> RecurrentState:
    """Qwen3.5: Qwen3-Next's layers, its recurrent state in the dtype text_config's mamba_ssm_dtype
    names (vLLM 0.33's Qwen3_5ForConditionalGenerationConfig takes it; the checkpoints say float32)."""
    return _gated_deltanet(config)._replace(fp32_state=config.get("mamba_ssm_dtype") == "float32")


def _mamba2_head_dim(config: Mapping[str, Any], inner: int) -> int:
    """mamba_d_head, or, where the config says "auto", the mixer's channels over its heads (as both
    config classes settle it)."""
    head = config.get("mamba_d_head", "auto")
    return inner // int(config["mamba_n_heads"]) if head == "auto" else int(head)


def _granite_hybrid(config: Mapping[str, Any]) -> RecurrentState:
    """Granite 4.0-H: layer_types of mamba (Mamba-2, mamba_expand x hidden_size channels) and attention
    (as its checkpoints spell them; transformers 5 saves linear_attention and full_attention)."""
    types, hidden = list(config["layer_types"]), int(config["hidden_size"])
    heads, state = int(config["mamba_n_heads"]), int(config["mamba_d_state"])
    inner = int(config.get("mamba_expand", 2)) * hidden
    return RecurrentState(
        kind="mamba2",
        layers=_count(types, "mamba") + _count(types, "linear_attention"),
        attention_layers=_count(types, "attention") + _count(types, "full_attention"),
        conv_channels=inner,
        conv_width=int(config.get("mamba_d_conv", 4)) - 1,
        groups=int(config.get("mamba_n_groups", 1)),
        conv_group_channels=2 * state,
        heads=heads,
        head_values=_mamba2_head_dim(config, inner) * state,
        fp32_state=False,
        kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim=hidden // int(config["num_attention_heads"]),
    )


# FalconH1Config's mamba_d_ssm where config.json leaves it out (an explicit null is mamba_expand x hidden_size).
FALCON_H1_D_SSM = 1024


def _falcon_h1(config: Mapping[str, Any]) -> RecurrentState:
    """Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (mamba_d_ssm channels,
    else mamba_expand x hidden_size)."""
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    heads, state = int(config["mamba_n_heads"]), int(config["mamba_d_state"])
    d_ssm = config.get("mamba_d_ssm", FALCON_H1_D_SSM)
    inner = int(config.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    return RecurrentState(
        kind="mamba2",
        layers=layers,
        attention_layers=layers,
        conv_channels=inner,
        conv_width=int(config.get("mamba_d_conv", 4)) - 1,
        groups=int(config.get("mamba_n_groups", 1)),
        conv_group_channels=2 * state,
        heads=heads,
        head_values=_mamba2_head_dim(config, inner) * state,
        fp32_state=False,
        # FalconH1Config: 8 where left out, the query heads where null.
        kv_heads=int(config.get("num_key_value_heads", 8) or config["num_attention_heads"]),
        head_dim=int(config.get("head_dim") or hidden // int(config["num_attention_heads"])),
    )


def _jamba(config: Mapping[str, Any]) -> RecurrentState:
    """Jamba: attention in every attn_layer_period-th layer from attn_layer_offset, Mamba (1) in the
    others, whose state is mamba_expand x hidden_size channels of mamba_d_state values."""
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    period, offset = int(config["attn_layer_period"]), int(config["attn_layer_offset"])
    attention = sum(1 for i in range(layers) if i % period == offset)
    inner = int(config["mamba_expand"]) * hidden
    return RecurrentState(
        kind="mamba1",
        layers=layers - attention,
        attention_layers=attention,
        conv_channels=inner,
        conv_width=int(config["mamba_d_conv"]) - 1,
        groups=0,
        conv_group_channels=0,
        heads=inner,
        head_values=int(config["mamba_d_state"]),
        fp32_state=False,
        kv_heads=int(config["num_key_value_heads"]),
        head_dim=hidden // int(config["num_attention_heads"]),
    )


# architectures[0] -> how its config names the state layers.
READERS = {
    "NemotronHForCausalLM": _nemotron_h,
    "Qwen3NextForCausalLM": _gated_deltanet,
    "Qwen3_5ForCausalLM": _qwen3_5,
    "Qwen3_5MoeForCausalLM": _qwen3_5,
    "GraniteMoeHybridForCausalLM": _granite_hybrid,
    "FalconH1ForCausalLM": _falcon_h1,
    "JambaForCausalLM": _jamba,
}


def recurrent_state(config: Mapping[str, Any]) -> RecurrentState | None:
    """The per-sequence state of a hybrid model's config.json, None for a model without state layers."""
    reader = READERS.get(str((config.get("architectures") or [""])[0]))
    return reader(config) if reader else None


def state_page_bytes(state: RecurrentState, tp: int, drafts: int = 0) -> int:
    """One layer's state of one sequence on each of `tp` GPUs: the convolution window in the model's
    16-bit dtype whatever the KV cache's (Mamba-2's groups made `tp` where `tp` does not divide them,
    vLLM's extra_groups_for_head_shards, so every GPU holds one), a row more for each of `drafts`
    speculative tokens, and the recurrent state."""
    groups = state.groups if state.groups % tp == 0 else tp
    conv = (state.conv_width + drafts) * (state.conv_channels + groups * state.conv_group_channels) // tp
    recurrent = state.heads // tp * state.head_values
    return conv * sizing.BYTES_PER_VALUE + recurrent * (FP32_BYTES if state.fp32_state else sizing.BYTES_PER_VALUE)


def attention_token_bytes(state: RecurrentState, tp: int, bytes_per_value: int) -> int:
    """One token's K and V in one attention layer on each of `tp` GPUs (a KV head on every GPU at least)."""
    return 2 * sizing.kv_heads_per_gpu(state.kv_heads, tp) * state.head_dim * bytes_per_value


def checkpoint_pages(state: RecurrentState, gpu: str) -> int:
    """The checkpoint page a sequence keeps per state group under prefix caching: Mamba-2's mixer
    always exports one, Gated DeltaNet where FlashInfer runs its prefill, Mamba (1) none."""
    return int(state.kind == "mamba2" or (state.kind == "gated_deltanet" and gpu in FLASHINFER_GDN_GPUS))


def block_alignment(state: RecurrentState, gpu: str) -> int:
    """What vLLM rounds a hybrid's block size to on `gpu`: the kernels' 16 tokens, or FlashInfer's
    Gated DeltaNet checkpoint grid under prefix caching."""
    if state.kind == "gated_deltanet" and gpu in FLASHINFER_GDN_GPUS:
        return math.lcm(KERNEL_BLOCK_ALIGNMENT, FLASHINFER_GDN_ALIGNMENT)
    return KERNEL_BLOCK_ALIGNMENT


def hybrid_block_size(token_bytes: int, page_bytes: int, block_size: int, alignment: int) -> int:
    """vLLM's attention block size beside state pages of `page_bytes` (Platform._align_hybrid_block_size):
    the fewest tokens, a multiple of `alignment` and of `block_size` (at least the kernels' 16), whose
    K and V of `token_bytes` per token fill a page that holds the state; `block_size` where larger."""
    step = math.lcm(max(KERNEL_BLOCK_ALIGNMENT, block_size), alignment)
    needed = step * math.ceil(page_bytes / (step * token_bytes))
    return max(block_size, KERNEL_BLOCK_ALIGNMENT * math.ceil(needed / KERNEL_BLOCK_ALIGNMENT))


class HybridKV(NamedTuple):
    """A hybrid model's KV cache on one replica as vLLM 0.33 allocates it."""

    block_size: int  # tokens per attention block, raised until a page holds a state
    state_bytes: int  # one layer's state of one sequence on one GPU
    page_bytes: int  # one layer's block on one GPU: the attention page, the state padded to it
    layout: sizing.KVLayout  # the replica's groups (its bytes over all of its GPUs)


class Serving(NamedTuple):
    """Where and how the hybrid is served: `tp` GPUs of type `gpu` (a catalog name), the block size
    the plan asks for, the bytes of one K or V value, the draft tokens each step verifies and the
    attention layers of the MTP modules drafting them (the model's K and V heads, grouped with its own)."""

    gpu: str
    tp: int = 1
    block_size: int = 16
    bytes_per_value: int = sizing.BYTES_PER_VALUE
    speculative_tokens: int = 0
    mtp_layers: int = 0


def hybrid_kv(state: RecurrentState, serving: Serving) -> HybridKV:
    """The block size, the state and page bytes, and the groups of `state`'s model served as `serving`
    says: the layers of each kind in groups of one size (sizing.group_size), each attention group
    holding a sequence's tokens, each state group ALIGN_MODE_PAGES pages, its checkpoint and a page
    per speculative token."""
    tp, drafts = serving.tp, serving.speculative_tokens
    state = state._replace(attention_layers=state.attention_layers + serving.mtp_layers)
    token = attention_token_bytes(state, tp, serving.bytes_per_value)
    page = state_page_bytes(state, tp, drafts)
    block = hybrid_block_size(token, page, serving.block_size, block_alignment(state, serving.gpu))
    size = sizing.group_size([state.attention_layers, state.layers])
    layout = sizing.KVLayout(
        group_bytes_per_token=size * token * tp,
        full_groups=math.ceil(state.attention_layers / size),
        sliding_groups=0,
        window=None,
        state_groups=math.ceil(state.layers / size),
        state_blocks=ALIGN_MODE_PAGES + checkpoint_pages(state, serving.gpu) + drafts,
    )
    return HybridKV(block_size=block, state_bytes=page, page_bytes=block * token, layout=layout)


def state_layers(state: RecurrentState) -> StateLayers:
    """`state` as an Architecture carries it (spec.model.architecture.state)."""
    return StateLayers(
        kind=state.kind,  # type: ignore[arg-type]
        layers=state.layers,
        attention_layers=state.attention_layers,
        conv_channels=state.conv_channels,
        conv_width=state.conv_width,
        groups=state.groups,
        group_channels=state.conv_group_channels,
        heads=state.heads,
        head_values=state.head_values,
        fp32_state=state.fp32_state,
    )


def architecture_state(arch: Architecture) -> RecurrentState | None:
    """The per-sequence state of `arch`'s hybrid layers (its attention's K and V heads beside them),
    None for a model without state layers."""
    layers = arch.state
    if layers is None:
        return None
    return RecurrentState(
        kind=layers.kind,
        layers=layers.layers,
        attention_layers=layers.attention_layers,
        conv_channels=layers.conv_channels,
        conv_width=layers.conv_width,
        groups=layers.groups,
        conv_group_channels=layers.group_channels,
        heads=layers.heads,
        head_values=layers.head_values,
        fp32_state=layers.fp32_state,
        kv_heads=arch.kv_heads,
        head_dim=arch.head_size,
    )


def sequence_state_bytes(state: RecurrentState, tp: int) -> int:
    """One sequence's state in every state layer over a replica's `tp` GPUs, unpadded: what a decode
    step reads and writes back for each running sequence."""
    return state.layers * state_page_bytes(state, tp) * tp
