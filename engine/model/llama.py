"""Llama-family decoder (RMSNorm, RoPE with the model's scaling, GQA, SwiGLU) over paged attention.

Module and parameter names follow HuggingFace's LlamaForCausalLM so its checkpoints load as they
are; the forward takes one flattened batch of tokens from many sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvpilot.engine.model.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kvpilot.engine.model.layers import Embedding, FusedLinear, Linear, RMSNorm
from kvpilot.engine.model.quantization import LinearQuantization, for_scheme


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1): rolling x by half
    its width gives cat(x2, x1), and the sign sits in `signed_sin` = cat(-sin1, sin2), made once per
    step. Four ops per layer instead of seven."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, quantization: LinearQuantization | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, quantization)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias, quantization)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split(
            [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        # RoPE on q and k as one tensor of heads: one set of ops per layer instead of two.
        qk = _rope(qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, quantization: LinearQuantization | None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        sizes = {"gate": config.intermediate_size, "up": config.intermediate_size}
        self.gate_up_proj = FusedLinear(config.hidden_size, sizes, bias, quantization)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, quantization: LinearQuantization | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, quantization)
        self.mlp = MLP(config, quantization)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBackbone(nn.Module):
    def __init__(self, config: LlamaConfig, quantization: LinearQuantization | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, quantization) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)


def kv_shape(model: LlamaForCausalLM) -> tuple[int, int]:
    """KV heads and head size of one layer's cache."""
    attn = model.model.layers[0].self_attn
    return attn.num_kv_heads, attn.head_dim


class LlamaForCausalLM(nn.Module):
    # Checkpoint module -> (our fused module, its shard): route() maps their tensors.
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        config: LlamaConfig,
        quantization: str = "none",
        quantization_group_size: int = 32,
        integer_kernels: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        body, head = for_scheme(quantization, quantization_group_size, integer_kernels)
        self.model = LlamaBackbone(config, body)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, head)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def route(cls, name: str) -> tuple[str, str | None]:
        """The parameter a checkpoint tensor fills, and its shard when that parameter is fused:
        `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, `k`)."""
        for part, (fused, shard) in cls.packed_modules.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flattened batch; kv_caches holds each layer's K and V.
        With caches for fewer layers than the model, only that many layers run, then the final
        norm: the early exit a self-speculative draft takes. Callers run it in inference mode
        (not set here: torch.compile traces this function as it is)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(h, positions.unsqueeze(0))
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # the sign of rotate_half, see _rope
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, dim], broadcast over heads
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
