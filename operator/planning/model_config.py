"""A model's Architecture read from its Hugging Face `config.json`, for the families whose KV cache
the planner sizes exactly as vLLM 0.33 allocates it: full attention over grouped (or multi-) query
heads, sliding-window layers beside full ones (Gemma 2/3, gpt-oss), multi-head latent attention
(DeepSeek V2/V3, Kimi K2) and DeepSeek Sparse Attention's indexer beside it (DeepSeek V3.2, GLM-5),
Llama 4's chunked local attention, Gemma 4's full-attention layers of their own K/V heads and layers
that read an earlier layer's K and V, dense or a mixture of experts (GLM-4.5's and MiniMax-M2's among
them), and the multimodal wrappers of Gemma 3 (a SigLIP tower), Gemma 4, LLaVA and LLaVA-NeXT over a
Llama (a CLIP tower), Mistral 3 (Pixtral's tower), Qwen2.5-VL, Qwen3-VL, Qwen3.5 (over a hybrid) and
Llama 4 (their own towers).

The parameters are counted from the config the way the model's modules hold them (embedding, each
layer's attention, MLP or experts and norms, the final norm, an untied LM head, a vision tower), so
a checkpoint's weights are sized without reading its files;
tests/operator/planning/test_model_config.py checks the count against transformers' own modules
built from the same config. A window is what vLLM allocates, not what the config names: vLLM 0.33
reads a Llama-style model's windows from layer_types only (Mistral-7B-v0.1's sliding_window alone is
full attention there) and never gives Qwen layers a window. Llama 4's chunked layers
(ChunkedLocalAttentionSpec: the current chunk and the tokens in flight) are carried as local
layers of the chunk's size with slidingKind chunk, which the planner holds as vLLM does. A family
this module does not describe, or a feature of one that changes the KV rule (a vision tower it
does not count), is refused with the reason (`UnsupportedArchitecture`), never planned as if it
were plain attention. A hybrid with Mamba or linear-attention layers (Qwen3-Next, Nemotron-H,
Granite 4.0-H, Falcon-H1, Jamba) is read with its state layers (Architecture.state), whose
per-sequence pages planning/recurrent.py sizes as vLLM 0.33 allocates them; an option its
parameters are not counted with (biases vLLM does not build) is refused with its state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvpilot.operator.api.spec import (
    EAGLE3_HEADS,
    Architecture,
    CheckpointQuantization,
    FullAttentionShape,
    MtpModules,
    SharedKV,
    SparseIndexer,
)
from kvpilot.operator.planning.recurrent import (
    READERS,
    RecurrentState,
    Serving,
    hybrid_kv,
    recurrent_state,
    state_layers,
)


class Family(NamedTuple):
    """What one `architectures[0]` holds beside the common decoder layer."""

    tie_default: bool  # tie_word_embeddings when the config leaves it out (the config class's default)
    qkv_bias: bool = False  # q, k and v projections carry a bias whatever attention_bias says
    attention_bias: bool = False  # attention_bias when the config leaves it out
    output_bias: bool = True  # attention_bias biases o as well as q, k and v (not GLM-4.5's)
    output_bias_key: str | None = None  # the config key that biases o on its own (Seed-OSS's attention_out_bias)
    # q_norm and k_norm: "per_head" (one head's width, shared by the heads: Qwen3, Gemma 3) or
    # "per_layer" (all the heads' width: MiniMax-M2).
    head_norms: str | None = None
    head_norms_key: str | None = None  # the config key that turns them on (GLM-4.5's use_qk_norm); None: always
    # The MoE layout: "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek", "glm4_moe", "minimax_m2"
    # or "llama4".
    experts: str | None = None
    norms: int = 2  # per decoder layer (Gemma: around both attention and MLP)
    # Tokens vLLM's code adds to config.json's sliding_window (Cohere's layers see the window and the token).
    window_extra: int = 0
    # Where vLLM 0.33's modelling code takes its sliding windows from: "layer_types" (config.json's,
    # else every `pattern`-th layer full), "none" (never), "none_or_refused" (never, and it refuses
    # a model whose layers mix windows with full attention: Qwen2/3's use_sliding_window), or
    # "chunked" (Llama 4's attention_chunk_size in its rotary layers: _chunked_layer_types).
    windows: str = "layer_types"
    pattern: int | None = None  # config.sliding_window_pattern's default, where layer_types is derived
    # The config class derives layer_types only beside a window (EXAONE 4.0's divides by a pattern of 0).
    pattern_needs_window: bool = False
    latent: bool = False  # multi-head latent attention (kv_lora_rank, qk_rope_head_dim)
    sinks: bool = False  # a learned attention sink per head (gpt-oss)
    # The intermediate size of the dense MLP of a layer without experts (Llama 4's differs from its experts').
    dense_intermediate: str = "intermediate_size"
    # The config class's defaults of keys the count reads, where a config.json may leave them out.
    defaults: Mapping[str, Any] = {}


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(tie_default=False),
    "MistralForCausalLM": Family(tie_default=False),
    "Qwen2ForCausalLM": Family(tie_default=False, qkv_bias=True, windows="none_or_refused"),
    "Qwen3ForCausalLM": Family(tie_default=False, head_norms="per_head", windows="none_or_refused"),
    "Phi3ForCausalLM": Family(tie_default=False),
    # Llama's layers: SmolLM3 (its NoPE layers cache K and V all the same), Granite 3 (multipliers, no
    # parameters), both run by vLLM's Llama-style code or its Transformers backend.
    "SmolLM3ForCausalLM": Family(tie_default=True),
    "GraniteForCausalLM": Family(tie_default=False),
    # OLMo 2 and 3: norms after attention and the MLP, q and k normed over all the heads' width; OLMo 3's
    # every 4th layer full attention, the others within a 4096-token window.
    "Olmo2ForCausalLM": Family(tie_default=False, head_norms="per_layer", windows="none"),
    "Olmo3ForCausalLM": Family(tie_default=False, head_norms="per_layer", pattern=4, defaults={"sliding_window": 4096}),
    # Seed-OSS: biased q, k and v, o biased where attention_out_bias says, 128-value heads by default.
    "SeedOssForCausalLM": Family(
        tie_default=False,
        attention_bias=True,
        output_bias=False,
        output_bias_key="attention_out_bias",
        windows="none",
        defaults={"head_dim": 128},
    ),
    # Command R7B / Command A (Cohere2): attention and the MLP side by side after one norm, three of every
    # four layers within a window that vLLM widens by the token itself.
    "Cohere2ForCausalLM": Family(
        tie_default=True, norms=1, pattern=4, window_extra=1, defaults={"sliding_window": 4096}
    ),
    # EXAONE 4.0: norms after attention and the MLP, q and k normed per head; three of every four layers
    # within a 4096-token window (the last NoPE and full), or as layer_types says.
    "Exaone4ForCausalLM": Family(
        tie_default=False,
        head_norms="per_head",
        pattern=4,
        pattern_needs_window=True,
        defaults={"sliding_window": 4096},
    ),
    # GLM-4-0414 (dense): biased q, k and v, four norms per layer, 128-value heads unless it says otherwise.
    "Glm4ForCausalLM": Family(
        tie_default=False, attention_bias=True, output_bias=False, norms=4, windows="none", defaults={"head_dim": 128}
    ),
    "MixtralForCausalLM": Family(tie_default=False, experts="mixtral", windows="none"),
    "Qwen2MoeForCausalLM": Family(tie_default=False, qkv_bias=True, experts="qwen2_moe", windows="none"),
    "Qwen3MoeForCausalLM": Family(tie_default=False, head_norms="per_head", experts="qwen3_moe", windows="none"),
    "Gemma2ForCausalLM": Family(tie_default=True, norms=4, pattern=2),
    "Gemma3ForCausalLM": Family(tie_default=True, head_norms="per_head", norms=4, pattern=6),
    "GptOssForCausalLM": Family(tie_default=False, attention_bias=True, experts="gpt_oss", pattern=2, sinks=True),
    "DeepseekV2ForCausalLM": Family(tie_default=False, experts="deepseek", windows="none", latent=True),
    "DeepseekV3ForCausalLM": Family(tie_default=False, experts="deepseek", windows="none", latent=True),
    # DeepSeek Sparse Attention: V3's layers with a lightning indexer beside the latent (_indexer); GLM-5
    # is built by the same class in vLLM 0.33.
    "DeepseekV32ForCausalLM": Family(tie_default=False, experts="deepseek", windows="none", latent=True),
    "GlmMoeDsaForCausalLM": Family(tie_default=False, experts="deepseek", windows="none", latent=True),
    # GLM-4.5/4.6/4.7: DeepSeek's experts over grouped-query attention; the multi-token prediction
    # layer past num_hidden_layers is not built (vLLM serves it only as a speculative drafter).
    "Glm4MoeForCausalLM": Family(
        tie_default=False,
        output_bias=False,
        head_norms="per_head",
        head_norms_key="use_qk_norm",
        experts="glm4_moe",
        windows="none",
    ),
    # GLM-4.7-Flash: GLM-4.5's experts beside DeepSeek's latent attention.
    "Glm4MoeLiteForCausalLM": Family(tie_default=False, experts="glm4_moe", windows="none", latent=True),
    # Full attention with norms over all the heads' q and k, experts in every layer (a router and a
    # routing bias held in fp32 by vLLM); its multi-token prediction modules are not built.
    "MiniMaxM2ForCausalLM": Family(
        tie_default=False, output_bias=False, head_norms="per_layer", experts="minimax_m2", windows="none"
    ),
    # Chunked local attention in the layers with rotary positions, full attention in the others (NoPE).
    "Llama4ForCausalLM": Family(
        tie_default=False, experts="llama4", windows="chunked", dense_intermediate="intermediate_size_mlp"
    ),
    # Gemma 4: listed to be known, read by _gemma4 alone (its full-attention layers' own K/V heads,
    # layers that share an earlier layer's K and V, per-layer embeddings, experts beside the dense MLP).
    "Gemma4ForCausalLM": Family(tie_default=True),
}
GEMMA4 = "Gemma4ForCausalLM"


class Wrapper(NamedTuple):
    """A multimodal wrapper: its language model (text_config), the vision tower and projector beside it."""

    language_model: str  # the architecture text_config describes
    # The vision tower's layout: "siglip", "clip", "pixtral", "qwen2_5_vl", "qwen3_vl", "qwen3_5" or "llama4".
    tower: str
    # From the tower to the language model: "gemma3" (a norm and one matrix), "llava" (an MLP),
    # "llava_next" (an MLP and a newline token), "mistral3" (a patch merger and an MLP), "llama4"
    # (one matrix) or "none".
    projector: str
    # The text config class's defaults, which a wrapper's text_config leaves out where they hold (LLaVA's
    # lists only what differs from LlamaConfig's), and the model_type they are the defaults of.
    text_defaults: Mapping[str, Any] = {}
    # vLLM builds the towers from transformers' classes with every linear replicated (Gemma 4's), so
    # each GPU of a tensor-parallel group holds them whole; the others' towers it splits.
    replicated_tower: bool = False


# transformers' LlamaConfig defaults of the fields the count reads.
LLAMA_DEFAULTS = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "vocab_size": 32000,
}
WRAPPERS: dict[str, Wrapper] = {
    "Gemma3ForConditionalGeneration": Wrapper("Gemma3ForCausalLM", "siglip", "gemma3"),
    "Gemma4ForConditionalGeneration": Wrapper(GEMMA4, "gemma4", "gemma4", replicated_tower=True),
    "LlavaForConditionalGeneration": Wrapper("LlamaForCausalLM", "clip", "llava", LLAMA_DEFAULTS),
    "LlavaNextForConditionalGeneration": Wrapper("LlamaForCausalLM", "clip", "llava_next", LLAMA_DEFAULTS),
    "Mistral3ForConditionalGeneration": Wrapper("MistralForCausalLM", "pixtral", "mistral3", {"model_type": "mistral"}),
    # Its language model is Qwen2's (mrope's positions aside), in text_config or, as first published,
    # beside vision_config at the top level.
    "Qwen2_5_VLForConditionalGeneration": Wrapper("Qwen2ForCausalLM", "qwen2_5_vl", "none"),
    "Llama4ForConditionalGeneration": Wrapper("Llama4ForCausalLM", "llama4", "llama4"),
    # Qwen3-VL's language models are Qwen3's (mrope's positions aside); Qwen3.5's are hybrids of Gated
    # DeltaNet and gated attention (planning/recurrent.py), dense or with experts.
    "Qwen3VLForConditionalGeneration": Wrapper("Qwen3ForCausalLM", "qwen3_vl", "none"),
    "Qwen3VLMoeForConditionalGeneration": Wrapper("Qwen3MoeForCausalLM", "qwen3_vl", "none"),
    "Qwen3_5ForConditionalGeneration": Wrapper("Qwen3_5ForCausalLM", "qwen3_5", "none"),
    "Qwen3_5MoeForConditionalGeneration": Wrapper("Qwen3_5MoeForCausalLM", "qwen3_5", "none"),
}

# The architectures (of those read here) whose vLLM 0.33 class gives an EAGLE-3 head the hidden
# states it drafts from (SupportsEagle3; tests/operator/planning/test_eagle3.py checks the list against vLLM's).
EAGLE3_TARGETS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "SmolLM3ForCausalLM",
        "GraniteForCausalLM",
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
        "SeedOssForCausalLM",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Llama4ForCausalLM",
        "Gemma4ForCausalLM",
        "LlavaForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
    }
)

# quantization_config.quant_method -> the scheme a checkpoint stores (spec.model.quantization);
# compressed-tensors names its scheme in its config groups (_compressed_tensors_scheme).
CHECKPOINT_SCHEMES: dict[str, CheckpointQuantization] = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "mxfp4": "mxfp4"}
COMPRESSED_TENSORS = "compressed-tensors"


class ModelConfig(NamedTuple):
    architecture: Architecture
    quantization: CheckpointQuantization | None  # the scheme the checkpoint is stored in


class _Shape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json's {what} is {value!r}, not a positive integer")
    return value


def _int(config: Mapping[str, Any], key: str) -> int:
    return _positive(config.get(key), key)


def stored_scheme(config: Mapping[str, Any]) -> CheckpointQuantization | None:
    """The scheme the checkpoint stores its weights in (None: unquantized); ValueError saying why it
    cannot be sized."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors_scheme(quantization)
    if method not in CHECKPOINT_SCHEMES:
        known = ", ".join([*CHECKPOINT_SCHEMES, COMPRESSED_TENSORS])
        raise ValueError(f"a checkpoint quantized with {method!r} is not sized yet ({known} are)")
    return CHECKPOINT_SCHEMES[method]


