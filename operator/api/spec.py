"""The InferenceService spec as pydantic models: the source of crds/inferenceservice.yaml.

The API server validates and defaults with the CRD's schema and CEL rules; these models repeat the
rules so that planning (and `kvpilot plan`) never sees a spec the cluster would have refused. The
CRD's schema is generated from them (operator/api/crd.py, `kvpilot crd`), so what it says beyond
types, bounds and defaults is declared here too: field descriptions, formats, CEL rules
(x-kubernetes-validations) and which sections the API server creates empty (`default: {}`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

Quantization = Literal["auto", "none", "int8", "fp8", "w8a8", "int4"]
# eagle: serving.draftModel is an EAGLE head (trained on the target's hidden states), pinned only.
Speculative = Literal["auto", "off", "ngram", "draft", "eagle", "mtp"]
# The KV cache's values: the model's 16-bit dtype, or one byte each (vLLM's --kv-cache-dtype fp8).
KvCacheDtype = Literal["auto", "model", "fp8"]
# What runs the model in the pods (operator/runtimes/ declares what each runs).
Runtime = Literal["kvpilot", "vllm"]
# How a checkpoint may already be quantized (model.quantization): compressed-tensors W8A16, FP8,
# W8A8 and W4A16 (int8, fp8, w8a8, int4), or AutoAWQ / GPTQ 4-bit files.
CheckpointQuantization = Literal["int8", "fp8", "w8a8", "int4", "awq", "gptq", "mxfp4"]

# The most replicas a service may ask for (spec.replicas, autoscaling.min/maxReplicas). A bound keeps
# every planner search and every rendered Deployment finite; a fleet beyond it is several services.
MAX_REPLICAS = 1000

# CEL has no bit operations, so the CRD lists the powers of two; this is the same list.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# A sparse-attention indexer's key is cached as FP8 values with a 4-byte scale per this many (vLLM 0.33's
# Indexer: quant_block_size).
INDEXER_SCALE_BLOCK = 128
# What vLLM 0.33's sparse MLA backends take (sizing reads them from here): blocks of a multiple of this
# many tokens (FlashAttention's and FlashMLA's), and under an FP8 KV cache FlashMLA's fp8_ds_mla layout
# of a latent (512 FP8 values, four fp32 scales, 64 16-bit rotary values) in this many bytes.
SPARSE_BLOCK_MULTIPLE = 64
FP8_DS_MLA_BYTES = 656

# What the CRD says beyond a field's type, bounds and default, as json_schema_extra (crd.py copies
# these keys into the schema as they are).
INT64 = {"format": "int64"}
# A section the API server creates when it is absent, then fills in from its fields' own defaults
# (as pydantic does); without it the section stays absent. crd.py never uses a section's pydantic
# default (a dump of the model) as the CRD's.
CREATED_EMPTY = {"default": {}}
# Kubernetes' IntOrString (a quantity, a surge): an integer or a string (crd.py spells it as a
# structural schema must).
INT_OR_STRING = {"x-kubernetes-int-or-string": True}


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """A model's CEL rules, (rule, message) each, as its json_schema_extra: what the schema cannot
    say (one field against another), checked by the API server as the model's validators do."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


def no_crd_default(schema: dict[str, Any]) -> None:
    """json_schema_extra of a field whose default is the operator's reading only: the CRD has none,
    so the API server stores nothing for it."""
    del schema["default"]


def bound_by_cel(schema: dict[str, Any]) -> None:
    """json_schema_extra of a field whose lower bound the CRD states as a CEL rule of its section (with
    a message naming the field) instead of in the schema."""
    del schema["exclusiveMinimum"]


# The kinds of state layers vLLM 0.33 keeps per sequence (planning/recurrent.py): Mamba (Jamba),
# Mamba-2 (Nemotron-H, Granite 4.0-H, Falcon-H1) and Gated DeltaNet (Qwen3-Next).
StateKind = Literal["mamba1", "mamba2", "gated_deltanet"]
# How a local layer holds its slidingWindow tokens, as vLLM 0.33 allocates them: a window sliding with
# each token (SlidingWindowSpec), or fixed chunks a token attends within (ChunkedLocalAttentionSpec).
SlidingKind = Literal["window", "chunk"]


class StateLayers(BaseModel):
    """Also the CRD's `spec.model.architecture.state`: a hybrid's layers that keep a state per sequence."""

    model_config = ConfigDict(
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=cel(("self.groups == 0 || self.groupChannels > 0", "groups needs groupChannels")),
    )

    kind: StateKind = Field(
        description="The state layers' mixer: mamba1 (Jamba), mamba2 (Nemotron-H, Granite 4.0-H, Falcon-H1) or "
        "gated_deltanet (Qwen3-Next's linear attention); it sets the block alignment and the checkpoint pages "
        "vLLM keeps per sequence under prefix caching."
    )
    layers: int = Field(gt=0, description="The layers that keep a state per sequence, whatever its length.")
    attention_layers: int = Field(
        gt=0,
        description="The full-attention layers beside them (the only ones with K and V per token; layers "
        "with neither, such as Nemotron-H's MLP-only layers, are in neither count; a layer with both, as "
        "each of Falcon-H1's, is in both).",
    )
    conv_channels: int = Field(
        gt=0, description="The short convolution's channels (Mamba's intermediate size, split over the GPUs)."
    )
    conv_width: int = Field(gt=0, description="The tokens the convolution keeps per sequence: its kernel less one.")
    groups: int = Field(
        default=0, ge=0, description="Mamba-2's B/C groups, each groupChannels wide in the convolution (0: none)."
    )
    group_channels: int = Field(default=0, ge=0, description="The convolution channels of one of Mamba-2's groups.")
    heads: int = Field(gt=0, description="The recurrent state's heads (split over the GPUs).")
    head_values: int = Field(gt=0, description="The values of one head's recurrent state.")
    fp32_state: bool = Field(
        default=False,
        description="The recurrent state is held in fp32 (Nemotron-H's default), else in the model's dtype.",
        json_schema_extra=no_crd_default,
    )

    @model_validator(mode="after")
    def _grouped(self) -> StateLayers:
        if self.groups and not self.group_channels:
            raise ValueError("groups needs groupChannels")
        return self


# config.json's architectures of an EAGLE-3 head, as vLLM 0.33 registers them (Eagle3LlamaForCausalLM).
EAGLE3_HEADS = frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"})


