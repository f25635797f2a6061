"""Per-request block tables over the BlockPool, with prefix-cache lookup and registration.

A request's table covers its computed tokens, the tokens being computed this step and, when asked,
lookahead slots for draft tokens that a verification step writes before knowing whether they are
kept; `rollback` gives back the blocks that only rejected tokens used.
"""

from __future__ import annotations

from kvpilot.engine.core.block_pool import Block, BlockHash, BlockPool, hash_block
from kvpilot.engine.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[Block]] = {}
        # Hashes of each request's full blocks, extended as tokens are computed.
        self._block_hashes: dict[str, list[BlockHash]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks matching the start of the request's tokens.

        At least one token is left to compute: the step that computes it produces the logits
        from which the next token is sampled.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_for(request, max_blocks)
        hits: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached: list[Block] | None = None, num_lookahead_tokens: int = 0
    ) -> bool:
        """Make room for `num_new_tokens` (+ `num_lookahead_tokens`) more tokens of KV; False (and no
        change) if blocks run out. `cached` is given on admission: the result of find_cached_prefix."""
        table = self.block_tables.get(request.request_id, [])
        cached = cached or []
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + num_lookahead_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(table) - len(cached)
        # Cached blocks with no other user sit on the free list: taking them shrinks it too.
        num_evictable_hits = sum(1 for b in cached if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return False
        self.pool.touch(cached)
        self.block_tables[request.request_id] = table + cached + self.pool.allocate(max(num_new_blocks, 0))
        return True

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's prompt tokens and its hits (not a preempted request coming back:
        its tokens were counted when it first arrived)."""
        if self.enable_prefix_caching and request.num_preemptions == 0:
            self.pool.stats.queries += request.num_prompt_tokens
            self.pool.stats.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register blocks that became full of computed KV, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        table = self.block_tables[request.request_id]
        hashes = self._hashes_for(request, num_full)
        for block, block_hash in zip(table[:num_full], hashes):
            self.pool.cache(block, block_hash)

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Keep KV for the first `num_tokens` tokens only: blocks past them (written for rejected
        draft tokens, or unused lookahead) go back to the pool. A full block in the prefix cache
        keeps its hash when released: its content is still what the hash says."""
        table = self.block_tables[request.request_id]
        keep = self.blocks_needed(num_tokens)
        if keep < len(table):
            self.pool.free(reversed(table[keep:]))
            self.block_tables[request.request_id] = table[:keep]
        hashes = self._block_hashes.get(request.request_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        # Tail blocks are the least likely to be shared: put them first in line for eviction.
        self.pool.free(reversed(table))
        self._block_hashes.pop(request.request_id, None)

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.block_tables[request.request_id]]

    def _hashes_for(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            # The salt and the adapter go into the first block's key; later blocks inherit them
            # through the parent.
            if i == 0:
                lora_id = request.lora.lora_id if request.lora is not None else None
                hashes.append(hash_block(None, tokens, request.cache_salt, lora_id))
            else:
                hashes.append(hash_block(hashes[-1], tokens))
        return hashes