def _compressed_tensors_scheme(quantization: Mapping[str, Any]) -> CheckpointQuantization:
    """The one scheme a compressed-tensors checkpoint's groups store: FP8 weights (with dynamic or
    static activations: vLLM's fp8), 8-bit integers with activations (w8a8) or without (int8), or
    4-bit integers without (int4, W4A16)."""
    schemes: set[CheckpointQuantization] = set()
    for group, spec in (quantization.get("config_groups") or {}).items():
        weights, activations = spec.get("weights") or {}, spec.get("input_activations")
        kind = (weights.get("type"), weights.get("num_bits"), activations is not None)
        if kind[:2] == ("float", 8):
            schemes.add("fp8")
        elif kind[:2] == ("int", 8):
            schemes.add("w8a8" if activations else "int8")
        elif kind == ("int", 4, False):
            schemes.add("int4")
        else:
            raise ValueError(
                f"compressed-tensors group {group!r} stores {kind[1]}-bit {kind[0]} weights"
                + (" and quantized activations" if activations else "")
                + ", which the planner does not size yet (fp8, w8a8, int8 and W4A16 it does)"
            )
    if len(schemes) != 1:
        listed = ", ".join(sorted(schemes))
        raise ValueError(f"compressed-tensors groups of {len(schemes) or 'no'} schemes ({listed}) are not sized yet")
    return schemes.pop()


# Llama 4's defaults (Llama4TextConfig) where its config.json leaves them out: the chunk its local
# layers attend within, and every how-many-th layer is a global (NoPE) one.
LLAMA4_CHUNK = 8192
LLAMA4_NOPE_INTERVAL = 4


def _layer_types(config: Mapping[str, Any], family: Family, layers: int) -> list[str]:
    """config.json's layer_types, else as the config class derives them (every `pattern`-th layer
    full; Qwen's use_sliding_window: the layers from max_window_layers on)."""
    if family.windows == "chunked":
        return _chunked_layer_types(config, layers)
    if config.get("layer_types"):
        return list(config["layer_types"])
    if family.pattern is not None:
        pattern = config.get("sliding_window_pattern") or family.pattern
        # transformers 5's config classes (vLLM 0.33's) derive no layers from EXAONE's "LLLG": vLLM could
        # not load such a config.
        if not isinstance(pattern, int) or isinstance(pattern, bool):
            raise ValueError(f"sliding_window_pattern {pattern!r} without layer_types names no layers")
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    first = int(config.get("max_window_layers", layers)) if config.get("use_sliding_window") else layers
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


def _chunked_layer_types(config: Mapping[str, Any], layers: int) -> list[str]:
    """Llama 4's layers as vLLM 0.33 builds them: chunked local attention where no_rope_layers says
    the layer rotates (1), full attention where it does not (0: NoPE); an empty or missing list is
    every no_rope_layer_interval-th layer NoPE (its config class's default). vLLM reads no_rope_layers,
    not layer_types, so neither does this."""
    flags = config.get("no_rope_layers") or [
        int((i + 1) % int(config.get("no_rope_layer_interval") or LLAMA4_NOPE_INTERVAL) != 0) for i in range(layers)
    ]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers names {len(flags)} layers of {layers}")
    return ["sliding_attention" if flag else "full_attention" for flag in flags]