class FullAttentionShape(BaseModel):
    """Also the CRD's `spec.model.architecture.fullAttention`: the full-attention layers' K and V heads
    where they differ from the sliding-window layers' (Gemma 4)."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid")

    kv_heads: int = Field(
        gt=0, description="K/V heads of a full-attention layer (Gemma 4's num_global_key_value_heads)."
    )
    head_dim: int = Field(
        gt=0, description="The dimension of a full-attention layer's heads (Gemma 4's global_head_dim)."
    )


class SharedKV(BaseModel):
    """Also the CRD's `spec.model.architecture.sharedKv`: layers that attend over an earlier layer's K and
    V and keep none of their own (Gemma 4's last num_kv_shared_layers), by kind."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid")

    full_layers: int = Field(default=0, ge=0, description="Full-attention layers among them.")
    sliding_layers: int = Field(default=0, ge=0, description="Sliding-window layers among them.")


class SparseIndexer(BaseModel):
    """Also the CRD's `spec.model.architecture.indexer`: DeepSeek Sparse Attention's lightning indexer
    (DeepSeek V3.2, GLM-5), which picks the tokens each latent-attention layer attends to."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid")

    heads: int = Field(gt=0, description="The indexer's query heads (config.json's index_n_heads).")
    head_dim: int = Field(
        gt=0,
        multiple_of=INDEXER_SCALE_BLOCK,
        description=f"The dimension of its keys and queries (index_head_dim), a multiple of {INDEXER_SCALE_BLOCK}: "
        f"vLLM caches a key per token as that many FP8 values and a 4-byte scale per {INDEXER_SCALE_BLOCK}.",
    )
    top_k: int = Field(gt=0, description="The tokens each layer attends to at most (index_topk).")
    layers: int = Field(
        gt=0,
        description="The layers that run an indexer and cache its keys (index_topk_freq's: the others reuse an "
        "earlier layer's choice); at most layers.",
    )

    @property
    def key_bytes(self) -> int:
        """One token's key in one layer's indexer cache, as vLLM 0.33 stores it whatever the KV cache's dtype."""
        return self.head_dim + self.head_dim // INDEXER_SCALE_BLOCK * 4


class MtpModules(BaseModel):
    """Also the CRD's `spec.model.architecture.mtp`: the multi-token-prediction (MTP) modules a
    checkpoint stores past its decoder layers (DeepSeek V3/R1/V3.2, GLM-4.5/4.6/4.7, GLM-5, Qwen3-Next,
    Qwen3.5), with which vLLM drafts (speculative mtp): each a decoder layer of the model's (a full-attention
    one beside a hybrid's state layers), a projection of the token's embedding and the last hidden
    state (eh_proj, fc) and three norms; the embedding and the LM head are the model's own."""

    model_config = ConfigDict(
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=cel(
            (
                "(!has(self.activeParameters) || self.activeParameters <= self.parameters) && "
                "(!has(self.replicatedParameters) || self.replicatedParameters <= self.parameters)",
                "mtp.activeParameters and mtp.replicatedParameters are some of mtp.parameters",
            )
        ),
    )

    layers: int = Field(
        gt=0,
        description="The modules (config.json's num_nextn_predict_layers, Qwen3.5's mtp_num_hidden_layers).",
    )
    parameters: int = Field(gt=0, json_schema_extra=INT64, description="Their parameters, as vLLM builds them.")
    active_parameters: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="Of them, those one token computes with (fewer under experts); unset: all.",
    )
    replicated_parameters: int = Field(
        default=0,
        ge=0,
        json_schema_extra=INT64,
        description="Of them, those vLLM holds whole on every GPU (eh_proj, the norms, the router, the latent's "
        "down-projections, the indexer, a shared expert's gate).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> MtpModules:
        if max(self.active_parameters or 0, self.replicated_parameters) > self.parameters:
            raise ValueError("mtp.activeParameters and mtp.replicatedParameters are some of mtp.parameters")
        return self


class Architecture(BaseModel):
    """Also the CRD's `spec.model.architecture`, hence the camelCase aliases."""

    model_config = ConfigDict(
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=cel(
            ("self.attentionHeads % self.kvHeads == 0", "attentionHeads must be a multiple of kvHeads"),
            ("!has(self.slidingLayers) || has(self.slidingWindow)", "slidingLayers needs slidingWindow"),
            (
                "!has(self.slidingLayers) || self.slidingLayers <= self.layers",
                "slidingLayers must not exceed layers",
            ),
            (
                "!has(self.slidingKind) || self.slidingKind == 'window' || has(self.slidingWindow)",
                "slidingKind chunk needs slidingWindow",
            ),
            (
                "!has(self.latentDim) || !has(self.slidingWindow)",
                "latentDim (latent attention) and slidingWindow do not go together",
            ),
            (
                "!has(self.visionParameters) || self.visionParameters < self.parameters",
                "visionParameters must be fewer than parameters",
            ),
            (
                "!has(self.replicatedParameters) || self.replicatedParameters < self.parameters",
                "replicatedParameters must be fewer than parameters",
            ),
            (
                "!has(self.lookupParameters) || self.lookupParameters < self.parameters",
                "lookupParameters must be fewer than parameters",
            ),
            (
                "!has(self.state) || (self.state.layers <= self.layers && self.state.attentionLayers <= self.layers)",
                "state.layers and state.attentionLayers must not exceed layers",
            ),
            (
                "!has(self.state) || (!has(self.slidingWindow) && !has(self.latentDim))",
                "state goes with neither slidingWindow nor latentDim",
            ),
            (
                "!has(self.fullAttention) || has(self.slidingWindow)",
                "fullAttention (the full-attention layers' own K/V heads) needs slidingWindow",
            ),
            (
                "!has(self.fullAttention) || self.attentionHeads % self.fullAttention.kvHeads == 0",
                "attentionHeads must be a multiple of fullAttention.kvHeads",
            ),
            (
                "!has(self.indexer) || (has(self.latentDim) && self.indexer.layers <= self.layers)",
                "indexer (sparse attention) needs latentDim and at most layers indexed layers",
            ),
            (
                "!has(self.mtpBytes) || (has(self.checkpointBytes) && self.mtpBytes < self.checkpointBytes)",
                "mtpBytes must be fewer than checkpointBytes",
            ),
            (
                "!has(self.sharedKv) || (!has(self.state) && !has(self.latentDim))",
                "sharedKv goes with neither state nor latentDim",
            ),
            (
                "!has(self.sharedKv) || self.sharedKv.fullLayers + self.sharedKv.slidingLayers < self.layers",
                "sharedKv must leave a layer that keeps its own K and V",
            ),
        ),
    )

    layers: int = Field(gt=0, description="Decoder layers (config.json's num_hidden_layers).")
    hidden_size: int = Field(gt=0, description="The hidden dimension (config.json's hidden_size).")
    attention_heads: int = Field(gt=0, description="Query heads per layer (config.json's num_attention_heads).")
    kv_heads: int = Field(
        gt=0,
        description="Key/value heads per layer (config.json's num_key_value_heads; fewer than attentionHeads "
        "under GQA/MQA): the KV cache scales with them.",
    )
    head_dim: int | None = Field(
        default=None, gt=0, description="The dimension of one attention head; unset: hiddenSize / attentionHeads."
    )
    vocab_size: int = Field(gt=0, description="Tokens in the vocabulary (config.json's vocab_size).")
    parameters: int = Field(
        gt=0, json_schema_extra=INT64, description="All the model's parameters (every expert of a mixture of experts)."
    )
    active_parameters: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="The parameters one token passes through (a mixture of experts' active experts), which "
        "prefill and decode time are predicted from; unset: parameters.",
    )
    max_context: int = Field(
        gt=0,
        description="The longest context the model takes, in tokens (config.json's max_position_embeddings); "
        "serving.maxContextLength may not exceed it.",
    )
    # config.json's tie_word_embeddings: the LM head is the embedding (counted once in parameters).
    tie_word_embeddings: bool = Field(
        default=False,
        description="config.json's tie_word_embeddings (the LM head is the embedding); default false.",
        json_schema_extra=no_crd_default,
    )
    # The KV rule beyond full attention over K and V heads, as vLLM allocates the cache.
    sliding_window: int | None = Field(
        default=None,
        gt=0,
        description="Tokens a sliding-window layer attends to (Gemma 2/3, gpt-oss): vLLM keeps at most "
        "that many of a sequence's (plus the tokens in flight) for those layers.",
    )
    sliding_layers: int | None = Field(
        default=None,
        gt=0,
        description="How many of the layers attend within slidingWindow (the rest attend to the whole "
        "sequence); unset with slidingWindow: all of them.",
    )
    sliding_kind: SlidingKind = Field(
        default="window",
        description="How those layers attend within slidingWindow: window (default; each token to the "
        "slidingWindow tokens before it: Gemma 2/3, gpt-oss) or chunk (chunked local attention: each token to "
        "the tokens of its own slidingWindow-token chunk, which start at multiples of it: Llama 4's "
        "attention_chunk_size). vLLM keeps a window's last slidingWindow - 1 tokens and a block more, a "
        "chunk's whole slidingWindow, each with the tokens in flight; beside an EAGLE head it keeps every "
        "token of a chunked model's layers.",
        json_schema_extra=no_crd_default,
    )
    latent_dim: int | None = Field(
        default=None,
        gt=0,
        description="Multi-head latent attention (DeepSeek V2/V3, Kimi K2): the values one token caches per "
        "layer (kv_lora_rank + qk_rope_head_dim), in place of K and V heads, whole on every GPU.",
    )
    indexer: SparseIndexer | None = Field(
        default=None,
        description="DeepSeek Sparse Attention (DeepSeek V3.2, GLM-5): a lightning indexer beside the latent "
        "attention picks the topK tokens each layer attends to; vLLM caches its keys per token beside the latent, "
        f"whole on every GPU, takes blocks of a multiple of {SPARSE_BLOCK_MULTIPLE} tokens for its sparse kernels, "
        f"and on Hopper stores the latent as {FP8_DS_MLA_BYTES} bytes (fp8_ds_mla) under an FP8 KV cache.",
    )
    mtp: MtpModules | None = Field(
        default=None,
        description="The multi-token-prediction modules config.json describes (num_nextn_predict_layers), with "
        "which vLLM drafts under serving.speculative mtp when the checkpoint holds them (mtpBytes).",
    )
    full_attention: FullAttentionShape | None = Field(
        default=None,
        description="The full-attention layers' K/V heads and head dimension where they differ from the "
        "sliding-window layers' (Gemma 4: num_global_key_value_heads of global_head_dim); kvHeads and headDim "
        "are then the sliding-window layers'. vLLM gives each kind its own page and raises the smaller page's "
        "tokens per block until the pages are one size.",
    )
    shared_kv: SharedKV | None = Field(
        default=None,
        description="Layers that attend over an earlier layer's K and V and keep no KV cache of their own "
        "(Gemma 4's last num_kv_shared_layers), by kind: vLLM allocates nothing for them.",
    )
    vision_parameters: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="Of parameters, the vision tower's and its projector's (a multimodal checkpoint; Gemma 4 "
        "E2B's and E4B's audio tower's too): held in memory, off a text token's path.",
    )
    lookup_parameters: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="Of parameters, tables a token looks its rows up in beside the embedding (Gemma 4's per-layer "
        "embeddings): vLLM keeps them in 16 bits under online quantization, as it keeps the embedding, and a step "
        "multiplies none of them.",
    )
    replicated_parameters: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="Of parameters, those every GPU of a tensor-parallel group holds whole, as vLLM builds them "
        "(norms, the experts' routers, latent attention's down-projections; read from config.json); unset: "
        "none counted. K and V projections copied to GPUs that outnumber the KV heads are counted from kvHeads.",
    )
    state: StateLayers | None = Field(
        default=None,
        description="A hybrid's layers that keep a state per sequence (Mamba, Gated DeltaNet) beside its attention "
        "layers, read from config.json: vLLM 0.33 holds each state in a page of the KV pool and raises the "
        "attention block size until a page holds it.",
    )
    hf_architecture: str | None = Field(
        default=None,
        min_length=1,
        description="config.json's architectures[0] (read with it, or given), by which vLLM picks the model's "
        "code: an EAGLE-3 head (LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM) drafts from three of the target's "
        "layers' hidden states, which only some of vLLM's model classes give.",
    )
    checkpoint_bytes: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="The bytes of the checkpoint's weights as stored (its safetensors' total, read from the hub "
        "beside config.json): what a download writes, and what a runtime that holds a quantized checkpoint as "
        "stored (vLLM) holds, in place of the per-scheme arithmetic (less mtpBytes).",
    )
    mtp_bytes: int | None = Field(
        default=None,
        gt=0,
        json_schema_extra=INT64,
        description="Of checkpointBytes, the multi-token-prediction modules' (DeepSeek's and GLM's layers past "
        "num_hidden_layers, Qwen3-Next's mtp.*; summed from the safetensors headers of the files that hold them): "
        "downloaded, but not held by vLLM, which loads them only to draft with them.",
    )
    source: str = Field(
        default="",
        description="Where these numbers come from (a config.json's URL, say), quoted in the plan's model reason.",
        json_schema_extra=no_crd_default,
    )

    @model_validator(mode="after")
    def _consistent(self) -> Architecture:
        if self.attention_heads % self.kv_heads:
            raise ValueError(f"attentionHeads {self.attention_heads} is not a multiple of kvHeads {self.kv_heads}")
        if self.sliding_layers is not None and self.sliding_window is None:
            raise ValueError("slidingLayers needs slidingWindow")
        if self.sliding_layers is not None and self.sliding_layers > self.layers:
            raise ValueError(f"slidingLayers {self.sliding_layers} exceeds layers {self.layers}")
        if self.sliding_kind == "chunk" and self.sliding_window is None:
            raise ValueError("slidingKind chunk needs slidingWindow")
        if self.latent_dim is not None and self.sliding_window is not None:
            raise ValueError("latentDim (latent attention) and slidingWindow do not go together")
        if self.vision_parameters is not None and self.vision_parameters >= self.parameters:
            raise ValueError(f"visionParameters {self.vision_parameters:,} is not fewer than parameters")
        if self.replicated_parameters is not None and self.replicated_parameters >= self.parameters:
            raise ValueError(f"replicatedParameters {self.replicated_parameters:,} is not fewer than parameters")
        if self.lookup_parameters is not None and self.lookup_parameters >= self.parameters:
            raise ValueError(f"lookupParameters {self.lookup_parameters:,} is not fewer than parameters")
        if self.mtp_bytes is not None and (self.checkpoint_bytes is None or self.mtp_bytes >= self.checkpoint_bytes):
            raise ValueError(f"mtpBytes {self.mtp_bytes:,} must be fewer than checkpointBytes")
        # Not their sum: Falcon-H1 runs attention and a Mamba-2 mixer side by side in every layer.
        if self.state is not None and max(self.state.layers, self.state.attention_layers) > self.layers:
            raise ValueError(f"state.layers or state.attentionLayers exceeds layers {self.layers}")
        if self.state is not None and (self.sliding_window is not None or self.latent_dim is not None):
            raise ValueError("state (a hybrid's state layers) goes with neither slidingWindow nor latentDim")
        if self.full_attention is not None and self.sliding_window is None:
            raise ValueError("fullAttention (the full-attention layers' own K/V heads) needs slidingWindow")
        if self.full_attention is not None and self.attention_heads % self.full_attention.kv_heads:
            raise ValueError(
                f"attentionHeads {self.attention_heads} is not a multiple of fullAttention.kvHeads "
                f"{self.full_attention.kv_heads}"
            )
        if self.indexer is not None and (self.latent_dim is None or self.indexer.layers > self.layers):
            raise ValueError("indexer (sparse attention) needs latentDim and at most layers indexed layers")
        if self.shared_kv is not None and (self.state is not None or self.latent_dim is not None):
            raise ValueError("sharedKv goes with neither state nor latentDim")
        if self.shared_kv is not None and (
            self.shared_kv.full_layers > self.layers - self.windowed_layers
            or self.shared_kv.sliding_layers > self.windowed_layers
        ):
            raise ValueError("sharedKv names more layers of a kind than the model has")
        if self.shared_kv is not None and self.full_cache_layers + self.windowed_cache_layers < 1:
            raise ValueError("sharedKv must leave a layer that keeps its own K and V")
        return self

    @property
    def loaded_checkpoint_bytes(self) -> int | None:
        """The checkpoint's bytes vLLM loads to serve it: all but its multi-token-prediction modules'."""
        if self.checkpoint_bytes is None:
            return None
        return self.checkpoint_bytes - (self.mtp_bytes or 0)

    @property
    def chunked(self) -> bool:
        """Whether the local layers are chunked local attention (slidingKind chunk), not sliding windows."""
        return self.sliding_window is not None and self.sliding_kind == "chunk"

    @property
    def attention_layer_count(self) -> int:
        """The layers that attend over K and V per token: all but a hybrid's state layers."""
        return self.state.attention_layers if self.state is not None else self.layers

    @property
    def windowed_layers(self) -> int:
        """The layers that keep only the sliding window (or the chunk) of a sequence."""
        if self.sliding_window is None:
            return 0
        return self.sliding_layers if self.sliding_layers is not None else self.layers

    @property
    def full_cache_layers(self) -> int:
        """The full-attention layers that keep K and V of every token (not a state layer's, not one that
        reads another layer's)."""
        shared = self.shared_kv.full_layers if self.shared_kv is not None else 0
        return self.attention_layer_count - self.windowed_layers - shared

    @property
    def windowed_cache_layers(self) -> int:
        """The windowed layers that keep K and V of their own."""
        return self.windowed_layers - (self.shared_kv.sliding_layers if self.shared_kv is not None else 0)

    @property
    def full_kv_shape(self) -> tuple[int, int]:
        """A full-attention layer's K/V heads and head dimension."""
        if self.full_attention is not None:
            return self.full_attention.kv_heads, self.full_attention.head_dim
        return self.kv_heads, self.head_size

    @property
    def eagle3_head(self) -> bool:
        """An EAGLE-3 head: its LM head is over its own draft vocabulary, not vocabSize."""
        return self.hf_architecture in EAGLE3_HEADS

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.attention_heads

    @property
    def parameters_per_token(self) -> int:
        return self.active_parameters if self.active_parameters is not None else self.parameters


