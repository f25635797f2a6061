from __future__ import annotations

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request, RequestStatus
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.outputs import ModelRunnerOutput


def make(num_blocks: int = 64, seqs: int = 8, budget: int = 32, block_size: int = 4) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, enable_prefix_caching=False), seqs, budget)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran: advance computed tokens and append a token where due."""
    out = s.schedule()
    due = {
        i.request.request_id: [7]
        for i in out.scheduled
        if i.request.num_computed_tokens + i.num_tokens == i.request.num_tokens
    }
    s.update_from_output(out, ModelRunnerOutput(sampled=due))
    return [(i.request.request_id, i.num_tokens) for i in out.scheduled]


def test_chunked_prefill_respects_token_budget():
    s = make(budget=32)
    s.add(Request("long", list(range(80)), SamplingParams()))
    s.add(Request("short", list(range(10)), SamplingParams()))
    assert run_step(s) == [("long", 32)]
    assert run_step(s) == [("long", 32)]
    assert run_step(s) == [("long", 16), ("short", 10)]
    assert run_step(s) == [("long", 1), ("short", 1)]  # both decoding now


def test_decodes_go_before_new_prefills():
    s = make(budget=8)
    s.add(Request("a", list(range(8)), SamplingParams()))
    run_step(s)
    s.add(Request("b", list(range(20)), SamplingParams()))
    assert run_step(s) == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_running():
    s = make(seqs=2, budget=100)
    for i in range(3):
        s.add(Request(str(i), [1, 2, 3], SamplingParams()))
    assert [rid for rid, _ in run_step(s)] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preempts_newest_when_blocks_run_out_and_recomputes_it():
    s = make(num_blocks=4, budget=100, block_size=4)  # 16 tokens of KV in all
    s.add(Request("old", list(range(7)), SamplingParams()))
    s.add(Request("new", list(range(7)), SamplingParams()))
    run_step(s)  # 2 blocks each: pool full
    for _ in range(1):
        run_step(s)  # 8 tokens each, still fits
    steps = run_step(s)  # "old" needs a 3rd block: "new" is preempted
    assert steps == [("old", 1)]
    assert s.num_preemptions == 1
    new = s.waiting[0]
    assert new.request_id == "new" and new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    s.finish_requests([s.running[0]], FinishReason.STOP)
    assert run_step(s) == [("new", 9)]  # prompt + generated tokens recomputed in one go


def test_finish_frees_blocks():
    s = make()
    r = Request("a", list(range(10)), SamplingParams())
    s.add(r)
    run_step(s)
    s.finish_requests([r], FinishReason.ABORT)
    assert s.kv.pool.num_free_blocks == 64 and not s.has_unfinished() and r.finish_reason is FinishReason.ABORT


def test_update_from_output_appends_several_tokens_and_stops_at_the_first_stop():
    s = make(budget=100)
    r = Request("r", list(range(6)), SamplingParams(max_tokens=10, stop_token_ids=[42]))
    s.add(r)
    out = s.schedule()
    (core,) = s.update_from_output(out, ModelRunnerOutput(sampled={"r": [5, 42, 9]}))  # e.g. a verification step
    assert core.new_token_ids == [5, 42] and core.finish_reason is FinishReason.STOP and core.stop_reason == 42
    assert r.output_token_ids == [5, 42] and r.num_computed_tokens == 6
    assert not s.has_unfinished() and s.kv.pool.num_free_blocks == 64
    assert s.schedule().finished_request_ids == {"r"}  # the runner is told once, then forgets
    assert s.schedule().finished_request_ids == set()


def test_length_and_eos_finish_in_update_from_output():
    s = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 8, 32, max_model_len=9, eos_token_ids={2})
    long = Request("long", list(range(6)), SamplingParams(max_tokens=100, ignore_eos=True))
    eos = Request("eos", list(range(6)), SamplingParams(max_tokens=100))
    s.add(long)
    s.add(eos)
    outs = s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"long": [2, 2, 2, 2], "eos": [3, 2]}))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [
        ([2, 2, 2], FinishReason.LENGTH),
        ([3, 2], FinishReason.STOP),
    ]


def test_stats_report_first_scheduling_once():
    s = make()
    s.add(Request("a", [1, 2, 3], SamplingParams(), arrival_time=0.0))
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"a": [4]}))
    stats = s.make_stats()
    assert [rid for rid, _ in stats.first_scheduled] == ["a"] and stats.first_scheduled[0][1] > 0
    assert stats.num_running == 1 and stats.num_waiting == 0
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"a": [5]}))
    assert s.make_stats().first_scheduled == ()