def _window(config: Mapping[str, Any], family: Family) -> int | None:
    """The tokens a windowed layer keeps: the sliding window, or Llama 4's attention chunk (8192
    unless the config says otherwise; null: no chunking)."""
    if family.windows == "chunked":
        return config.get("attention_chunk_size", LLAMA4_CHUNK)
    window = config.get("sliding_window")
    return window + family.window_extra if window is not None else None


def _sliding_layers(config: Mapping[str, Any], name: str, family: Family, layers: int) -> int | str:
    """How many layers vLLM 0.33 gives `config`'s sliding window (or attention chunk), or why it
    would not load them."""
    if _window(config, family) is None:
        if family.pattern_needs_window and not config.get("layer_types"):
            return (
                f"{name}: sliding_window null without layer_types names no layers (transformers 5's config "
                "class, which vLLM 0.33 reads it with, divides by a pattern of 0)"
            )
        return 0
    sliding = _layer_types(config, family, layers).count("sliding_attention")
    if family.windows == "none_or_refused" and 0 < sliding < layers:
        return (
            f"{name} holds sliding-window layers beside full-attention ones (use_sliding_window, "
            f"max_window_layers {config.get('max_window_layers')}), which vLLM 0.33 refuses to load"
        )
    return sliding if family.windows in ("layer_types", "chunked") else 0


def _attention(config: Mapping[str, Any], family: Family, shape: _Shape) -> int:
    """One layer's attention parameters: q, k, v, o, their biases, per-head norms and sinks."""
    if family.latent:
        return _latent_attention(config, shape)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    weights = shape.hidden * (q + 2 * kv) + q * shape.hidden
    if config.get("attention_bias", family.attention_bias):
        biases = q + 2 * kv + (shape.hidden if family.output_bias else 0)
    else:
        biases = q + 2 * kv if family.qkv_bias else 0
    if family.output_bias_key and config.get(family.output_bias_key):
        biases += shape.hidden
    kind = _head_norms(config, family)
    norms = 0 if kind is None else 2 * shape.head_dim if kind == "per_head" else q + kv
    return weights + biases + norms + (shape.heads if family.sinks else 0)


def _head_norms(config: Mapping[str, Any], family: Family) -> str | None:
    """The kind of q/k norms the model has (Family.head_norms), None where it has none."""
    on = family.head_norms_key is None or config.get(family.head_norms_key)
    return family.head_norms if on else None


def _latent_attention(config: Mapping[str, Any], shape: _Shape) -> int:
    """Multi-head latent attention: q straight or through its own low rank (q_lora_rank), the shared
    latent of K and V with the rotary part, its norm, the latent's up-projection, and o."""
    if config.get("attention_bias"):
        raise ValueError("attention_bias under latent attention is not counted yet")
    nope, rope, v = _int(config, "qk_nope_head_dim"), _int(config, "qk_rope_head_dim"), _int(config, "v_head_dim")
    rank, q_rank = _int(config, "kv_lora_rank"), config.get("q_lora_rank")
    q_out = shape.heads * (nope + rope)
    q = shape.hidden * q_out if q_rank is None else shape.hidden * q_rank + q_rank + q_rank * q_out
    kv = shape.hidden * (rank + rope) + rank + rank * shape.heads * (nope + v)
    return q + kv + shape.heads * v * shape.hidden


def _mlp(config: Mapping[str, Any], hidden: int, intermediate: int) -> int:
    """A gated MLP: gate, up and down projections (and their biases where mlp_bias)."""
    return 3 * hidden * intermediate + ((2 * intermediate + hidden) if config.get("mlp_bias") else 0)


class _Experts(NamedTuple):
    routed: int  # experts to choose from
    active: int  # experts a token goes through
    expert: int  # one expert's parameters
    shared: int  # the shared experts' beside them, every token's
    router: int
    dense: set[int]  # the layers with a dense MLP instead


def _experts(config: Mapping[str, Any], layout: str, hidden: int) -> _Experts:
    """A mixture-of-experts layout as the config describes it."""
    layers, active = _int(config, "num_hidden_layers"), _int(config, "num_experts_per_tok")
    if layout in ("mixtral", "gpt_oss", "minimax_m2"):
        routed, size = _int(config, "num_local_experts"), _int(config, "intermediate_size")
        # gpt-oss: biased experts (gate and up fused) and a biased router; MiniMax-M2: a routing bias.
        biased = layout == "gpt_oss"
        expert = _mlp(config, hidden, size) + ((2 * size + hidden) if biased else 0)
        corrected = layout == "minimax_m2" and config.get("use_routing_bias")
        router = hidden * routed + (routed if biased or corrected else 0)
        return _Experts(routed, active, expert, 0, router, set())
    if layout == "llama4":
        return _llama4_experts(config, hidden, layers, active)
    if layout in ("deepseek", "glm4_moe"):
        routed, size = _int(config, "n_routed_experts"), _int(config, "moe_intermediate_size")
        shared = _mlp(config, hidden, size * int(config.get("n_shared_experts") or 0))
        first, step = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
        dense = {i for i in range(layers) if i < first or i % step}
        # DeepSeek V3's router (Kimi K2's, GLM-4.5's always) keeps a score correction bias per expert.
        corrected = layout == "glm4_moe" or config.get("topk_method") == "noaux_tc"
        router = hidden * routed + (routed if corrected else 0)
        return _Experts(routed, active, _mlp(config, hidden, size), shared, router, dense)
    routed, size = _int(config, "num_experts"), _int(config, "moe_intermediate_size")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    shared = 0
    if layout == "qwen2_moe":
        # One shared expert beside the routed ones, gated by a scalar per token.
        shared = _mlp(config, hidden, _int(config, "shared_expert_intermediate_size")) + hidden
    return _Experts(routed, active, _mlp(config, hidden, size), shared, hidden * routed, dense)


def _llama4_experts(config: Mapping[str, Any], hidden: int, layers: int, active: int) -> _Experts:
    """Llama 4's experts: routed ones of intermediate_size and one shared expert of the same size
    beside them, in the layers moe_layers lists, else every interleave_moe_layer_step-th layer (the
    others hold a dense MLP of intermediate_size_mlp)."""
    routed, size = _int(config, "num_local_experts"), _int(config, "intermediate_size")
    step = _int(config, "interleave_moe_layer_step") if "interleave_moe_layer_step" in config else 1
    sparse = config.get("moe_layers")
    sparse = set(range(step - 1, layers, step)) if sparse is None else set(sparse)
    expert = _mlp(config, hidden, size)
    return _Experts(routed, active, expert, expert, hidden * routed, set(range(layers)) - sparse)


def _parameters(config: Mapping[str, Any], family: Family, shape: _Shape, tied: bool) -> tuple[int, int]:
    """All parameters and those one token's forward pass multiplies with (fewer under experts)."""
    layers, vocab = _int(config, "num_hidden_layers"), _int(config, "vocab_size")
    per_layer = _attention(config, family, shape) + family.norms * shape.hidden
    total = active = layers * per_layer
    dense = _mlp(config, shape.hidden, _int(config, family.dense_intermediate))
    if family.experts is None:
        total += layers * dense
        active += layers * dense
    else:
        moe = _experts(config, family.experts, shape.hidden)
        sparse = layers - len(moe.dense)
        total += sparse * (moe.router + moe.routed * moe.expert + moe.shared) + len(moe.dense) * dense
        active += sparse * (moe.router + moe.active * moe.expert + moe.shared) + len(moe.dense) * dense
    outside = vocab * shape.hidden * (1 if tied else 2) + shape.hidden  # embedding, LM head, final norm
    return total + outside, active + outside


def _replicated(config: Mapping[str, Any], family: Family, shape: _Shape) -> int:
    """The parameters vLLM 0.33 holds whole on every GPU of a tensor-parallel group: the norms around
    each layer and the final one, one-head q/k norms, the experts' routers, and latent attention's
    down-projections (q's and the shared latent's) with their norms."""
    layers = _int(config, "num_hidden_layers")
    whole = layers * family.norms * shape.hidden + shape.hidden
    if _head_norms(config, family) == "per_head":
        whole += layers * 2 * shape.head_dim
    if family.experts is not None:
        moe = _experts(config, family.experts, shape.hidden)
        whole += (layers - len(moe.dense)) * moe.router
    if family.latent:
        rank, rope, q_rank = _int(config, "kv_lora_rank"), _int(config, "qk_rope_head_dim"), config.get("q_lora_rank")
        latent = shape.hidden * (rank + rope) + rank
        whole += layers * (latent + (shape.hidden * q_rank + q_rank if q_rank else 0))
    return whole