class _Camel(BaseModel):
    # extra="ignore": objects written by a newer CRD version must still plan with this operator.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


# Where a model's files come from (the CRD's CEL rule on model.source has the same expression):
# hf://org/repo[@revision] (downloaded by an init container), pvc://claim[/path], or an absolute path
# in the engine image. Repository names as the hub allows them; a revision is a branch, tag or commit.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[^@ ]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|/.*)$"
)
# A Kubernetes object name that can name a Service (DNS-1035 label) and a namespace (DNS-1123 label).
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# accelerator.type of a CPU node pool, planned from a measured device profile.
CPU_TYPE = "cpu"
HF_SCHEME = "hf://"
PVC_SCHEME = "pvc://"


class HubSource(NamedTuple):
    repo: str
    revision: str


def check_source(field: str, source: str | None) -> None:
    """Raise ValueError naming `field` and the accepted forms unless `source` is unset or one."""
    if source is not None and not re.fullmatch(SOURCE_PATTERN, source):
        raise ValueError(
            f"{field} {source!r} must be hf://org/repo[@revision], pvc://claim/path or an "
            "absolute path in the engine image"
        )


def hub_source(source: str | None) -> HubSource | None:
    """hf://org/repo[@revision] as (repo, revision); None for other sources."""
    if source is None or not source.startswith(HF_SCHEME):
        return None
    repo, _, revision = source.removeprefix(HF_SCHEME).partition("@")
    return HubSource(repo, revision or "main")


