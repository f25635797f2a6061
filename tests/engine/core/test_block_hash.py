"""Prefix-cache keys: SHA-256 over the documented byte encoding, and cache salts that keep chains apart.

The expected digests are built here byte by byte from hash_block's docstring, with hashlib only,
so a change of encoding (which would silently change every key) fails these tests.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvpilot.engine.core.block_pool import hash_block
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import SamplingParams


def uint32_le(*ids: int) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def test_first_block_without_salt():
    tokens = [1, 2, 3, 65536]
    expected = hashlib.sha256(b"\x00" + b"\x00" + uint32_le(*tokens)).digest()
    assert hash_block(None, tokens) == expected
    assert isinstance(expected, bytes) and len(expected) == 32
    assert expected.hex() == hashlib.sha256(bytes.fromhex("000001000000020000000300000000000100")).hexdigest()


def test_chained_block():
    first = hash_block(None, [1, 2, 3, 65536])
    tokens = [4, 5, 6, 2**32 - 1]
    expected = hashlib.sha256(b"\x01" + first + uint32_le(*tokens)).digest()
    assert hash_block(first, tokens) == expected


def test_salted_first_block():
    salt = "tenant-é"  # non-ASCII: the length is of the UTF-8 bytes, not of the characters
    salt_bytes = salt.encode("utf-8")
    assert len(salt_bytes) == 9
    tokens = [7, 8]
    expected = hashlib.sha256(b"\x00" + b"\x01" + (9).to_bytes(8, "little") + salt_bytes + uint32_le(*tokens)).digest()
    assert hash_block(None, tokens, salt) == expected
    # The chain under the salt: later blocks carry no salt of their own, only the parent key.
    assert hash_block(expected, [9]) == hashlib.sha256(b"\x01" + expected + uint32_le(9)).digest()


def test_distinct_inputs_give_distinct_keys():
    # No salt, empty salt and a salt that spells tokens are three different keys.
    assert len({hash_block(None, [1]), hash_block(None, [1], ""), hash_block(None, [1], "\x01\x00\x00\x00")}) == 3
    # Moving bytes between the salt and the tokens changes the key (the salt's length is encoded).
    assert hash_block(None, [0x41], "A") != hash_block(None, [0x41, 0x41], "")
    # A token id is 4 bytes, not a variable-length integer.
    assert hash_block(None, [256]) != hash_block(None, [0, 1])
    assert hash_block(None, []) != hash_block(None, [0])


def test_out_of_range_ids_and_misplaced_salt_are_refused():
    with pytest.raises(struct.error):
        hash_block(None, [2**32])
    with pytest.raises(struct.error):
        hash_block(None, [-1])
    parent = hash_block(None, [1])
    with pytest.raises(ValueError):
        hash_block(parent, [2], "salt")  # the salt belongs to the first block only
    with pytest.raises(ValueError):
        hash_block(b"\x00" * 8, [2])  # not a 32-byte key


def req(rid: str, tokens: list[int], salt: str | None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def cached(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None) -> Request:
    """Run a request's prompt through the cache: allocate, 'compute' it all, register its full blocks."""
    r = req(rid, tokens, salt)
    assert kv.allocate_slots(r, len(tokens), kv.find_cached_prefix(r))
    r.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(r)
    return r


def test_salt_chains_differ_in_every_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(12))
    chains = {}
    for salt in (None, "a", "b"):
        r = req(f"r-{salt}", tokens, salt)
        chains[salt] = kv._hashes_for(r, 3)
    for i in range(3):
        assert len({chains[s][i] for s in chains}) == 3, f"block {i}"
    # The first salted key is exactly hash_block's, and the rest chain on it without the salt.
    assert chains["a"][0] == hash_block(None, tokens[:4], "a")
    assert chains["a"][1] == hash_block(chains["a"][0], tokens[4:8])


def test_no_cache_hit_across_salts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))  # three full blocks, one more token to compute
    cached(kv, "owner", tokens, "tenant-a")
    for rid, salt in (("unsalted", None), ("other", "tenant-b"), ("empty", "")):
        assert kv.find_cached_prefix(req(rid, tokens, salt)) == [], salt
    # And the other way round: an unsalted chain is not served to a salted request.
    cached(kv, "public", [100 + t for t in tokens], None)
    assert kv.find_cached_prefix(req("salted", [100 + t for t in tokens], "tenant-a")) == []


def test_same_salt_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    owner = cached(kv, "owner", tokens, "tenant-a")
    hits = kv.find_cached_prefix(req("again", tokens, "tenant-a"))
    assert [b.block_id for b in hits] == kv.block_ids(owner)[:3]
    # Unsalted requests still share with each other.
    first = cached(kv, "u1", [200 + t for t in tokens], None)
    assert [b.block_id for b in kv.find_cached_prefix(req("u2", [200 + t for t in tokens], None))] == kv.block_ids(
        first
    )[:3]