def _indexer(config: Mapping[str, Any], family: Family) -> tuple[SparseIndexer | None, int]:
    """DeepSeek Sparse Attention's lightning indexer, as vLLM 0.33 builds it in a latent-attention
    model whose config has index_topk (DeepseekV2MLAAttention.is_v32), and its parameters, each held
    whole on every GPU: q's up-projection from q's low rank, the key's and the heads' weights (one
    fused matrix) and the key's LayerNorm. A layer builds one unless index_topk_pattern marks it "S"
    or, without a pattern, index_topk_freq skips it (counted from index_skip_topk_offset, 2 by
    default: GLM-5.2's every fourth layer); the others reuse an earlier layer's choice and cache no keys."""
    if not family.latent or "index_topk" not in config:
        return None, 0
    q_rank = config.get("q_lora_rank")
    if q_rank is None:
        raise ValueError("sparse attention's indexer without q_lora_rank, which vLLM does not build")
    heads, head_dim, hidden = _int(config, "index_n_heads"), _int(config, "index_head_dim"), _int(config, "hidden_size")
    layers = _int(config, "num_hidden_layers")
    pattern, step = config.get("index_topk_pattern"), int(config.get("index_topk_freq") or 1)
    offset = int(config.get("index_skip_topk_offset", 2))
    if pattern is None:
        indexed = sum(1 for i in range(layers) if max(i - offset + 1, 0) % step == 0)
    else:
        indexed = sum(1 for i in range(layers) if i >= len(pattern) or pattern[i] != "S")
    per_layer = q_rank * heads * head_dim + hidden * (head_dim + heads) + 2 * head_dim
    found = SparseIndexer(heads=heads, head_dim=head_dim, top_k=_int(config, "index_topk"), layers=indexed)
    return found, indexed * per_layer


def _vision_tower(vision: Mapping[str, Any], tower: str) -> int:
    """A vision tower as transformers builds it: a ViT (SigLIP, CLIP), Pixtral's or Qwen2.5-VL's."""
    if tower == "pixtral":
        return _pixtral(vision)
    if tower == "qwen2_5_vl":
        return _qwen2_5_vl(vision)
    if tower in ("qwen3_vl", "qwen3_5"):
        # Qwen3-VL's config class lists three deepstack layers where config.json leaves them out;
        # Qwen3.5's tower has none.
        return _qwen3_vl(vision, vision.get("deepstack_visual_indexes", (8, 16, 24) if tower == "qwen3_vl" else ()))
    if tower == "llama4":
        return _llama4_vision(vision)
    if tower == "gemma4":
        return _gemma4_vision(vision)
    return _vit(vision, tower)


def _vit(vision: Mapping[str, Any], tower: str) -> int:
    """A ViT: patch embeddings (a biased convolution in SigLIP, an unbiased one and a class token in
    CLIP), position embeddings, CLIP's pre-norm, pre-norm encoder layers with biases, the final norm,
    and SigLIP's attention-pooling head where vision_use_head."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    patch, channels = _int(vision, "patch_size"), int(vision.get("num_channels", 3))
    positions = (_int(vision, "image_size") // patch) ** 2
    mlp = 2 * hidden * size + size + hidden
    layer = 4 * (hidden * hidden + hidden) + 4 * hidden + mlp
    if tower == "clip":
        embeddings = channels * patch * patch * hidden + hidden + (positions + 1) * hidden + 2 * hidden
        head = 0
    else:
        embeddings = channels * patch * patch * hidden + hidden + positions * hidden
        head = hidden + 4 * (hidden * hidden + hidden) + 2 * hidden + mlp if vision.get("vision_use_head", True) else 0
    return embeddings + _int(vision, "num_hidden_layers") * layer + 2 * hidden + head


def _pixtral(vision: Mapping[str, Any]) -> int:
    """Pixtral's tower: an unbiased patch convolution, a pre-norm, and layers of RMS-normed unbiased
    attention and gated MLP (rotary positions: no position embeddings)."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    patch, channels = _int(vision, "patch_size"), int(vision.get("num_channels", 3))
    layer = 2 * hidden + 4 * hidden * hidden + 3 * hidden * size
    return channels * patch * patch * hidden + hidden + _int(vision, "num_hidden_layers") * layer


def _qwen2_5_vl(vision: Mapping[str, Any]) -> int:
    """Qwen2.5-VL's tower: an unbiased spatio-temporal patch convolution, blocks of RMS-normed biased
    attention and gated MLP, and the merger (a norm and a two-layer MLP over spatial_merge_size^2
    patches) into out_hidden_size."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    patch, channels = _int(vision, "patch_size"), int(vision.get("in_channels", 3))
    conv = channels * int(vision.get("temporal_patch_size", 2)) * patch * patch * hidden
    block = (
        2 * hidden + 3 * hidden * hidden + 3 * hidden + hidden * hidden + hidden + 3 * hidden * size + 2 * size + hidden
    )
    merged = hidden * int(vision.get("spatial_merge_size", 2)) ** 2
    merger = hidden + merged * merged + merged + (merged + 1) * _int(vision, "out_hidden_size")
    return conv + _int(vision, "depth") * block + merger


def _qwen3_vl(vision: Mapping[str, Any], deepstack: Sequence[int]) -> int:
    """Qwen3-VL's and Qwen3.5's tower: a biased spatio-temporal patch convolution, learned position
    embeddings, blocks of LayerNormed biased attention and biased MLP, and the merger (a norm and a
    two-layer MLP over spatial_merge_size^2 patches) into out_hidden_size, with one more merger
    (normed after the merge) for each `deepstack` layer whose features go to the language model."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    patch, channels = _int(vision, "patch_size"), int(vision.get("in_channels", 3))
    conv = channels * int(vision.get("temporal_patch_size", 2)) * patch * patch * hidden + hidden
    positions = _int(vision, "num_position_embeddings") * hidden
    block = 4 * hidden + 4 * (hidden * hidden + hidden) + 2 * hidden * size + size + hidden
    merged, out = hidden * int(vision.get("spatial_merge_size", 2)) ** 2, _int(vision, "out_hidden_size")
    merger = merged * merged + merged + (merged + 1) * out
    return (
        conv + positions + _int(vision, "depth") * block + 2 * hidden + merger + len(deepstack) * (2 * merged + merger)
    )


def _llama4_vision(vision: Mapping[str, Any]) -> int:
    """Llama 4's tower: an unbiased linear patch embedding, a class token and position embeddings,
    LayerNorms before and after the encoder, pre-norm encoder layers with biased attention and MLP
    (rotary positions inside), and the pixel-shuffle adapter's two unbiased matrices."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    patch, channels = _int(vision, "patch_size"), int(vision.get("num_channels", 3))
    positions = (_int(vision, "image_size") // patch) ** 2 + 1  # the patches and the class token
    embeddings = channels * patch * patch * hidden + hidden + positions * hidden + 2 * 2 * hidden
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden * size + size + hidden + 2 * 2 * hidden
    projector_out = _int(vision, "projector_output_dim")
    adapter = size * _int(vision, "projector_input_dim") + projector_out * projector_out
    return embeddings + _int(vision, "num_hidden_layers") * layer + adapter


def _gemma4_vision(vision: Mapping[str, Any]) -> int:
    """Gemma 4's tower: an unbiased linear patch embedding, a table of positions per axis, and layers
    of unbiased attention (q and k normed per head, v without a scale) and gated MLP between four
    norms; no final norm (its standardization is buffers)."""
    hidden, size = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    heads, kv_heads, head = (
        _int(vision, "num_attention_heads"),
        _int(vision, "num_key_value_heads"),
        _int(vision, "head_dim"),
    )
    embeddings = 3 * _int(vision, "patch_size") ** 2 * hidden + 2 * _int(vision, "position_embedding_size") * hidden
    attention = 2 * hidden * heads * head + 2 * hidden * kv_heads * head + 2 * head
    layer = attention + 3 * hidden * size + 4 * hidden
    return embeddings + _int(vision, "num_hidden_layers") * layer


def _gemma4_audio(audio: Mapping[str, Any], text_hidden: int) -> int:
    """Gemma 4's audio tower (E2B, E4B) and its projector: two unbiased 3x3 convolutions subsampling
    the features, each with a LayerNorm, their projection into the conformer, conformer layers (two
    feed-forward blocks, attention with a relative-position key projection and a scale per head value,
    a light convolution block, norms around them), a biased output projection, and one unbiased matrix
    into the language model. Gemma4AudioConfig's defaults where config.json leaves a key out."""
    hidden = _positive(audio.get("hidden_size", 1024), "audio_config.hidden_size")
    heads = _positive(audio.get("num_attention_heads", 8), "audio_config.num_attention_heads")
    first, second = audio.get("subsampling_conv_channels", (128, 32))
    subsample = first * 9 + first + second * first * 9 + second + first // 4 * second * hidden
    feed_forward = 8 * hidden * hidden + 2 * hidden
    attention = 5 * hidden * hidden + hidden // heads
    light_conv = 3 * hidden * hidden + hidden * int(audio.get("conv_kernel_size", 5)) + 2 * hidden
    layer = 2 * feed_forward + attention + light_conv + 3 * hidden
    out = _positive(audio.get("output_proj_dims", 1536), "audio_config.output_proj_dims")
    layers = _positive(audio.get("num_hidden_layers", 12), "audio_config.num_hidden_layers")
    return subsample + layers * layer + hidden * out + out + out * text_hidden