class SecretKeyRef(_Camel):
    name: str = Field(min_length=1, description="The Secret's name, in the InferenceService's namespace.")
    key: str = Field(default="token", min_length=1, description="The key in the Secret that holds the token.")


class ModelCacheSpec(_Camel):
    # A PersistentVolumeClaim to download into, shared by restarts and replicas (ReadWriteMany for
    # replicas on several nodes); unset: an emptyDir, so every new pod downloads again.
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        description="A PersistentVolumeClaim kept across restarts and shared by replicas "
        "(ReadWriteMany when they run on several nodes).",
    )


class ModelSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                f"!has(self.source) || self.source.matches('{SOURCE_PATTERN}')",
                "model.source must be hf://org/repo[@revision], pvc://claim/path or an absolute path in the "
                "engine image",
            )
        )
    )

    name: str = Field(
        min_length=1,
        description="Catalog model (e.g. llama-2-7b), or any name when architecture is given or source is an "
        "hf:// repository (the operator reads its config.json).",
    )
    # Unset: both runtimes load only files (ours carries its embedded model besides), so the pod gets
    # the Hub repository `name` stands for (planning/sources.py). See SOURCE_PATTERN.
    source: str | None = Field(
        default=None,
        description="Where the weights are: hf://org/repo[@revision] (an init container downloads it into "
        "model.cache before the engine starts), pvc://claim/path (mounted read-only), or an absolute path "
        "in the engine image. Unset: the pod downloads hf://<model.name> when model.name is a repository "
        "(org/repo), else the catalog model's repository, and is Ready=False (ModelSourceRequired) for any "
        "other name; runtime kvpilot loads its embedded model (SmolLM2-135M-Instruct) by name.",
    )
    # For every hf:// source of the service (this one and serving.draftModel): the Secret key holding
    # a hub token (HF_TOKEN of the downloads), for gated or private repositories; and the volume the
    # downloads go to.
    token_secret: SecretKeyRef | None = Field(
        default=None,
        description="The Secret key with a Hugging Face token (HF_TOKEN of the downloads of model.source and "
        "serving.draftModel), for gated or private repositories.",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description="Where the hf:// downloads (model.source and serving.draftModel) go. Unset, an emptyDir "
        "(every new pod downloads again).",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The model name clients send (the OpenAI API's `model`) and the engines answer to; unset: "
        "model.name.",
    )
    architecture: Architecture | None = Field(
        default=None, description="Overrides the catalog; needed for models the catalog lacks."
    )
    # The scheme the checkpoint is already quantized in (a compressed-tensors checkpoint, e.g.
    # written by `kvpilot quantize` or llm-compressor; AWQ or GPTQ files): the runtime serves it as
    # stored and refuses another --quantization, so the plan takes it as the scheme. Which of these
    # a runtime reads is in its capabilities (runtimes.py).
    quantization: CheckpointQuantization | None = Field(
        default=None,
        description="The scheme the checkpoint is already quantized in (compressed-tensors W8A16, FP8, W8A8 or "
        "W4A16; AWQ or GPTQ 4-bit; MXFP4); the plan serves it as stored.",
    )

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        check_source("model.source", self.source)
        return self


HUB_SETTINGS = (
    "model.tokenSecret and model.cache apply only to hf:// sources (model.source, serving.draftModel or adapters; "
    "without model.source the operator downloads the repository model.name stands for)"
)
# The most adapters one service lists (a bound for CEL's cost estimate and for the engines' CPU
# cache of adapters, max_cpu_loras, which holds them all).
MAX_ADAPTERS = 64
# The largest LoRA rank a runtime takes (vLLM 0.33's largest max_lora_rank).
MAX_ADAPTER_RANK = 512
# An adapter name is a model name clients send; DNS-ish, so that it can also name Kubernetes things.
ADAPTER_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
ADAPTER_IS_NOT_THE_MODEL = (
    "adapters[].name must differ from the served model name (model.servedModelName or model.name)"
)


class AdapterSpec(_Camel):
    """A LoRA adapter of the base model, served under its own model name beside the base model."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                f"self.source.matches('{SOURCE_PATTERN}')",
                "adapters[].source must be hf://org/repo[@revision], pvc://claim/path or an absolute path in the "
                "engine image",
            )
        )
    )

    name: str = Field(
        max_length=63,
        pattern=ADAPTER_NAME,
        description="The model name clients send (the OpenAI API's `model`) for this adapter, listed by /v1/models "
        "beside the base model.",
    )
    source: str = Field(
        max_length=512,
        description="Where the adapter's files (PEFT's adapter_config.json and safetensors) are: "
        "hf://org/repo[@revision] (with model.tokenSecret for gated repositories), pvc://claim/path, or an absolute "
        "path in the engine image.",
    )
    # The adapter's own rank (adapter_config.json's r): any PEFT rank; the runtime's max_lora_rank is
    # the smallest it accepts at or above the largest of them.
    rank: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ADAPTER_RANK,
        description="The adapter's LoRA rank (adapter_config.json's r), which the engines' adapter slots are sized "
        "for; unset: counted as rank 16 (an adapter above the plan's max_lora_rank is refused when it is loaded).",
    )

    @model_validator(mode="after")
    def _source(self) -> AdapterSpec:
        check_source("adapters[].source", self.source)
        return self


# The most GPU types one service spreads over (a bound for CEL's cost estimate too).
MAX_VARIANTS = 8
VARIANTS_REPLACE = "accelerator.variants replaces type, count and nodeSelector: each variant names its GPU type"
VARIANTS_UNIQUE = (
    "accelerator.variants: each (type, capacityClass) once: a GPU type appears once per capacity class, and once "
    "without one"
)
# A capacity class's name (the chart's capacityClasses): a label value's suffix of its variant's pods
# (names.variant), so short enough that `<gpu type>-<class>` stays a label value.
MAX_CLASS_NAME = 40
VARIANT_IS_A_GPU = "accelerator.variants[].type: a GPU type (a CPU node pool is accelerator.type cpu)"
# A variant of this type stands for every GPU type the nodes carry that no other variant (of its
# capacity class) names: a pool over whatever the cluster has, opted into (an unset accelerator
# still means the one cheapest type, as it always did).
ANY_GPU = "*"


class GPUVariantSpec(_Camel):
    """One GPU type of a service spread over several (a mixed pool): the planner makes it a plan and a
    Deployment of its own."""

    model_config = ConfigDict(json_schema_extra=cel(("self.type != 'cpu'", VARIANT_IS_A_GPU)))

    type: str = Field(
        min_length=1,
        max_length=63,
        description="GPU catalog name (as accelerator.type), or * for every GPU type the nodes carry that no other "
        "variant of its capacity class names (each a variant of its own, with this entry's bounds).",
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="The most replicas of this type (the GPUs of it the service may take; with type *: of each "
        "type); unset: autoscaling.maxReplicas.",
    )
    count: int | None = Field(
        default=None, ge=1, description="GPUs per replica of this type; unset means the planner picks it."
    )
    # Spot and on-demand nodes of one type as two variants: the cluster admin names the classes once
    # (the chart's capacityClasses: their node labels and prices); a spec only names one.
    capacity_class: str | None = Field(
        default=None,
        max_length=MAX_CLASS_NAME,
        pattern=DNS_1123_LABEL,
        description="A capacity class of the operator (the chart's capacityClasses, e.g. spot or on-demand): this "
        "variant's pods go only to the nodes with the class's labels, and cost the class's price for the type. "
        "Unset: any node of the type, at the type's price.",
    )

    @model_validator(mode="after")
    def _a_gpu(self) -> GPUVariantSpec:
        if self.type == CPU_TYPE:
            raise ValueError(VARIANT_IS_A_GPU)
        return self


class AcceleratorSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.nodeSelector) || size(self.nodeSelector) == 0 || has(self.type)",
                "accelerator.nodeSelector needs accelerator.type: the planner sizes for a known GPU",
            ),
            (
                "!has(self.variants) || size(self.variants) == 0 || (!has(self.type) && !has(self.count))",
                VARIANTS_REPLACE,
            ),
            (
                "!has(self.variants) || self.variants.all(v, self.variants.exists_one(w, w.type == v.type && "
                "(has(w.capacityClass) ? w.capacityClass : '') == (has(v.capacityClass) ? v.capacityClass : '')))",
                VARIANTS_UNIQUE,
            ),
            (
                "(has(self.type) && self.type == 'cpu') == has(self.profile)",
                "accelerator.type cpu needs accelerator.profile (the CPU's device profile), and only it takes one",
            ),
            (
                "!(has(self.type) && self.type == 'cpu') || !has(self.count) || self.count == 1",
                "accelerator.count: a CPU replica is one engine process (count 1)",
            ),
        )
    )

    type: str | None = Field(
        default=None,
        description="GPU catalog name (T4, L4, A10G, L40S, A100-40GB, A100-80GB, H100-80GB, H200, B200, MI300X), "
        "or cpu for a CPU node pool planned from accelerator.profile; unset picks from the nodes' GPU product "
        "labels.",
    )
    # GPUs per replica (the tensor-parallel size); unset: the planner picks the smallest that fits
    # and meets the SLO among the runtime's sizes (1 for kvpilot).
    count: int | None = Field(
        default=None, ge=1, description="GPUs per replica (tensor-parallel size); unset means the planner picks it."
    )
    # Where the GPU nodes are, when they are not found by the GPU product label (GKE's
    # cloud.google.com/gke-accelerator, Karpenter's instance labels): replaces that selector.
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Where the GPU nodes are when they do not carry the GPU product label (e.g. GKE's "
        "cloud.google.com/gke-accelerator, Karpenter's labels); replaces the product-label selector. Needs type.",
    )
    # type cpu: the device profile to plan from (`kvpilot profile`'s output): a built-in CPU family
    # or a profile ConfigMap of that name in the operator's namespace (planning/cpus.py).
    profile: str | None = Field(
        default=None,
        max_length=63,
        pattern=DNS_1123_LABEL,
        description="type cpu: the device profile (kvpilot profile's output) to plan from: a built-in CPU "
        "family, or a ConfigMap of this name in the operator's namespace holding profile.json.",
    )

    # A mixed pool: the GPU types one service runs on, each with its own plan and Deployment; the
    # load goes to the cheapest per request per second first (planning/variants.py).
    variants: list[GPUVariantSpec] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description="A mixed GPU pool: the GPU types the service may run on, each planned and rolled out as a "
        "Deployment of its own; replicas go to the type with the lowest cost per request per second first "
        "(the operator's GPU prices), up to its maxReplicas. Replaces type and count.",
    )

    @model_validator(mode="after")
    def _selector_needs_type(self) -> AcceleratorSpec:
        if self.variants and (self.type is not None or self.count is not None):
            raise ValueError(VARIANTS_REPLACE)
        if len({(v.type, v.capacity_class) for v in self.variants}) < len(self.variants):
            raise ValueError(VARIANTS_UNIQUE)
        if self.node_selector and not self.type:
            raise ValueError("accelerator.nodeSelector needs accelerator.type: the planner sizes for a known GPU")
        cpu = self.type == CPU_TYPE
        if cpu != (self.profile is not None):
            raise ValueError(
                "accelerator.type cpu needs accelerator.profile (the CPU's device profile), and only it takes one"
            )
        if cpu and self.count not in (None, 1):
            raise ValueError("accelerator.count: a CPU replica is one engine process (count 1)")
        return self


class ServingSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                f"!has(self.blockSize) || self.blockSize in [{', '.join(map(str, BLOCK_SIZES))}]",
                "blockSize must be a power of two up to 1024",
            ),
            (
                "!has(self.speculative) || !(self.speculative in ['draft', 'eagle']) "
                "|| (has(self.draftModel) && self.draftModel != '')",
                "speculative 'draft' or 'eagle' needs draftModel",
            ),
            (
                f"!has(self.draftModel) || self.draftModel.matches('{SOURCE_PATTERN}')",
                "serving.draftModel must be hf://org/repo[@revision], pvc://claim/path or an absolute path in "
                "the engine image",
            ),
            (
                "!has(self.draftModelArchitecture) || has(self.draftModel)",
                "serving.draftModelArchitecture needs serving.draftModel",
            ),
        )
    )

    max_context_length: int | None = Field(
        default=None,
        gt=0,
        description="The longest sequence (prompt and output, in tokens) the engines accept (max_model_len); "
        "unset: the model's maximum context. At most the model's maximum.",
    )
    quantization: Quantization = Field(
        default="auto",
        description="The weights' quantization scheme the runtime applies on load (none, int8, fp8, w8a8, int4); "
        "auto: the least lossy scheme the runtime runs that fits and meets the SLO. A quantized checkpoint "
        "(model.quantization) is served as stored.",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        default="auto",
        description="The KV cache's values: 'model' (the model's 16-bit dtype), 'fp8' (one byte each: twice the "
        "tokens, on GPUs with FP8 and a runtime that stores it), or 'auto': fp8 only where the 16-bit cache "
        "leaves a context or the batch short or misses the SLO.",
    )
    speculative: Speculative = Field(
        default="auto",
        description="Speculative decoding: off, ngram (drafts looked up in the prompt), draft (serving.draftModel "
        "proposes), eagle (serving.draftModel is an EAGLE head; only when set here), mtp (the checkpoint's own "
        "multi-token-prediction modules, model.architecture.mtp: DeepSeek V3/R1/V3.2, GLM-4.5/4.6/4.7, GLM-5, on vLLM; "
        "only when set here); auto: draft or ngram "
        "where the predicted batch is small, load.temperature low and TPOT nearer its SLO than TTFT, else off.",
    )
    # Where the draft model's files are, in the forms of model.source; the engine loads it beside
    # the target (unquantized, its KV cache slot for slot with the target's). Its size comes from the
    # catalog (by the repository or folder name) or from draftModelArchitecture.
    draft_model: str | None = Field(
        default=None,
        description="The draft model of speculative 'draft' (also chosen by 'auto'), with the target's "
        "vocabulary: hf://org/repo[@revision] (downloaded like model.source, with model.tokenSecret into "
        "model.cache), pvc://claim/path, or an absolute path in the engine image. The engine runs it "
        "unquantized beside the target.",
    )
    draft_model_architecture: Architecture | None = Field(
        default=None,
        description="The draft model's architecture, as model.architecture; needed for drafts the catalog lacks "
        "(found by the repository or folder name of draftModel).",
    )
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=16, description="Draft tokens proposed per decode step while the engines speculate."
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="The share of a GPU's memory (as CUDA reports it) the engine fills: weights, runtime reserve "
        "and the KV pool, which takes the rest (vLLM's --gpu-memory-utilization).",
    )
    block_size: int = Field(
        default=16,
        description="Tokens per KV cache block, a power of two up to 1024; a runtime runs only the sizes it "
        "declares (vllm: 16, 32, 64).",
    )

    @model_validator(mode="after")
    def _rules(self) -> ServingSpec:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"blockSize {self.block_size} is not a power of two up to 1024")
        if self.speculative in ("draft", "eagle") and not self.draft_model:
            raise ValueError(f"speculative {self.speculative!r} needs serving.draftModel")
        check_source("serving.draftModel", self.draft_model)
        if self.draft_model_architecture and not self.draft_model:
            raise ValueError("serving.draftModelArchitecture needs serving.draftModel")
        return self


class SLOSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            ("!has(self.ttftP95Ms) || self.ttftP95Ms > 0.0", "ttftP95Ms must be positive"),
            ("!has(self.tpotP95Ms) || self.tpotP95Ms > 0.0", "tpotP95Ms must be positive"),
        )
    )

    ttft_p95_ms: float = Field(
        default=2000,
        gt=0,
        description="The p95 time to first token to meet, in ms: the plan sizes replicas for it and the slo "
        "autoscaler scales on it.",
        json_schema_extra=bound_by_cel,
    )
    tpot_p95_ms: float = Field(
        default=100,
        gt=0,
        description="The p95 time per output token after the first to meet, in ms: the plan sizes replicas and "
        "batching for it and the slo autoscaler scales on it.",
        json_schema_extra=bound_by_cel,
    )


class LoadSpec(_Camel):
    requests_per_second: float = Field(
        default=1, ge=0, description="The expected request rate of the whole service, in req/s."
    )
    mean_prompt_tokens: int = Field(default=512, gt=0, description="The mean prompt length of a request, in tokens.")
    mean_output_tokens: int = Field(default=256, gt=0, description="The mean number of tokens a request generates.")
    # The engines report the observed share (prefix cache hits / queries), shown beside this in
    # status.planAccuracy.
    prefix_share: float = Field(
        default=0,
        ge=0,
        le=0.99,
        description="The share of a prompt's tokens the engines' prefix cache serves (a system prompt or few-shot "
        "examples every request repeats): the plan's prefill computes only the rest.",
    )
    temperature: float = Field(
        default=0.7,
        ge=0,
        description="The traffic's typical sampling temperature: serving.speculative auto speculates only below "
        "1, since drafts are rarely accepted at high temperature.",
    )


class AutoscalingSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                "minReplicas must be <= maxReplicas",
            )
        )
    )

    # slo: the operator sets replicas from the engines' metrics (operator/autoscaling/);
    # external: an HPA or KEDA does and the operator never writes replicas; off: nobody does.
    mode: Literal["slo", "external", "off"] = Field(
        default="slo",
        description="slo: the operator sets replicas from the engines' TTFT/TPOT, queue and KV usage; external: "
        "an HPA or KEDA sets them and the operator never writes replicas; off: nobody does.",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="The fewest replicas the slo autoscaler keeps; 0 lets it scale an idle service to zero "
        "(the gateway wakes it).",
    )
    max_replicas: int = Field(
        default=4,
        ge=1,
        le=MAX_REPLICAS,
        description=f"At most {MAX_REPLICAS}; a larger fleet is several InferenceServices.",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, description="Seconds the signals must stay over the band before a scale-up."
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        description="Seconds under the band before a scale-down, which goes to the most replicas any period of "
        "that window needed; to zero, at least the plan's predicted time to ready.",
    )
    # Replicas added or removed by one decision, at most.
    max_step: int = Field(default=2, ge=1, description="Replicas added or removed by one decision at most.")
    # Signals within 1 +- tolerance of their targets move nothing (noise).
    tolerance: float = Field(
        default=0.1, ge=0, le=0.5, description="Signals within 1 +- tolerance of their targets move nothing."
    )
    max_waiting_per_replica: float = Field(
        default=4,
        gt=0,
        description="Target of waiting requests per replica (the engines' queues and the requests the gateways "
        "hold), one of the signals the autoscaler scales on.",
    )
    target_kv_cache_usage: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Target share of the engines' KV cache in use, one of the signals the autoscaler scales on.",
    )
    # Read the engines' series from this Prometheus (labels namespace and pod, as a ServiceMonitor
    # gives them) instead of each pod's /metrics: for clusters where the operator cannot reach pods.
    prometheus_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Read the engines' series from this Prometheus (labels namespace and pod, as a ServiceMonitor "
        "gives them) instead of each pod's /metrics.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        return self


class ResourcesSpec(_Camel):
    requests: dict[str, Annotated[str | int, Field(json_schema_extra=INT_OR_STRING)]] = Field(
        default_factory=dict,
        description="The engine container's requests (Kubernetes quantities by resource name), over the "
        "operator's (CPU, memory for the weights, disk for downloads); the GPUs are the plan's.",
    )
    limits: dict[str, Annotated[str | int, Field(json_schema_extra=INT_OR_STRING)]] = Field(
        default_factory=dict,
        description="The engine container's limits (Kubernetes quantities by resource name); the plan's GPUs are "
        "added.",
    )


class Toleration(_Camel):
    key: str | None = Field(default=None, description="The taint key tolerated; unset with Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Equal (the taint's value must equal value) or Exists (any value)."
    )
    value: str | None = Field(default=None, description="The taint value Equal matches.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect tolerated; unset: every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        json_schema_extra=INT64,
        description="For NoExecute: seconds the pod stays bound after the taint appears; unset: for ever.",
    )


class RolloutSpec(_Camel):
    max_surge: int | str = Field(
        default=1,
        description="The Deployment's rollingUpdate.maxSurge: pods started above the desired replicas during an "
        "update (a number or a percentage).",
        json_schema_extra=INT_OR_STRING,
    )
    max_unavailable: int | str = Field(
        default=0,
        description="The Deployment's rollingUpdate.maxUnavailable: desired pods that may be missing during an "
        "update (a number or a percentage).",
        json_schema_extra=INT_OR_STRING,
    )
    # The most a stopping engine waits for its requests in flight (the drain is sized for the
    # longest request it accepts, which for long contexts can be far longer than anyone waits).
    max_drain_seconds: int = Field(
        default=600,
        ge=0,
        le=3600,
        description="The most a stopping engine (a scale-down, a rollout) waits for its requests in flight. The "
        "drain is sized for the longest request the engine accepts (a first token, then max_model_len tokens "
        "at the predicted TPOT); this caps it.",
    )


class RoutingSpec(_Camel):
    # How the gateway picks an engine: the least loaded, or the one a hash of the prompt's
    # beginning names (consistent hashing with bounded loads: shared prefixes hit one KV cache).
    strategy: Literal["LeastLoad", "PrefixHash"] = Field(
        default="LeastLoad",
        description="LeastLoad: the engine with the fewest requests in flight. PrefixHash: the engine a hash of "
        "the prompt's beginning names (consistent hashing with bounded loads), so requests sharing a prefix "
        "reuse its KV cache.",
    )


class EndpointPickerSpec(_Camel):
    # A Service in the InferenceService's namespace; unset: `<name>-epp`, the name the extension's
    # inferencepool chart gives its picker when installed under the InferenceService's name.
    name: str | None = Field(
        default=None,
        max_length=63,
        pattern=DNS_1035_LABEL,
        description="Unset, <name>-epp (what the extension's inferencepool chart names its picker).",
    )
    port: int = Field(default=9002, ge=1, le=65535, description="The port of the endpoint picker's Service.")
    # What the Gateway does while the picker does not answer: refuse the request, or route it anyway.
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="While the picker does not answer, the Gateway refuses requests (FailClose) or routes them anyway.",
    )


class InferencePoolSpec(_Camel):
    enabled: bool = Field(
        default=False,
        description="Render an InferencePool (Gateway API Inference Extension) of the engine pods, for a Gateway "
        "and an endpoint picker (llm-d's, the extension's) to route to them.",
    )
    endpoint_picker: EndpointPickerSpec = Field(
        default=EndpointPickerSpec(),
        description="The endpoint picker's Service, in the InferenceService's namespace.",
        json_schema_extra=CREATED_EMPTY,
    )


class AuthSpec(_Camel):
    # The operator creates the Secret `<name>-api-key` (key `api-key`) with a random key, the
    # engines require it as `Authorization: Bearer <key>` on /v1, and the gateway checks it before
    # it reads a body or wakes the service. False: open to whoever reaches it.
    api_key: bool = Field(
        default=True,
        description="The operator creates the Secret <name>-api-key (key api-key) with a random key; the engines "
        "require it as `Authorization: Bearer <key>` on /v1 and the gateway checks it before reading a body or "
        "waking the service. false: open.",
    )


class NetworkSpec(_Camel):
    # A NetworkPolicy: the engine port takes connections only from the gateway, the operator
    # (metrics) and pods in the namespaces listed (a Prometheus, clients that skip the gateway).
    policy: bool = Field(
        default=True,
        description="A NetworkPolicy: the engine port takes connections only from the gateway, the operator "
        "(metrics) and pods in allowedNamespaces.",
    )
    allowed_namespaces: list[Annotated[str, Field(max_length=63, pattern=DNS_1123_LABEL)]] = Field(
        default_factory=list,
        max_length=64,
        description="Namespaces whose pods may reach the engines directly (a Prometheus, clients that skip the "
        "gateway).",
    )


class ImagePullSecret(_Camel):
    name: str = Field(description="A Secret with registry credentials, in the InferenceService's namespace.")


class InferenceServiceSpec(_Camel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!(has(self.model.tokenSecret) || has(self.model.cache)) || !has(self.model.source) || "
                "self.model.source.startsWith('hf://') || "
                "(has(self.serving) && has(self.serving.draftModel) && "
                "self.serving.draftModel.startsWith('hf://')) || (has(self.adapters) && "
                "self.adapters.exists(a, a.source.startsWith('hf://')))",
                HUB_SETTINGS,
            ),
            (
                "!has(self.replicas) || !has(self.autoscaling) || !has(self.autoscaling.mode) || "
                "self.autoscaling.mode != 'slo' || !has(self.autoscaling.maxReplicas) || "
                "self.replicas <= self.autoscaling.maxReplicas",
                "replicas must be <= autoscaling.maxReplicas in autoscaling mode slo",
            ),
            (
                "!has(self.adapters) || self.adapters.all(a, a.name != (has(self.model.servedModelName) ? "
                "self.model.servedModelName : self.model.name))",
                ADAPTER_IS_NOT_THE_MODEL,
            ),
        )
    )

    model: ModelSpec = Field(
        description="The model to serve: its name, where its weights are, and its architecture where the catalog "
        "lacks it."
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters of the model, each served under its own name beside the base model; the plan "
        "sizes the engines' adapter slots (max_loras resident at max_lora_rank) and counts their memory.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    runtime: Runtime = Field(
        default="kvpilot",
        description="What runs the model in the pods - kvpilot (this project's engine, one accelerator) or vllm "
        "(vLLM's official image, tensor parallelism).",
    )
    accelerator: AcceleratorSpec = Field(
        default=AcceleratorSpec(),
        description="What a replica runs on: a GPU type and count, a CPU node pool, or several GPU types; what "
        "is unset the planner chooses.",
        json_schema_extra=CREATED_EMPTY,
    )
    serving: ServingSpec = Field(
        default=ServingSpec(),
        description="How the engines serve: context length, quantization, KV cache, speculative decoding and "
        "memory; auto leaves the choice to the planner.",
        json_schema_extra=CREATED_EMPTY,
    )
    slo: SLOSpec = Field(
        default=SLOSpec(),
        description="The p95 latencies the plan sizes replicas for and the slo autoscaler keeps.",
        json_schema_extra=CREATED_EMPTY,
    )
    load: LoadSpec = Field(
        default=LoadSpec(),
        description="The expected traffic the plan sizes replicas for.",
        json_schema_extra=CREATED_EMPTY,
    )
    autoscaling: AutoscalingSpec = Field(
        default=AutoscalingSpec(),
        description="Who sets replicas, and how the slo autoscaler moves them.",
        json_schema_extra=CREATED_EMPTY,
    )
    # Written by `kubectl scale` / the autoscaler through the scale subresource; when absent the
    # plan's replica count for the stated load is used.
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
        description="Set by kubectl scale or the autoscaler; unset means the plan's count.",
    )
    # Unset: the operator's default engine image (the chart's engine.image), so a cluster can
    # move every InferenceService that does not pin an image with one chart upgrade.
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Engine image; unset means the operator's default (the chart's engine.image).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="The pull policy of the engine pods' containers."
    )
    # No `default: {}`: an absent section stays absent in the stored object.
    resources: ResourcesSpec = Field(
        default=ResourcesSpec(),
        description="CPU and memory for the engine container; the GPU count comes from accelerator.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the engine pods require, beside the GPU's selector (which wins on a clash).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        description="The engine pods' tolerations; on NVIDIA GPUs the operator adds one for the nvidia.com/gpu "
        "NoSchedule taint.",
    )
    rollout: RolloutSpec = Field(
        default=RolloutSpec(),
        description="The engines' rolling update. The default surges one pod so a single-replica service keeps "
        "serving through an update; on GPU nodes with no spare GPU the surge pod stays Pending until one frees "
        "up: set maxSurge 0 and maxUnavailable 1 there, which replaces pods one at a time at the cost of "
        "capacity meanwhile.",
    )
    routing: RoutingSpec = Field(
        default=RoutingSpec(),
        description="How the gateway picks one of the service's engines for a request.",
        json_schema_extra=CREATED_EMPTY,
    )
    inference_pool: InferencePoolSpec = Field(
        default=InferencePoolSpec(),
        description="An InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) of the "
        "engine pods, for a Gateway and an endpoint picker (llm-d's, the extension's) to route to them. Needs "
        "the extension's CRDs.",
        json_schema_extra=CREATED_EMPTY,
    )
    auth: AuthSpec = Field(
        default=AuthSpec(), description="Whether the service requires an API key.", json_schema_extra=CREATED_EMPTY
    )
    network: NetworkSpec = Field(
        default=NetworkSpec(),
        description="Who may connect to the engines directly.",
        json_schema_extra=CREATED_EMPTY,
    )
    # Passed through to the engine pods as written (Kubernetes' own types, validated by the API server).
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra environment of the engine container (Kubernetes EnvVar objects), e.g. an API key from "
        "a Secret.",
    )
    env_from: list[dict[str, Any]] = Field(
        default_factory=list, description="Kubernetes EnvFromSource objects for the engine container."
    )
    image_pull_secrets: list[ImagePullSecret] = Field(
        default_factory=list, description="Secrets the engine pods pull their images with."
    )
    affinity: dict[str, Any] | None = Field(default=None, description="The engine pods' Kubernetes Affinity.")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, description="The engine pods' Kubernetes TopologySpreadConstraint objects."
    )
    priority_class_name: str | None = Field(default=None, description="The engine pods' PriorityClass.")
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels added to the engine pods (the operator's own labels win on a clash).",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations added to the engine pods (the operator's own, Prometheus's scrape annotations "
        "among them, win on a clash).",
    )

    @model_validator(mode="after")
    def _replicas_within_the_autoscaler_bounds(self) -> InferenceServiceSpec:
        # In slo mode the autoscaler owns replicas within [min, max]; more is a typo or a scale
        # that the next period would undo. In external and off modes someone else owns them.
        if (
            self.autoscaling.mode == "slo"
            and self.replicas is not None
            and self.replicas > self.autoscaling.max_replicas
        ):
            raise ValueError(
                f"replicas {self.replicas} > autoscaling.maxReplicas {self.autoscaling.max_replicas} "
                "(autoscaling.mode slo)"
            )
        return self

    @model_validator(mode="after")
    def _hub_settings_need_a_hub_source(self) -> InferenceServiceSpec:
        sources = (self.model.source, self.serving.draft_model, *(a.source for a in self.adapters))
        # Without model.source the operator downloads the repository model.name stands for (it
        # knows which, from its catalog; the API server does not), unless the image carries the model.
        defaulted = self.model.source is None
        if (self.model.token_secret or self.model.cache) and not defaulted and not any(hub_source(s) for s in sources):
            raise ValueError(HUB_SETTINGS)
        return self

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> InferenceServiceSpec:
        # Each adapter is a model name of its own: two of one name, or one named as the base model, would
        # make a request's `model` ambiguous (the API server refuses both too: a list map, and CEL).
        names = [a.name for a in self.adapters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"adapters: each name once ({', '.join(twice)} repeated)")
        if (self.model.served_model_name or self.model.name) in names:
            raise ValueError(ADAPTER_IS_NOT_THE_MODEL)
        return self
