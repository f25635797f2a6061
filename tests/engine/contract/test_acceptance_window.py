"""The per-request acceptance window of speculative decoding, through the scheduler: a request
whose drafts are rejected stops proposing after its window, one whose drafts are accepted keeps
proposing, and a backed-off request probes again and resumes when its drafts are accepted.

The runner's side of the contract is played here as the model runner plays it: after a step that
sampled, it proposes drafts only for requests whose scheduled step says `propose`, and the step
verifies what was scheduled (the engine-level tests in test_spec_decode.py run the real runner).
"""

from __future__ import annotations

from kvpilot.engine import SamplingParams
from kvpilot.engine.contract.acceptance_window import AcceptancePolicy, AcceptanceWindow
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.outputs import ModelRunnerOutput

POLICY = AcceptancePolicy(window=4, min_acceptance=0.5, backoff_steps=16)
DRAFTS = [11, 12, 13, 14]
REJECTED = 99  # the token a step samples in place of a rejected first draft


def _run(accepts: list[bool], policy: AcceptancePolicy = POLICY) -> list[tuple[bool, bool]]:
    """One request for len(accepts) steps; a verification step accepts all its drafts or none, as
    `accepts[step]` says. Per step: (whether the runner proposed after it, whether it verified drafts)."""
    scheduler = Scheduler(
        KVCacheManager(num_blocks=256, block_size=16), 4, 64, max_model_len=4096, acceptance_policy=policy
    )
    request = Request("r", list(range(100, 110)), SamplingParams(max_tokens=2000))
    scheduler.add(request)
    trace = []
    for accept in accepts:
        step = scheduler.schedule()
        (item,) = step.scheduled
        sampled = [*item.spec_token_ids, 7] if accept else [REJECTED]
        proposed = item.propose
        drafts = {"r": list(DRAFTS)} if proposed else {}
        scheduler.update_from_output(step, ModelRunnerOutput(sampled={"r": sampled}, spec_token_ids=drafts))
        trace.append((proposed, bool(item.spec_token_ids)))
    assert not request.is_finished
    return trace


def test_a_request_whose_drafts_are_all_rejected_stops_proposing_after_its_window():
    trace = _run([False] * 60)
    proposals = [step for step, (proposed, _) in enumerate(trace) if proposed]
    verified = [step for step, (_, drafts) in enumerate(trace) if drafts]
    # Step 0 (the prefill) and the next four propose; steps 1-4 verify, and the fourth rejection
    # drops what step 4 proposed. 16 steps without drafts, then a probe is proposed (step 21),
    # verified (22) and rejected: 16 more steps of back-off, and so on.
    assert verified == [1, 2, 3, 4, 22, 40, 58]
    assert proposals == [0, 1, 2, 3, 4, 21, 22, 39, 40, 57, 58]


def test_a_request_whose_drafts_are_accepted_keeps_proposing():
    trace = _run([True] * 40)
    assert all(proposed for proposed, _ in trace)
    assert all(drafts for _, drafts in trace[1:])


def test_a_probing_request_resumes_when_its_drafts_are_accepted_again():
    trace = _run([False] * 21 + [True] * 20)
    verified = [step for step, (_, drafts) in enumerate(trace) if drafts]
    # Backed off after step 4; the probe verified at step 22 is accepted: drafts every step after.
    assert verified == [1, 2, 3, 4, *range(22, 41)]
    assert all(proposed for proposed, _ in trace[21:])


def test_the_window_judges_its_drafts_together_and_min_acceptance_0_never_backs_off():
    window = AcceptanceWindow(POLICY)
    for accepted in (4, 0, 0, 1):  # 5 of 16: under half, once the window is full
        assert window.proposes
        window.record(4, accepted)
    assert not window.proposes and window.paused_steps == 16
    mixed = AcceptanceWindow(POLICY)
    for accepted in (4, 0) * 4:  # always half of the last four steps' drafts
        mixed.record(4, accepted)
        assert mixed.proposes
    never = AcceptanceWindow(AcceptancePolicy(window=1, min_acceptance=0.0, backoff_steps=16))
    never.record(4, 0)
    assert never.proposes


def test_a_finished_request_leaves_no_window_behind():
    scheduler = Scheduler(KVCacheManager(num_blocks=8, block_size=4), 4, 64, acceptance_policy=POLICY)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3))
    scheduler.add(request)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled={"r": [5]}, spec_token_ids={"r": [6]}))
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled={"r": [9]}))
    assert "r" in scheduler.acceptance
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled={"r": [9]}))
    assert request.is_finished and scheduler.acceptance == {}
