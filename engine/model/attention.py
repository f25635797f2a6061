"""Paged attention over a flat slot cache, in plain PyTorch (SDPA), for any device.

The KV cache of one layer is a [num_slots, kv_heads, head_dim] tensor for K and one for V (each
an allocation of its own: allocate_kv_caches), where slot = block_id * block_size + offset. A
step's tokens are laid out decodes first, then prefill chunks. Decodes (one query token each, or
the last token and its drafts when speculating) are attended in small padded batches of the same
query count and similar context length: one batch padded to the longest context would gather and
attend up to twice the keys. Prefill chunks are attended one sequence at a time, with a causal
mask shifted by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.engine.cpu.kernels import decode_attention


@dataclass
class PrefillChunk:
    start: int  # offset of this chunk's first token in the step's flattened batch
    num_tokens: int
    num_cached: int  # tokens of this sequence already in the cache before the chunk
    slots: torch.Tensor  # [num_cached + num_tokens] cache slots of the whole context, in order


@dataclass
class DecodeGroup:
    start: int  # offset of the group's first token in the step's flattened batch
    slots: torch.Tensor  # [sequences, max_context] context slots, padded
    # [sequences, 1, queries, max_context] True where a query sees a real key; None: every key.
    mask: torch.Tensor | None
    num_queries: int = 1  # tokens per sequence (1 + its drafts), laid out sequence by sequence
    # [sequences] context lengths, set where the group attends through cpu_kernels' attention kernel.
    lengths: torch.Tensor | None = None


# One layer's K and V caches, each [num_slots, kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_caches(
    num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """Zeroed K and V caches for each layer, every one its own allocation: a compiled forward
    writes into them in place, and in-place writes into views of one shared tensor make
    torch.compile copy that whole tensor back on every step."""
    shape = (num_slots, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V go
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim] (already written to the cache). Returns [T, heads, dim].

    On CPU, attention computes in fp32 whatever the cache dtype: PyTorch's CPU SDPA in bf16 is
    several times slower than in fp32 at decode, and fp32 sums are the more accurate anyway."""
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    out = torch.empty_like(q)  # in the model's dtype: each assignment below casts as it copies
    q = q.to(compute)
    for group in meta.decodes:
        sequences, queries = group.slots.shape[0], group.num_queries
        rows = slice(group.start, group.start + sequences * queries)
        if group.lengths is not None:
            out[rows] = decode_attention(q[rows], k_cache, v_cache, group.slots, group.lengths)
            continue
        query = q[rows].view(sequences, queries, *q.shape[1:]).transpose(1, 2)  # [sequences, heads, queries, dim]
        keys = _gather(k_cache, group.slots, compute).transpose(1, 2)  # [sequences, kv_heads, ctx, dim]
        values = _gather(v_cache, group.slots, compute).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, enable_gqa=True)
        out[rows] = attended.transpose(1, 2).reshape(sequences * queries, *q.shape[1:])
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if chunk.num_cached == 0:
            # The whole context is in this chunk: no need to read the cache back.
            keys, values, mask, causal = k[rows].to(compute), v[rows].to(compute), None, True
        else:
            keys, values = _gather(k_cache, chunk.slots, compute), _gather(v_cache, chunk.slots, compute)
            mask = _shifted_causal_mask(chunk.num_tokens, chunk.num_cached, q.device)
            causal = False
        out[rows] = (
            F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=True,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] in `dtype`; index_select over the flattened slots is cheaper than advanced
    indexing on CPU (one contiguous gather kernel instead of advanced indexing's general path;
    bench/history/2026-11-29-engine-offline-throughput.md, "Fused QKV and gate/up projections")."""
    rows = cache.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:]).to(dtype)


def _shifted_causal_mask(num_queries: int, num_cached: int, device: torch.device) -> torch.Tensor:
    """Query i (at position num_cached + i) sees keys 0 .. num_cached + i."""
    q_pos = torch.arange(num_queries, device=device).unsqueeze(1) + num_cached
    k_pos = torch.arange(num_cached + num_queries, device=device).unsqueeze(0)
    return k_pos <= q_pos