def _projector(config: Mapping[str, Any], projector: str, text_hidden: int) -> int:
    """From the tower's features to the language model's: Gemma 3's norm and matrix, or two linear
    layers over the features of every layer vision_feature_layer names (biased unless
    multimodal_projector_bias is false), with LLaVA-NeXT's learned newline token between image rows
    or Mistral 3's norm and patch merger before them; none where the tower merges (Qwen2.5-VL)."""
    vision_hidden = _int(config["vision_config"], "hidden_size")
    if projector == "gemma4":  # one unbiased matrix after a norm without a scale; an audio tower's too
        audio = config.get("audio_config")
        return vision_hidden * text_hidden + (_gemma4_audio(audio, text_hidden) if audio is not None else 0)
    if projector == "llama4":  # one unbiased matrix from the adapter's output
        return _int(config["vision_config"], "vision_output_dim") * text_hidden
    if projector in ("gemma3", "none"):
        return vision_hidden * text_hidden + vision_hidden if projector == "gemma3" else 0
    mistral = projector == "mistral3"
    feature_layers = config.get("vision_feature_layer", -1 if mistral else -2)
    features = vision_hidden * (len(feature_layers) if isinstance(feature_layers, list) else 1)
    biases = 2 * text_hidden if config.get("multimodal_projector_bias", not mistral) else 0
    merger = vision_hidden + vision_hidden * int(config.get("spatial_merge_size", 2)) ** 2 * vision_hidden
    extra = {"llava_next": text_hidden, "mistral3": merger}.get(projector, 0)
    return features * text_hidden + text_hidden * text_hidden + biases + extra


def _vision_parameters(config: Mapping[str, Any], wrapper: Wrapper, text_hidden: int) -> int:
    if not isinstance(config.get("vision_config"), Mapping):
        raise ValueError("config.json has no vision_config, whose tower the wrapper holds")
    return _vision_tower(config["vision_config"], wrapper.tower) + _projector(config, wrapper.projector, text_hidden)


def _language_model(config: Mapping[str, Any], name: str) -> tuple[Mapping[str, Any], Wrapper | None] | str:
    """The config and vision tower of the language model `config` describes (a multimodal wrapper's
    text_config, or its top-level fields beside vision_config), or why it is not read."""
    if "text_config" not in config and name not in WRAPPERS:
        if name not in FAMILIES and name not in READERS:
            readable = ", ".join([*FAMILIES, *READERS, *WRAPPERS])
            return f"{name} is not an architecture the planner reads ({readable}); set spec.model.architecture"
        return config, None
    if name not in WRAPPERS:
        return (
            f"{name} wraps a language model (text_config) with a vision tower whose weights the planner "
            f"does not count; it counts {', '.join(WRAPPERS)}'s"
        )
    wrapper = WRAPPERS[name]
    text = config.get("text_config") or {key: value for key, value in config.items() if key != "vision_config"}
    defaults = wrapper.text_defaults
    if defaults and text.get("model_type", defaults["model_type"]) != defaults["model_type"]:
        return f"{name} over a {text['model_type']} language model is not read yet ({defaults['model_type']} is)"
    # A tied head as text_config says, else as the wrapper's config.json says at its top level.
    tied = {key: config[key] for key in ("tie_word_embeddings",) if key in config}
    return {**defaults, **tied, **text, "architectures": [wrapper.language_model]}, wrapper


def _hybrid(config: Mapping[str, Any], name: str, state: RecurrentState, source: str) -> Architecture | str:
    """A hybrid's Architecture with its state layers (planning/recurrent.py sizes vLLM 0.33's pages of
    them), or why it is not planned: an option its parameters are not counted with."""
    try:
        total, active = hybrid_parameters(config, state)
    except ValueError as error:
        hybrid = hybrid_kv(state, Serving(gpu=""))
        return (
            f"{name} (parameters not counted: {error}) keeps a state per sequence in {state.layers} layers "
            f"({state.kind}: {hybrid.state_bytes:,} bytes per layer and sequence on one GPU, which vLLM 0.33 holds "
            f"in pages of {hybrid.block_size}-token attention blocks) beside {state.attention_layers} attention layers"
        )
    tied = bool(config.get("tie_word_embeddings", False))
    replicated = HYBRID_REPLICATED.get(str(config["architectures"][0]))
    mtp = _hybrid_mtp(config, name, state)
    return Architecture(
        layers=_int(config, "num_hidden_layers"),
        hidden_size=_int(config, "hidden_size"),
        attention_heads=_int(config, "num_attention_heads"),
        kv_heads=state.kv_heads,
        head_dim=state.head_dim,
        vocab_size=_int(config, "vocab_size"),
        parameters=total,
        active_parameters=active if active != total else None,
        replicated_parameters=replicated(config, state) if replicated else None,
        max_context=_int(config, "max_position_embeddings"),
        tie_word_embeddings=tied,
        hf_architecture=name,
        state=state_layers(state),
        mtp=mtp,
        source=source,
    )


# The hybrids whose MTP modules vLLM 0.33 drafts with (qwen3_next_mtp.py, qwen3_5_mtp.py), by the
# checkpoint's architectures[0], and the key their count is read from as the MTP class reads it (1 where
# the config has none: Qwen3-Next's checkpoints store one module, their config.json does not say so).
# Each module is a full-attention decoder layer of the model's (its experts or MLP too), fc (a projection
# of the token's embedding and the last hidden state, split over the GPUs) and three norms; the
# embedding and the LM head are the target's, which vLLM shares with the drafter. Qwen3.5's are drafted
# with from its multimodal checkpoints only: from a text-only one (model_type qwen3_5_text), vLLM 0.33
# renames the config qwen3_5_mtp, whose decoder layer Qwen3_5DecoderLayer refuses to build.
HYBRID_MTP = {
    "Qwen3NextForCausalLM": "num_nextn_predict_layers",
    "Qwen3_5ForConditionalGeneration": "mtp_num_hidden_layers",
    "Qwen3_5MoeForConditionalGeneration": "mtp_num_hidden_layers",
}


def _hybrid_mtp(config: Mapping[str, Any], name: str, state: RecurrentState) -> MtpModules | None:
    """A hybrid's MTP modules (HYBRID_MTP: `name` is the checkpoint's architecture, `config` its
    language model's) as vLLM 0.33 builds them to draft with: one more attention layer each, counted as
    the model's own, and what each adds beside it."""
    key = HYBRID_MTP.get(name)
    modules = int(config.get(key, 1) or 0) if key else 0
    if modules == 0:
        return None
    longer = state._replace(attention_layers=state.attention_layers + modules)
    (total, active), (base_total, base_active) = (hybrid_parameters(config, s) for s in (longer, state))
    hidden = _int(config, "hidden_size")
    norms = 3 * hidden * modules
    own = 2 * hidden * hidden * modules + norms
    whole = _gated_deltanet_replicated(config, longer) - _gated_deltanet_replicated(config, state)
    return MtpModules(
        layers=modules,
        parameters=total - base_total + own,
        active_parameters=active - base_active + own,
        replicated_parameters=whole + norms,
    )


def hybrid_parameters(config: Mapping[str, Any], state: RecurrentState) -> tuple[int, int]:
    """All of a hybrid's parameters and those one token multiplies with: its state and attention
    layers, their MLPs or experts and norms, the embedding, the final norm and an untied head."""
    hidden, vocab = _int(config, "hidden_size"), _int(config, "vocab_size")
    total, active = HYBRID_LAYERS[str(config["architectures"][0])](config, state, hidden)
    outside = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    return total + outside, active + outside


def _gated_deltanet_mixers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> int:
    """Qwen3-Next's and Qwen3.5's mixers and norms: gated full attention (q doubled for its output
    gate, per-head norms), Gated DeltaNet (q, k, v and z; b and a; the convolution; dt_bias and
    A_log; the gated norm; out), and two norms in every layer."""
    _refuse_options(config, ("attention_bias", "layer_scale"))
    heads, head_dim = _int(config, "num_attention_heads"), state.head_dim
    gates = 2 if config.get("attn_output_gate", True) else 1
    attention = (gates + 1) * hidden * heads * head_dim + 2 * hidden * state.kv_heads * head_dim + 2 * head_dim
    key = _int(config, "linear_num_key_heads") * _int(config, "linear_key_head_dim")
    value_heads, value_dim = _int(config, "linear_num_value_heads"), _int(config, "linear_value_head_dim")
    value = value_heads * value_dim
    linear = hidden * (2 * key + 2 * value + 2 * value_heads) + state.conv_channels * (state.conv_width + 1)
    linear += 2 * value_heads + value_dim + value * hidden
    layers = state.layers + state.attention_layers
    return state.attention_layers * attention + state.layers * linear + 2 * layers * hidden


