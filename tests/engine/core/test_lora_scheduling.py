"""The scheduler's share of LoRA: at most max_loras distinct adapters in the running batch (a request
of one more waits while those behind it go on), the adapters named in the stats, and first-block
prefix-cache keys seeded by the adapter."""

from __future__ import annotations

from kvpilot.engine.core.block_pool import hash_block
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.lora.adapter import LoRAAdapter


def adapter(name: str, lora_id: int) -> LoRAAdapter:
    return LoRAAdapter(name, f"/adapters/{name}", 4, 2.0, {}, lora_id)


def test_a_request_of_one_adapter_too_many_waits_and_those_behind_it_go_on():
    a, b = adapter("a", 1), adapter("b", 2)
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(), lora=lora) for i, lora in enumerate([a, b, None, a])]
    for request in requests:
        scheduler.add(request)
    first = [s.request.request_id for s in scheduler.schedule().scheduled]
    assert first == ["r0", "r2", "r3"], "b's request waits; the base and a's second request go on"
    assert [r.request_id for r in scheduler.waiting] == ["r1"]
    stats = scheduler.make_stats()
    assert (stats.running_loras, stats.waiting_loras) == (("a",), ("b",))
    scheduler.finish_requests([requests[0], requests[3]], FinishReason.ABORT)
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["r2", "r1"]


def test_without_lora_the_stats_name_no_adapter():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(Request("r0", [1, 2, 3], SamplingParams()))
    scheduler.schedule()
    assert scheduler.make_stats().running_loras == ()


def test_the_first_block_key_is_seeded_by_the_adapter():
    tokens = [5, 6, 7, 8]
    keys = {hash_block(None, tokens), hash_block(None, tokens, lora_id=1), hash_block(None, tokens, lora_id=2)}
    assert len(keys) == 3
    assert hash_block(None, tokens, "salt", 1) != hash_block(None, tokens, "salt")
    kv = KVCacheManager(16, 4)
    with_a = Request("x", tokens * 3, SamplingParams(), lora=adapter("a", 1))
    base = Request("y", tokens * 3, SamplingParams())
    kv.allocate_slots(base, 12)
    base.num_computed_tokens = 12
    kv.cache_full_blocks(base)
    assert kv.find_cached_prefix(Request("z", tokens * 3, SamplingParams())), "the base model's own blocks hit"
    assert kv.find_cached_prefix(with_a) == [], "an adapter's request found the base model's KV"
