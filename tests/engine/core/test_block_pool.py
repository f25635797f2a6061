from __future__ import annotations

import pytest

from kvpilot.engine.core.block_pool import BlockPool, hash_block
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and [b.ref_count for b in blocks] == [1, 1, 1]
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_hash_chains_on_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


def test_cached_block_is_evictable_and_reusable():
    pool = BlockPool(2)
    key = hash_block(None, [1, 2, 3])
    (block,) = pool.allocate(1)
    pool.cache(block, key)
    pool.free([block])
    assert pool.num_free_blocks == 2 and pool.lookup(key) is block
    pool.touch([block])  # a later request takes it back from the free list
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # reusing it for new content forgets the hash
    assert pool.lookup(key) is None


def test_prefix_hits_share_blocks_and_count():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10, kv.find_cached_prefix(a))
    kv.record_prefix_lookup(a, 0)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # blocks [0..3] and [4..7] are full
    b = req("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == kv.block_ids(a)[:2]
    assert kv.allocate_slots(b, 3, hits)
    kv.record_prefix_lookup(b, 8)
    b.num_preemptions = 1  # a preempted request coming back was counted when it first arrived
    kv.record_prefix_lookup(b, 8)
    assert [blk.ref_count for blk in hits] == [2, 2]
    assert kv.pool.stats.hits == 8 and kv.pool.stats.queries == 10 + 11
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 8


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8, [])
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = req("b", list(range(8)))
    assert len(kv.find_cached_prefix(b)) == 1  # not 2: the last token must run to give logits


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(12)))
    assert not kv.allocate_slots(a, 12, [])
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.block_tables


def test_lookahead_slots_and_rollback():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(6)))
    assert kv.allocate_slots(a, 6, [])
    a.num_computed_tokens = 6
    # One token to compute plus 4 draft tokens to verify: slots up to token 11, three blocks.
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=4)
    assert len(kv.block_tables["a"]) == 3 and kv.pool.num_free_blocks == 5
    # Only one draft token was accepted: KV is valid for 6 + 1 + 1 tokens, two blocks.
    kv.rollback(a, 8)
    assert len(kv.block_tables["a"]) == 2 and kv.pool.num_free_blocks == 6
    kv.rollback(a, 8)  # idempotent
    assert len(kv.block_tables["a"]) == 2
    kv.free(a)
    assert kv.pool.num_free_blocks == 8


def test_lookahead_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(7)))
    assert kv.allocate_slots(a, 7, [])
    a.num_computed_tokens = 7
    assert not kv.allocate_slots(a, 1, num_lookahead_tokens=4)
    assert len(kv.block_tables["a"]) == 2 and kv.pool.num_free_blocks == 0


def test_rollback_keeps_shared_cached_blocks_for_their_other_user():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9, [])
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    b = req("b", list(range(9)))
    hits = kv.find_cached_prefix(b)
    assert kv.allocate_slots(b, 1, hits)
    kv.rollback(b, 4)  # b keeps its first block only; the second stays with a
    assert [blk.ref_count for blk in hits] == [2, 1]
    assert kv.pool.lookup(hits[1].block_hash) is hits[1]