def _gated_deltanet_replicated(config: Mapping[str, Any], state: RecurrentState) -> int:
    """What vLLM 0.33 holds whole on every GPU of Qwen3-Next's and Qwen3.5's: the layers' two norms
    and the final one, the attention layers' one-head q/k norms, Gated DeltaNet's one-head gated norm,
    and, under experts, each layer's router and shared expert gate."""
    hidden, layers = _int(config, "hidden_size"), state.layers + state.attention_layers
    whole = (2 * layers + 1) * hidden + state.attention_layers * 2 * state.head_dim
    whole += state.layers * _int(config, "linear_value_head_dim")
    if "num_experts" in config:
        moe = _experts(config, "qwen2_moe", hidden)
        whole += (layers - len(moe.dense)) * (moe.router + hidden)
    return whole


def _jamba_replicated(config: Mapping[str, Any], state: RecurrentState) -> int:
    """Jamba's: the layers' two norms and the final one, the Mamba mixers' norms of dt, B and C, and
    the routers of the layers with experts."""
    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    norms = state.layers * (_jamba_dt_rank(config, hidden) + 2 * state.head_values)
    return (2 * layers + 1) * hidden + norms + _jamba_sparse_layers(config) * hidden * _int(config, "num_experts")


def _nemotron_h_replicated(config: Mapping[str, Any], state: RecurrentState) -> int:
    """Nemotron-H's: each layer's norm and the final one."""
    return (len(str(config["hybrid_override_pattern"])) + 1) * _int(config, "hidden_size")


# The hybrids whose replicated parameters are counted.
HYBRID_REPLICATED = {
    "Qwen3NextForCausalLM": _gated_deltanet_replicated,
    "Qwen3_5ForCausalLM": _gated_deltanet_replicated,
    "Qwen3_5MoeForCausalLM": _gated_deltanet_replicated,
    "JambaForCausalLM": _jamba_replicated,
    "NemotronHForCausalLM": _nemotron_h_replicated,
}


def _qwen3_next_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Qwen3-Next's (and Qwen3.5-MoE's) layers: the mixers, and Qwen2-MoE's experts with a gated
    shared expert (a dense MLP in mlp_only_layers)."""
    mixers, layers = _gated_deltanet_mixers(config, state, hidden), state.layers + state.attention_layers
    moe = _experts(config, "qwen2_moe", hidden)
    dense = len(moe.dense) * _mlp(config, hidden, _int(config, "intermediate_size")) if moe.dense else 0
    sparse = layers - len(moe.dense)
    total = mixers + sparse * (moe.router + moe.routed * moe.expert + moe.shared) + dense
    return total, mixers + sparse * (moe.router + moe.active * moe.expert + moe.shared) + dense


def _qwen3_5_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Qwen3.5's dense layers: the mixers and a gated MLP of intermediate_size in every layer."""
    mlp = (state.layers + state.attention_layers) * _mlp(config, hidden, _int(config, "intermediate_size"))
    total = _gated_deltanet_mixers(config, state, hidden) + mlp
    return total, total


def _mamba2_mixer(state: RecurrentState, hidden: int, conv_bias: bool, proj_bias: bool, gated_norm: bool) -> int:
    """One Mamba-2 mixer: in (x, the gate, B, C and dt), the depthwise convolution over x, B and C,
    dt_bias, A_log and D, the gated norm where it has one, and out."""
    inner, heads = state.conv_channels, state.heads
    conv = inner + state.groups * state.conv_group_channels
    projection = inner + conv + heads
    mixer = hidden * projection + conv * (state.conv_width + 1) + 3 * heads + inner * hidden
    return mixer + (conv if conv_bias else 0) + (projection + hidden if proj_bias else 0) + (inner if gated_norm else 0)


def _attention_projections(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> int:
    """A hybrid's attention layer: q, k, v and o over state.head_dim-wide heads, biased where
    attention_bias says."""
    query, kv = _int(config, "num_attention_heads") * state.head_dim, state.kv_heads * state.head_dim
    bias = query + 2 * kv + hidden if config.get("attention_bias") else 0
    return 2 * hidden * query + 2 * hidden * kv + bias


def _refuse_options(config: Mapping[str, Any], options: tuple[str, ...]) -> None:
    for option in options:
        if config.get(option):
            raise ValueError(f"{option} is not counted yet")


def _nemotron_h_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Nemotron-H's layers, one norm and one mixer each: Mamba-2 (with a biased convolution and a
    gated norm), attention, or an ungated MLP."""
    _refuse_options(config, ("mamba_proj_bias", "use_bias", "attention_bias", "mlp_bias"))
    pattern = str(config["hybrid_override_pattern"])
    if set(pattern) - set("M*-"):
        raise ValueError(f"hybrid_override_pattern's {''.join(sorted(set(pattern) - set('M*-')))} layers")
    mamba = _mamba2_mixer(state, hidden, bool(config.get("use_conv_bias", True)), False, True)
    attention = _attention_projections(config, state, hidden)
    mlp = 2 * hidden * _int(config, "intermediate_size")
    total = pattern.count("M") * mamba + pattern.count("*") * attention + pattern.count("-") * mlp
    return total + len(pattern) * hidden, total + len(pattern) * hidden


def _granite_hybrid_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Granite 4.0-H's layers, two norms each: Mamba-2 (gated norm; proj biases where
    mamba_proj_bias says) or attention, then a shared MLP of shared_intermediate_size beside
    num_local_experts experts with a router (none where it is 0). Absent keys take the config
    class's defaults, as transformers and vLLM read them."""
    mamba = _mamba2_mixer(
        state, hidden, bool(config.get("mamba_conv_bias", True)), bool(config.get("mamba_proj_bias", False)), True
    )
    mixers = state.layers * mamba + state.attention_layers * _attention_projections(config, state, hidden)
    layers = state.layers + state.attention_layers
    shared = 3 * hidden * int(config.get("shared_intermediate_size", 1024))
    experts, top_k = int(config.get("num_local_experts", 8)), int(config.get("num_experts_per_tok", 2))
    expert = 3 * hidden * _int(config, "intermediate_size") if experts > 0 else 0
    common = mixers + layers * (2 * hidden + shared + experts * hidden)
    return common + layers * experts * expert, common + layers * min(top_k, experts) * expert


def _falcon_h1_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Falcon-H1's layers, each attention and a Mamba-2 mixer side by side (a gated norm only where
    mamba_rms_norm says), a gated MLP, and two norms. vLLM 0.33 builds its attention, MLP and
    out projection without biases whatever the config says, so a config with them is refused."""
    _refuse_options(config, ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"))
    mamba = _mamba2_mixer(
        state, hidden, bool(config.get("mamba_conv_bias", True)), False, bool(config.get("mamba_rms_norm", False))
    )
    mlp = 3 * hidden * _int(config, "intermediate_size")
    layer = _attention_projections(config, state, hidden) + mamba + mlp + 2 * hidden
    return state.layers * layer, state.layers * layer


def _jamba_mamba(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> int:
    """One Jamba Mamba mixer: in (x and the gate), the depthwise convolution, x_proj (dt's rank, B and
    C), dt_proj (biased), A_log and D, the RMS norms of dt, B and C, and out."""
    inner, d_state = state.conv_channels, state.head_values
    rank = _jamba_dt_rank(config, hidden)
    projection_bias = inner * 2 + hidden if config.get("mamba_proj_bias", False) else 0
    conv = inner * (state.conv_width + 1) + (inner if config.get("mamba_conv_bias", True) else 0)
    ssm = inner * (rank + 2 * d_state) + rank * inner + inner + inner * d_state + inner
    return hidden * 2 * inner + conv + ssm + inner * hidden + projection_bias + rank + 2 * d_state


def _jamba_dt_rank(config: Mapping[str, Any], hidden: int) -> int:
    """dt's rank: mamba_dt_rank, or hidden_size / 16 rounded up where "auto"."""
    rank = config.get("mamba_dt_rank", "auto")
    return math.ceil(hidden / 16) if rank == "auto" else _positive(rank, "mamba_dt_rank")


def _jamba_sparse_layers(config: Mapping[str, Any]) -> int:
    """Jamba's layers with experts: every expert_layer_period-th from expert_layer_offset, where
    num_experts > 1."""
    layers, period = _int(config, "num_hidden_layers"), _int(config, "expert_layer_period")
    offset = int(config.get("expert_layer_offset", 0))
    return sum(1 for i in range(layers) if i % period == offset) if _int(config, "num_experts") > 1 else 0


def _jamba_layers(config: Mapping[str, Any], state: RecurrentState, hidden: int) -> tuple[int, int]:
    """Jamba's layers, two norms each: attention (every attn_layer_period-th from attn_layer_offset)
    or a Mamba mixer, and experts (every expert_layer_period-th from expert_layer_offset, where
    num_experts > 1) or a dense MLP of intermediate_size."""
    layers, experts = _int(config, "num_hidden_layers"), _int(config, "num_experts")
    sparse = _jamba_sparse_layers(config)
    heads = _int(config, "num_attention_heads")
    attention = 2 * hidden * heads * state.head_dim + 2 * hidden * state.kv_heads * state.head_dim
    mixers = state.attention_layers * attention + state.layers * _jamba_mamba(config, state, hidden)
    mlp = _mlp(config, hidden, _int(config, "intermediate_size"))
    common = mixers + 2 * layers * hidden + (layers - sparse) * mlp + sparse * hidden * experts
    return common + sparse * experts * mlp, common + sparse * _int(config, "num_experts_per_tok") * mlp


