"""Fixed-size KV blocks: free list, reference counts and the prefix-cache hash map.

A block whose reference count drops to zero goes back on the free list but keeps its hash, so a
later request with the same prefix can take it back ("evictable cached block"). Only when the free
list hands it out for new content is its hash forgotten.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A block's key in the prefix cache: the 32-byte SHA-256 digest below.
BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None, lora_id: int | None = None
) -> BlockHash:
    """Key of a full block: SHA-256 over its parent's key, the request's cache salt and LoRA adapter
    (first block only) and its token ids, so equal blocks match only under equal prefixes, equal
    salts and the same adapter (an adapter changes every layer's K and V).

    A cryptographic hash, not Python's hash(): hash() of an int tuple is the same in every process,
    so a colliding prompt can be searched for offline and would be served another request's KV
    (the class of vLLM's CVE-2025-25183). The digest is taken over exactly these bytes:

        first block:   b"\x00" + salt + tokens                       base model
                       b"\x02" + adapter + salt + tokens             a LoRA adapter's request
        later blocks:  b"\x01" + parent + tokens
          adapter = lora_id.to_bytes(8, "little")                the adapter's registration id
          salt   = b"\x00"                                   no cache_salt
                 | b"\x01" + len(s).to_bytes(8, "little") + s  s = cache_salt.encode("utf-8")
          parent = the parent block's 32-byte key
          tokens = each token id as a little-endian uint32 (struct "<I"), in order

    No two different inputs give the same bytes: the first byte says which header follows, every
    header has a fixed or explicitly stated length (so no salt is a prefix of another, and no salt
    equals None), and the tokens fill the rest at a fixed 4 bytes each, so their count and values
    read back unambiguously. Token ids outside [0, 2**32) cannot be encoded and raise struct.error
    rather than wrap (vocabularies are far below 2**32). The salt goes into the first block only:
    it reaches every later block through the parent key, and so does the adapter.
    """
    if parent is None:
        first = b"\x00" if lora_id is None else b"\x02" + lora_id.to_bytes(8, "little")
        if cache_salt is None:
            header = first + b"\x00"
        else:
            salt = cache_salt.encode("utf-8")
            header = first + b"\x01" + len(salt).to_bytes(8, "little") + salt
    else:
        if cache_salt is not None or lora_id is not None:
            raise ValueError(
                "cache_salt and lora_id are mixed into the first block only; later blocks inherit them from the "
                "parent key"
            )
        if len(parent) != 32:
            raise ValueError(f"a parent key is a 32-byte SHA-256 digest, got {len(parent)} bytes")
        header = b"\x01" + parent
    return hashlib.sha256(header + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up in the cache
    hits: int = 0  # of those, tokens served from cached blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: least recently freed blocks are reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Register a block whose KV is now complete under its content hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Same content computed twice (two requests prefilling the same prefix in one step):
            # keep the first, this one simply stays private.
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id