# A hybrid's architecture -> its layers' parameters (all, and a token's).
HYBRID_LAYERS = {
    "Qwen3NextForCausalLM": _qwen3_next_layers,
    "Qwen3_5MoeForCausalLM": _qwen3_next_layers,
    "Qwen3_5ForCausalLM": _qwen3_5_layers,
    "NemotronHForCausalLM": _nemotron_h_layers,
    "GraniteMoeHybridForCausalLM": _granite_hybrid_layers,
    "FalconH1ForCausalLM": _falcon_h1_layers,
    "JambaForCausalLM": _jamba_layers,
}


def read_config(config: Mapping[str, Any], source: str) -> ModelConfig | str:
    """The Architecture (and the checkpoint's stored scheme) of a config.json, or why it cannot be
    planned from it; `source` says where the config came from."""
    name = str((config.get("architectures") or ["(no architectures)"])[0])
    if config.get("speculators_model_type"):
        flattened = _speculators_head(config)
        if isinstance(flattened, str):
            return f"{name} is {flattened}: give serving.draftModelArchitecture"
        config, name = flattened, flattened["architectures"][0]
    if name in EAGLE3_HEADS:
        try:
            head = _eagle3_head(config, name, source)
        except ValueError as error:  # pydantic's ValidationError is one
            return f"{name}: {error}"
        return head if isinstance(head, str) else ModelConfig(head, stored_scheme(config))
    found = _language_model(config, name)
    if isinstance(found, str):
        return found
    text, wrapper = found
    try:
        scheme = stored_scheme(config)
        state = recurrent_state(text)
        if state is not None:
            architecture = _hybrid(text, name, state, source)
        elif text["architectures"][0] == GEMMA4:
            architecture = _gemma4(text, name, source)
        else:
            architecture = _architecture(text, name, FAMILIES[str(text["architectures"][0])], source)
        if wrapper is not None and not isinstance(architecture, str):
            vision = _vision_parameters(config, wrapper, architecture.hidden_size)
            whole = architecture.replicated_parameters
            if wrapper.replicated_tower:
                whole = (whole or 0) + vision
            architecture = architecture.model_copy(
                update={
                    "parameters": architecture.parameters + vision,
                    "active_parameters": architecture.parameters_per_token,
                    "vision_parameters": vision,
                    "replicated_parameters": whole,
                }
            )
    except ValueError as error:  # pydantic's ValidationError is one
        return f"{name}: {error}"
    if isinstance(architecture, str):
        return architecture
    return ModelConfig(architecture, scheme)


def _speculators_head(config: Mapping[str, Any]) -> Mapping[str, Any] | str:
    """A Speculators-format head's config as vLLM 0.33 reads it (SpeculatorsConfig, update_eagle3): its
    transformer_layer_config with the head's own fields beside it; or what the head is, where the
    planner does not count it."""
    kind, layer = config["speculators_model_type"], config.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, Mapping):
        return f"a Speculators-format {kind} head, which the planner does not read (it reads eagle3 heads)"
    if layer.get("model_type", "llama") != "llama":
        return f"a Speculators-format EAGLE-3 head over a {layer['model_type']} layer (the planner counts llama's)"
    own = ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm", "eagle_aux_hidden_state_layer_ids")
    return {
        **layer,
        **{k: config[k] for k in own if config.get(k) is not None},
        "architectures": ["Eagle3LlamaForCausalLM"],
    }


def _eagle3_head(config: Mapping[str, Any], name: str, source: str) -> Architecture | str:
    """An EAGLE-3 head as vLLM 0.33 builds it (Eagle3LlamaForCausalLM): Llama decoder layers, the first
    attending over the token's embedding and the target's hidden state side by side; a projection of
    three of the target's layers' hidden states (fc); an LM head over its own draft vocabulary. Its
    KV is its Llama layers', its parameters those vLLM allocates for it.
    The embedding is among them, though vLLM drops it for the target's when the head's checkpoint
    has none (the checkpoint's bytes then say less, and the planner takes the smaller)."""
    llama = FAMILIES["LlamaForCausalLM"]
    head = _architecture(config, name, llama, source)
    if isinstance(head, str):
        return head
    hidden, vocab, layers = head.hidden_size, head.vocab_size, head.layers
    shape = _Shape(hidden, head.attention_heads, head.kv_heads, head.head_size)
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    per_layer = _attention(config, llama, shape) + 3 * hidden + _mlp(config, hidden, _int(config, "intermediate_size"))
    eagle = config.get("eagle_config") or {}
    aux = config.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or ()) or 3
    listed = config.get("eagle_aux_hidden_state_layer_ids") or ()
    if listed and len(listed) != aux:
        return (
            f"{name} lists {len(listed)} of the target's layers (eagle_aux_hidden_state_layer_ids) where vLLM 0.33 "
            f"builds its fc for {aux} (it counts eagle_config's list), so it would not load the head's weights"
        )
    fc_in = aux * int(config.get("target_hidden_size") or hidden) if eagle.get("use_aux_hidden_state", True) else 0
    fc_norms = fc_in * (bool(eagle.get("norm_before_fc", config.get("norm_before_fc"))) + bool(config.get("fc_norm")))
    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    # The draft-to-target token map: an int64 per draft token, four 16-bit values' bytes.
    token_map = 4 * draft_vocab if draft_vocab != vocab else 0
    parameters = (
        layers * per_layer + hidden * qkv + vocab * hidden + fc_in * hidden + fc_norms + hidden + draft_vocab * hidden
    )
    return head.model_copy(update={"parameters": parameters + token_map, "tie_word_embeddings": False})


def _architecture(config: Mapping[str, Any], name: str, family: Family, source: str) -> Architecture | str:
    """The language model's Architecture, or why vLLM would not load its layers."""
    config = {**family.defaults, **config}
    layers = _int(config, "num_hidden_layers")
    sliding = _sliding_layers(config, name, family, layers)
    if isinstance(sliding, str):
        return sliding
    heads, hidden = _int(config, "num_attention_heads"), _int(config, "hidden_size")
    kv_heads = _int(config, "num_key_value_heads") if "num_key_value_heads" in config else heads
    if family.latent:
        # One latent per token and layer, shared by every head: vLLM's single KV head.
        kv_heads, head_dim = 1, _int(config, "qk_nope_head_dim") + _int(config, "qk_rope_head_dim")
    else:
        head_dim = _int(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
    tied = bool(config.get("tie_word_embeddings", family.tie_default))
    shape = _Shape(hidden, heads, kv_heads, head_dim)
    total, active = _parameters(config, family, shape, tied)
    indexer, indexing = _indexer(config, family)
    return Architecture(
        layers=layers,
        hidden_size=hidden,
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(config, "vocab_size"),
        parameters=total + indexing,
        active_parameters=active + indexing if active != total else None,
        replicated_parameters=_replicated(config, family, shape) + indexing,
        max_context=_int(config, "max_position_embeddings"),
        tie_word_embeddings=tied,
        sliding_window=_positive(_window(config, family), "the window") if sliding else None,
        sliding_layers=sliding if sliding and sliding < layers else None,
        sliding_kind="chunk" if sliding and family.windows == "chunked" else "window",
        latent_dim=_int(config, "kv_lora_rank") + _int(config, "qk_rope_head_dim") if family.latent else None,
        indexer=indexer,
        mtp=_mtp(config, name, family, shape),
        hf_architecture=name,
        source=source,
    )


# The families whose multi-token-prediction modules vLLM 0.33 drafts with (speculative method mtp, by
# deepseek_mtp.py and glm4_moe_mtp.py; CUDA builds V3.2's and GLM-5's with deepseek_v32/nvidia/mtp.py, of
# the same modules): each module a decoder layer numbered
# from num_hidden_layers on (so one with experts), eh_proj (an nn.Linear from the token's embedding
# and the last hidden state, whole on every GPU) and three norms (enorm, hnorm, shared_head.norm);
# the embedding and the LM head are the target's, which vLLM shares with the drafter. A sparse-
# attention model's module always runs an indexer of its own.
# GLM-4.7-Flash's (glm4_moe_lite_mtp.py) is built over no decoder layers, its layer kind otherwise: not
# counted here.
MTP_FAMILIES = frozenset(
    ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM")
)


def _mtp(config: Mapping[str, Any], name: str, family: Family, shape: _Shape) -> MtpModules | None:
    """The MTP modules config.json describes (num_nextn_predict_layers), as vLLM 0.33 builds them to
    draft with; None where it has none or vLLM drafts with them otherwise (not counted here)."""
    modules = int(config.get("num_nextn_predict_layers") or 0)
    if modules == 0 or name not in MTP_FAMILIES:
        return None
    # The decoder layers past num_hidden_layers: what the same config counts with them, less without.
    longer = {**config, "num_hidden_layers": _int(config, "num_hidden_layers") + modules}
    (total, active), (base_total, base_active) = (_parameters(c, family, shape, True) for c in (longer, config))
    whole = _replicated(longer, family, shape) - _replicated(config, family, shape)
    indexer, indexing = _indexer(config, family)
    own = 2 * shape.hidden * shape.hidden + 3 * shape.hidden + (indexing // indexer.layers if indexer else 0)
    own *= modules
    return MtpModules(
        layers=modules,
        parameters=total - base_total + own,
        active_parameters=active - base_active + own,
        replicated_parameters=whole + own,
    )


# Gemma4TextConfig's defaults (transformers 5) of the keys a config.json may leave out.
GEMMA4_DEFAULTS = {
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "max_position_embeddings": 131_072,
}


class _Gemma4Layers(NamedTuple):
    """Gemma 4's layers as its config class derives them (Gemma4TextConfig.__post_init__)."""

    types: list[str]  # each layer's: "sliding_attention" or "full_attention" (the last always full)
    window: int
    sliding: tuple[int, int]  # a sliding-window layer's K/V heads and head dimension
    full: tuple[int, int]  # a full-attention layer's
    first_shared: int  # the first layer that reads an earlier layer's K and V (num_kv_shared_layers from the end)


def _gemma4_layers(config: Mapping[str, Any]) -> _Gemma4Layers:
    layers = _int(config, "num_hidden_layers")
    types = list(config.get("layer_types") or [])
    if not types:
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types names {len(types)} layers of {layers}")
    types[-1] = "full_attention"
    window = _positive(config.get("sliding_window", GEMMA4_DEFAULTS["sliding_window"]), "sliding_window")
    if config.get("use_bidirectional_attention") == "all":
        window = window // 2 + 1  # the config class's exclusive bound for bidirectional attention
    sliding, full = _gemma4_shapes(config, types)
    shared = int(config.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < layers:
        raise ValueError(f"num_kv_shared_layers {shared} of {layers} layers")
    orphans = set(types[layers - shared :]) - set(types[: layers - shared])
    if orphans:
        # transformers' kv_sharing_modes and vLLM's Gemma4Attention both refuse it.
        raise ValueError(f"layers that read an earlier {orphans.pop()} layer's K and V, of which there is none")
    return _Gemma4Layers(types, window, sliding, full, layers - shared)


def _gemma4_shapes(config: Mapping[str, Any], types: list[str]) -> tuple[tuple[int, int], tuple[int, int]]:
    """A sliding-window layer's K/V heads and head dimension, and a full-attention layer's: the full
    layers' num_global_key_value_heads (where attention_k_eq_v) of global_head_dim, or, in a config
    transformers 5 saved, per_layer_config's overrides (keyed by the layer's index), which it writes
    in their place."""
    kv_heads, head = _int(config, "num_key_value_heads"), _gemma4_key(config, "head_dim")
    overrides = config.get("per_layer_config")
    if overrides is None:
        full_kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        full_heads = _positive(full_kv, "num_global_key_value_heads") if full_kv is not None else kv_heads
        return (kv_heads, head), (full_heads, _gemma4_key(config, "global_head_dim"))
    layers = {int(index): layer for index, layer in overrides.items()}

    def shape(kind: str) -> tuple[int, int]:
        found = {
            (int(layers.get(i, {}).get("num_key_value_heads", kv_heads)), int(layers.get(i, {}).get("head_dim", head)))
            for i, t in enumerate(types)
            if t == kind
        }
        if len(found) > 1:
            raise ValueError(f"per_layer_config gives {kind} layers more than one K/V shape, which is not sized yet")
        return found.pop() if found else (kv_heads, head)

    return shape("sliding_attention"), shape("full_attention")


def _gemma4_key(config: Mapping[str, Any], key: str) -> int:
    return _positive(config.get(key, GEMMA4_DEFAULTS[key]), key)


def _gemma4_parameters(config: Mapping[str, Any], shape: _Gemma4Layers) -> tuple[int, int, int]:
    """All of Gemma 4's parameters as vLLM 0.33 builds them, a token's, and those it holds whole on
    every GPU of a tensor-parallel group. A layer that reads an earlier layer's K and V has only q
    and o; a full-attention layer whose V is its K (attention_k_eq_v) is built with a V projection
    all the same, loaded with K's weights. Experts (where num_experts is set) run beside the dense MLP,
    with their router, a scale per expert and three norms more; per-layer embeddings
    (hidden_size_per_layer_input) add a table and a projection of every layer's inputs and, in each
    layer, a gate, a projection and a norm."""
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    layers, bias, ple = len(shape.types), bool(config.get("attention_bias")), _gemma4_ple(config)
    moe = _gemma4_experts(config, hidden) if config.get("num_experts") is not None else None
    # Whole on every GPU: the per-layer inputs' gate, projection and norm; the router and three norms.
    per_layer_inputs = 2 * hidden * ple + hidden if ple else 0
    moe_block = moe.router + 3 * hidden if moe is not None else 0
    total = whole = 0
    for i, kind in enumerate(shape.types):
        kv_heads, head = shape.full if kind == "full_attention" else shape.sliding
        q = heads * head
        own_kv = 0 if i >= shape.first_shared else 2 * kv_heads * head
        attention = hidden * (q + own_kv) + q * hidden + (q + own_kv + hidden if bias else 0)
        norms = (head if own_kv == 0 else 2 * head) + 4 * hidden
        wide = 2 if config.get("use_double_wide_mlp") and i >= shape.first_shared else 1
        total += (
            attention + norms + 3 * hidden * _int(config, "intermediate_size") * wide + per_layer_inputs + moe_block
        )
        # o's bias is added after the all-reduce, whole too.
        whole += norms + per_layer_inputs + moe_block + (hidden if bias else 0)
    active = total
    if moe is not None:
        total, active = total + layers * moe.routed * moe.expert, active + layers * moe.active * moe.expert
    vocab = _int(config, "vocab_size")
    outside = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2) + hidden
    if ple:
        # The table (split over the GPUs), the projection of the embedding into every layer's inputs, its norm.
        outside += (_gemma4_lookups(config, layers) or 0) + hidden * layers * ple + ple
        whole += ple
    return total + outside, active + outside, whole + hidden


def _gemma4_ple(config: Mapping[str, Any]) -> int:
    """The width of each layer's per-layer embedding (hidden_size_per_layer_input; 0: none)."""
    return int(config.get("hidden_size_per_layer_input", GEMMA4_DEFAULTS["hidden_size_per_layer_input"]) or 0)


def _gemma4_lookups(config: Mapping[str, Any], layers: int) -> int | None:
    """The per-layer embeddings' table: vocab_size_per_layer_input rows of every layer's
    hidden_size_per_layer_input values (None: none)."""
    ple = _gemma4_ple(config)
    return _int({**GEMMA4_DEFAULTS, **config}, "vocab_size_per_layer_input") * layers * ple if ple else None


def _gemma4_experts(config: Mapping[str, Any], hidden: int) -> _Experts:
    """Gemma 4's experts: num_experts of moe_intermediate_size (or expert_intermediate_size), top_k_experts
    a token; a router of a scale per hidden value, one per expert and its projection."""
    routed, active = _int(config, "num_experts"), _int(config, "top_k_experts")
    size = config.get("moe_intermediate_size") or config.get("expert_intermediate_size")
    expert = 3 * hidden * _positive(size, "moe_intermediate_size")
    return _Experts(routed, active, expert, 0, hidden + routed + hidden * routed, set())


def _gemma4(config: Mapping[str, Any], name: str, source: str) -> Architecture:
    """Gemma 4's Architecture: its sliding-window layers' K/V heads at the top, its full-attention
    layers' own (fullAttention) where they differ, the layers that keep no K and V of their own
    (sharedKv), its parameters as vLLM 0.33 builds them (_gemma4_parameters)."""
    shape = _gemma4_layers(config)
    total, active, whole = _gemma4_parameters(config, shape)
    shared = shape.types[shape.first_shared :]
    sliding = shape.types.count("sliding_attention")
    return Architecture(
        layers=len(shape.types),
        hidden_size=_int(config, "hidden_size"),
        attention_heads=_int(config, "num_attention_heads"),
        kv_heads=(shape.sliding if sliding else shape.full)[0],
        head_dim=(shape.sliding if sliding else shape.full)[1],
        vocab_size=_int(config, "vocab_size"),
        parameters=total,
        active_parameters=active if active != total else None,
        replicated_parameters=whole,
        lookup_parameters=_gemma4_lookups(config, len(shape.types)),
        max_context=_gemma4_key(config, "max_position_embeddings"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        sliding_window=shape.window if sliding else None,
        sliding_layers=sliding if 0 < sliding < len(shape.types) else None,
        full_attention=FullAttentionShape(kv_heads=shape.full[0], head_dim=shape.full[1])
        if sliding and shape.full != shape.sliding
        else None,
        shared_kv=SharedKV(full_layers=shared.count("full_attention"), sliding_layers=shared.count("sliding_attention"))
        if shared
        else None,
        hf_architecture=name,
        source=source,
    )
