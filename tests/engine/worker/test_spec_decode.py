"""Speculative decoding with prompt-lookup (n-gram) and draft-model drafts: the n-gram lookup, the
rejection rule, and the engine's output with speculation against its output without (greedy
tokens equal, sampled distributions equal), with no KV block left behind."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.core.scheduler import Scheduler, SchedulerOutput, SpecDecodingStats
from kvpilot.engine.model.attention import KVCache
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.worker.sampler import RowPenalty, Sampler, SamplingMetadata, verify_drafts
from kvpilot.engine.worker.spec_decode import DraftInput
from kvpilot.engine.worker.spec_decode.draft_proposer import DraftProposer
from kvpilot.engine.worker.spec_decode.ngram_proposer import NgramProposer
from tests.engine.conftest import make_prompts
from tests.engine.test_exactness import assert_no_leaks
from tests.engine.test_tiny_llama import make_tiny_llama

# Each distribution test fails by chance with this probability (the samples are seeded, so a
# given build passes or fails deterministically; a new build redraws).
FALSE_ALARM_RATE = 1e-3


def chi_square_p_value(counts_a: Counter, counts_b: Counter) -> float:
    """p-value of Pearson's chi-square test that two samples come from one distribution; cells
    expected to hold fewer than 5 samples are pooled into one."""
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    cells = [(counts_a[k], counts_b[k]) for k in counts_a.keys() | counts_b.keys()]
    small = [c for c in cells if (c[0] + c[1]) * min(n_a, n_b) / (n_a + n_b) < 5]
    table = [c for c in cells if c not in small] + ([tuple(map(sum, zip(*small)))] if small else [])
    statistic = 0.0
    for a, b in table:
        total = a + b
        for observed, n in ((a, n_a), (b, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    df = len(table) - 1
    assert df >= 1, "the samples fall into a single cell: nothing to compare"
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


# ---- the proposer --------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(num_tokens=3, min_n=2, max_n=3)
    #                      a  b  c  d  e   a  b  x  y   a  b  c  -> "a b c" matches once: d e a
    assert proposer.lookup([1, 2, 3, 4, 5, 1, 2, 8, 9, 1, 2, 3]) == [4, 5, 1]
    # "x a b" has no earlier match, "a b" has two: the latest wins.
    assert proposer.lookup([1, 2, 3, 4, 1, 2, 7, 9, 1, 2]) == [7, 9, 1]
    assert proposer.lookup([1, 2, 3, 4, 5, 6]) == []  # no repeated suffix
    assert proposer.lookup([5, 1, 2, 6, 1, 2]) == [6, 1, 2]
    assert proposer.lookup([1, 2, 1, 2]) == [1, 2]  # what is there, if fewer than num_tokens
    assert NgramProposer(3, 1, 1).lookup([4, 9, 4]) == [9, 4]


# ---- the rejection rule --------------------------------------------------------------------------


def _sample_many(
    logits: torch.Tensor, rows: int, draft: int | None, penalties: dict[str, float], seed: int, **meta: object
) -> Counter:
    """The token each of `rows` copies of one distribution emits: sampled plainly when `draft` is
    None, else verifying `draft` (the draft when kept, the resampled token when not)."""
    batch = logits.repeat(rows, 1)
    defaults = dict(
        temperature=torch.full((rows,), 0.8),
        top_k=torch.zeros(rows, dtype=torch.long),
        top_p=torch.ones(rows),
        greedy=torch.zeros(rows, dtype=torch.bool),
        all_greedy=False,
    )
    scalar = {"top_k": torch.long, "top_p": torch.float32, "min_p": torch.float32}
    filters = {name: torch.full((rows,), value, dtype=scalar[name]) for name, value in meta.items()}
    output_ids = torch.tensor(PENALIZED_OUTPUT)
    row_penalties = (
        [RowPenalty(row, output_ids, output_ids.unique(), **penalties) for row in range(rows)] if penalties else []
    )
    drafts = torch.full((rows,), draft) if draft is not None else None
    metadata = SamplingMetadata(**(defaults | filters), penalties=row_penalties, draft_token_ids=drafts)
    out = Sampler(torch.Generator().manual_seed(seed))(batch.clone(), metadata)
    emitted = out.tokens if drafts is None else torch.where(out.accepted, drafts, out.tokens)
    return Counter(emitted.tolist())


# Token 1 is the likeliest, token 0 is unlikely, token 6 the least likely: a row that comes out all
# zero after a rejection would emit 0 (argmax of zeros), which the filters mostly drop.
TARGET_LOGITS = torch.tensor([[-0.5, 2.0, 1.5, 1.0, -1.0, 0.5, -3.0]])
PENALIZED_OUTPUT = [1, 1, 3]  # the tokens a penalized row has generated so far
FILTERS = {
    "top-k": dict(top_k=5),
    "top-p": dict(top_p=0.6),
    "min-p": dict(min_p=0.2),
    "top-k+top-p": dict(top_k=3, top_p=0.8),
    "top-p+min-p": dict(top_p=0.9, min_p=0.1),
    "top-k+top-p+min-p+penalties": dict(top_k=5, top_p=0.9, min_p=0.05),
    "top-p-keeps-one": dict(top_p=0.3),
}
PENALTIES = dict(presence=0.3, frequency=0.2, repetition=1.3)


@pytest.mark.parametrize("draft", [1, 3, 6], ids=["likely", "unlikely", "filtered-out"])
@pytest.mark.parametrize("filters", FILTERS)
def test_rejection_sampling_keeps_the_target_distribution(filters, draft):
    """The tokens verification rows emit are distributed as plain sampling's, whatever the filters."""
    rows = 40_000
    penalties = PENALTIES if "penalties" in filters else {}
    plain = _sample_many(TARGET_LOGITS, rows, None, penalties, 1, **FILTERS[filters])
    verified = _sample_many(TARGET_LOGITS, rows, draft, penalties, 2, **FILTERS[filters])
    assert verified.keys() <= plain.keys(), (
        f"verification emitted tokens plain sampling never does: {verified}, {plain}"
    )
    if len(plain) > 1:
        assert chi_square_p_value(plain, verified) > FALSE_ALARM_RATE, (plain, verified)


def test_a_rejected_draft_that_held_all_the_mass_resamples_from_the_target():
    # Token 2 is all of the first row's mass: the residual p - onehot(2) is empty, so the row keeps
    # p rather than a row of zeros (whose exponential race would pick token 0).
    probs = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    drafts = torch.tensor([2, 2, -1])
    _, rows = verify_drafts(probs, drafts, drafts >= 0, torch.Generator().manual_seed(0))
    assert torch.equal(rows, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [0.2, 0.3, 0.5]]))


def test_greedy_verification_keeps_exactly_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    meta = SamplingMetadata(
        temperature=torch.zeros(3),
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        greedy=torch.ones(3, dtype=torch.bool),
        all_greedy=True,
        draft_token_ids=torch.tensor([1, 2, -1]),
    )
    out = Sampler(torch.Generator())(logits, meta)
    assert out.accepted.tolist() == [True, False, False]
    assert out.tokens.tolist() == [1, 1, 0]


# ---- the scheduler's side ------------------------------------------------------------------------


def _decoding_request(prompt_len: int, max_tokens: int) -> tuple[Scheduler, Request]:
    scheduler = Scheduler(KVCacheManager(num_blocks=8, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    request = Request("r", list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelRunnerOutput(sampled={"r": [7]}, spec_token_ids={"r": [8, 9, 10, 11]}))
    return scheduler, request


def test_drafts_are_scheduled_verified_and_rejected_kv_rolled_back():
    scheduler, request = _decoding_request(prompt_len=6, max_tokens=10)
    step = scheduler.schedule()
    (item,) = step.scheduled
    assert item.spec_token_ids == [8, 9, 10, 11] and item.num_tokens == 5  # the last token + 4 drafts
    assert len(item.block_ids) == 3  # 6 prompt + 1 + 4 drafts = 11 slots
    # Two drafts accepted, the third rejected and resampled as 42.
    scheduler.update_from_output(step, ModelRunnerOutput(sampled={"r": [8, 9, 42]}))
    assert request.output_token_ids == [7, 8, 9, 42]
    assert request.num_computed_tokens == 9  # prompt, 7, 8, 9 (42 is computed next step)
    assert (
        len(scheduler.kv.block_tables["r"]) == 3
    )  # 10 tokens (42 has its slot) in blocks of 4; the draft-only tail is gone
    assert scheduler.spec_decoding == SpecDecodingStats(1, 4, 2, (1, 1, 0, 0))
    assert request.spec_token_ids == []


def test_a_stop_inside_the_accepted_drafts_ends_the_computed_tokens_there():
    scheduler = Scheduler(KVCacheManager(num_blocks=8, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    request = Request("r", list(range(100, 108)), SamplingParams(max_tokens=10, stop_token_ids=[8]))
    scheduler.add(request)
    scheduler.update_from_output(
        scheduler.schedule(), ModelRunnerOutput(sampled={"r": [7]}, spec_token_ids={"r": [8, 9, 10, 11]})
    )
    step = scheduler.schedule()
    # Every draft accepted, but the first is a stop token: the sequence ends there.
    scheduler.update_from_output(step, ModelRunnerOutput(sampled={"r": [8, 9, 10, 11, 12]}))
    assert request.output_token_ids == [7, 8] and request.finish_reason is FinishReason.STOP
    assert request.num_computed_tokens == request.num_tokens - 1
    # 10 tokens fill 2 blocks of 4: no third block is in the prefix cache under a 2-token hash.
    assert sum(block.block_hash is not None for block in scheduler.kv.pool.blocks) == 2
    assert scheduler.spec_decoding == SpecDecodingStats(1, 4, 4, (1, 1, 1, 1))
    assert scheduler.kv.pool.num_free_blocks == 8


def test_drafts_are_cut_to_what_max_tokens_and_the_budget_allow():
    scheduler, request = _decoding_request(prompt_len=6, max_tokens=3)
    assert scheduler.schedule().scheduled[0].spec_token_ids == [8]  # 1 output so far: 2 more at most
    scheduler, request = _decoding_request(prompt_len=6, max_tokens=10)
    scheduler.max_num_batched_tokens = 3
    assert scheduler.schedule().scheduled[0].spec_token_ids == [8, 9]


def test_a_preempted_request_drops_its_drafts():
    scheduler, request = _decoding_request(prompt_len=6, max_tokens=10)
    scheduler._preempt(scheduler.running.pop())
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0


# ---- the engine: greedy exactness and distributions ---------------------------------------------

SPEC = dict(speculative="ngram", speculative_max_batch_size=64)
# The proposers, each at its own quality: prompt lookup; the target as its own draft (every draft
# accepted, so each step ends with the bonus token); the target's first 8 of 30 layers as an
# early-exit draft (SmolLM2 was not trained to exit early: drafts are mostly rejected).
PROPOSERS = {
    "ngram": SPEC,
    "draft-model": dict(speculative="draft", draft_model="SmolLM2-135M-Instruct", speculative_max_batch_size=64),
    "early-exit": dict(speculative="draft", draft_layers=8, speculative_max_batch_size=64),
    # Prompt lookup under an acceptance window that backs off for 2 steps at any rejected draft:
    # requests pause, probe and resume throughout, beside prefill chunks and preemptions.
    "ngram-backoff": SPEC
    | dict(speculative_acceptance_window=1, speculative_min_acceptance=1.0, speculative_backoff_steps=2),
}
KV_BYTES_PER_LAYER = 2 * 3 * 64 * 4  # one token, one layer of SmolLM2-135M in fp32
DRAFT_LAYERS = {"ngram": 0, "draft-model": 30, "early-exit": 8, "ngram-backoff": 0}


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_the_same_with_and_without_speculation(corpus_ids, proposer):
    # Prompts share a prefix (prefix caching), prefill in chunks (a small token budget) and do not
    # all fit in the pool at once (preemption); they quote the repeating corpus, so n-grams match.
    prefix = corpus_ids[:64]
    prompts = [prefix + corpus_ids[200 + 37 * i : 200 + 37 * i + n] for i, n in enumerate([8, 60, 120])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    num_blocks = 16  # 256 tokens; the three sequences grow to ~440
    options = dict(dtype="float32", max_num_batched_tokens=64, max_model_len=240)
    plain = [
        o.outputs[0].token_ids
        for o in LLM(**options, kv_cache_memory_bytes=num_blocks * 16 * 30 * KV_BYTES_PER_LAYER).generate(
            prompts, params
        )
    ]
    llm = LLM(
        **options,
        kv_cache_memory_bytes=num_blocks * 16 * (30 + DRAFT_LAYERS[proposer]) * KV_BYTES_PER_LAYER,
        **PROPOSERS[proposer],
    )
    assert llm.engine.kv.pool.num_blocks == num_blocks
    traces = _watch_proposals(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.engine.scheduler.spec_decoding
    assert stats.num_draft_tokens > 0 and llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.pool.stats.hits > 0
    acceptance = stats.num_accepted_tokens / stats.num_draft_tokens
    assert {
        "ngram": acceptance > 0.3,
        "draft-model": acceptance == 1.0,
        "early-exit": acceptance < 0.3,
        "ngram-backoff": acceptance > 0.3,
    }[proposer], acceptance
    if proposer == "ngram-backoff":
        assert any(map(_resumed, traces.values())), traces
    assert_no_leaks(llm)


def _watch_proposals(llm: LLM) -> dict[str, list[tuple[bool, bool]]]:
    """Per request, from now on, each scheduled step's (whether the runner may propose after it,
    whether it verifies drafts)."""
    scheduler = llm.engine.scheduler
    schedule, traces = scheduler.schedule, {}

    def watched() -> SchedulerOutput:
        out = schedule()
        for item in out.scheduled:
            traces.setdefault(item.request.request_id, []).append((item.propose, bool(item.spec_token_ids)))
        return out

    scheduler.schedule = watched
    return traces


def _resumed(trace: list[tuple[bool, bool]]) -> bool:
    """The request backed off, and later verified drafts two steps in a row (a probe that passed)."""
    paused = [i for i, (propose, _) in enumerate(trace) if not propose]
    return bool(paused) and any(trace[i][1] and trace[i + 1][1] for i in range(paused[0], len(trace) - 1))


def test_draft_settings_that_cannot_work_are_refused(tmp_path, model_dir):
    with pytest.raises(ValueError, match="fewer than the model's 30 layers"):
        LLM(speculative="draft", draft_layers=30)
    other = tmp_path / "other-vocab"
    make_tiny_llama(other, model_dir, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLM(speculative="draft", draft_model=str(other))


# The shape of the 16-token models below (the target and the unrelated draft).
TINY16 = dict(vocab_size=16, initializer_range=0.5, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir) -> Path:
    """A random Llama with a 16-token vocabulary: cheap enough to draw thousands of samples."""
    folder = tmp_path_factory.mktemp("tiny16")
    make_tiny_llama(folder, model_dir, **TINY16)
    return folder


def _sample(folder: Path, prompt: list[int], params: SamplingParams, n: int, **options: object) -> tuple[Counter, LLM]:
    llm = LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        ngram_prompt_lookup_min=1,
        ngram_prompt_lookup_max=3,
        num_speculative_tokens=3,
        **options,
    )
    outputs = llm.generate([prompt] * n, params)
    return Counter(tuple(o.outputs[0].token_ids) for o in outputs), llm


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory, model_dir) -> Path:
    """Another random model on the same 16 tokens: a draft that knows nothing of the target."""
    folder = tmp_path_factory.mktemp("tiny16-other")
    make_tiny_llama(folder, model_dir, **TINY16, intermediate_size=96)
    return folder


def _quoting_prompt(folder: Path, base: list[int]) -> list[int]:
    """The model's own continuation of `base`, then `base` again: n-gram drafts copy what it said before."""
    greedy = (
        LLM(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20)
        .generate([base], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    return base + greedy + base


@pytest.mark.parametrize(
    "proposer, drafts", [("ngram", "good"), ("ngram", "poor"), ("draft", "good"), ("draft", "poor")]
)
def test_sampled_output_has_the_same_distribution_with_speculation(tiny_model, other_tiny_model, proposer, drafts):
    rng = random.Random(0)
    base = [rng.randrange(3, 16) for _ in range(12)]
    temperature = 0.7 if drafts == "good" else 1.5  # flatter: fewer drafts match what is sampled
    prompt, options = base, dict(speculative=proposer, speculative_max_batch_size=512)
    if proposer == "ngram" and drafts == "good":
        prompt = _quoting_prompt(tiny_model, base)
    if proposer == "draft":
        options["draft_model"] = str(tiny_model if drafts == "good" else other_tiny_model)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    without, _ = _sample(tiny_model, prompt, params, 3000, seed=1)
    with_spec, llm = _sample(tiny_model, prompt, params, 3000, seed=2, **options)
    stats = llm.engine.scheduler.spec_decoding
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert (rate > 0.3) if drafts == "good" else (rate < 0.15), (
        f"acceptance {rate:.2f} is not what {drafts} drafts make"
    )
    assert chi_square_p_value(without, with_spec) > FALSE_ALARM_RATE
    assert_no_leaks(llm)


def test_sampled_output_under_top_p_and_min_p_has_the_same_distribution_with_speculation(tiny_model):
    # The filters cut a good part of the target's mass here: a draft must be kept with the
    # probability plain sampling gives it after the cut, renormalised. The draft model is the target
    # itself, so its drafts are the target's argmax, the token the cut favours most. After this
    # prompt the filtered target still has several continuations (after `base` alone, one).
    rng = random.Random(0)
    prompt = _quoting_prompt(tiny_model, [rng.randrange(3, 16) for _ in range(12)])
    options = dict(speculative="draft", draft_model=str(tiny_model), speculative_max_batch_size=512)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.6, min_p=0.2, ignore_eos=True)
    without, _ = _sample(tiny_model, prompt, params, 3000, seed=1)
    with_spec, llm = _sample(tiny_model, prompt, params, 3000, seed=2, **options)
    assert llm.engine.scheduler.spec_decoding.num_accepted_tokens > 0
    assert chi_square_p_value(without, with_spec) > FALSE_ALARM_RATE, (without, with_spec)
    assert_no_leaks(llm)


def test_speculative_sampling_under_top_p_emits_only_what_the_nucleus_holds(corpus_ids):
    # Under top_p 0.5 the nucleus is often the draft alone: a rejection there once left nothing to
    # sample from and emitted token 0 (<|endoftext|>, not EOS), which plain sampling never draws here.
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, **SPEC)
    outputs = llm.generate(
        make_prompts(corpus_ids, [64] * 16), SamplingParams(max_tokens=72, temperature=1.0, top_p=0.5)
    )
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    stats = llm.engine.scheduler.spec_decoding
    assert len(tokens) >= 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert tokens.count(0) == 0, f"token 0 in {tokens.count(0)} of {len(tokens)} sampled tokens"
    assert_no_leaks(llm)


def test_requests_that_cannot_speculate_share_steps_with_those_that_do(corpus_ids):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, **SPEC)
    prompt = corpus_ids[:200]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    with_logprobs = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([prompt] * 3, [greedy, penalized, with_logprobs])
    alone = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in alone.generate([prompt] * 3, [greedy, penalized, with_logprobs])
    ]
    assert len(outs[2].outputs[0].logprobs) == 24
    assert llm.engine.scheduler.spec_decoding.num_drafts > 0
    assert_no_leaks(llm)


def test_aborts_mid_speculation_free_every_block(corpus_ids):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, **SPEC)
    engine = llm.engine
    execute = engine.runner.execute
    aborted: list[int] = []

    def execute_then_abort(scheduler_output):
        # Aborts arrive from the server while the forward runs: after it, before the bookkeeping.
        out = execute(scheduler_output)
        with_drafts = [s.request.request_id for s in scheduler_output.scheduled if s.spec_token_ids]
        if with_drafts and not aborted:
            aborted.extend(engine.abort(request_id) is not None for request_id in with_drafts)
        return out

    engine.runner.execute = execute_then_abort
    for i in range(4):
        engine.add_request(
            corpus_ids[i * 50 : i * 50 + 120], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    assert aborted and all(aborted), "no request was aborted while its drafts were verified"
    assert engine.scheduler.spec_decoding.num_drafts > 0
    assert_no_leaks(llm)


def test_a_sequence_as_long_as_the_pool_still_has_its_draft_lookahead(corpus_ids):
    # 4 blocks of 16 slots; a draft writes 4 slots past the tokens, so a sequence may hold 60.
    llm = LLM(dtype="float32", kv_cache_memory_bytes=4 * 16 * (30 + 8) * KV_BYTES_PER_LAYER, **PROPOSERS["early-exit"])
    engine = llm.engine
    assert engine.kv.pool.num_blocks == 4 and engine.max_model_len == 60
    request = engine.add_request(corpus_ids[:56], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(40):
        if not engine.has_unfinished():
            break
        engine.step()
    assert request.is_finished and request.num_tokens == 60 and request.finish_reason.value == "length"
    assert engine.scheduler.spec_decoding.num_drafts > 0
    assert_no_leaks(llm)


def _fresh_draft_kv(
    proposer: DraftProposer, request_id: str, token_ids: list[int], block_ids: list[int]
) -> list[KVCache]:
    """The draft model's K/V of `token_ids` computed in one prefill into an empty cache, slot for slot."""
    fresh = DraftProposer(
        proposer.model,
        len(proposer.kv_caches),
        1,
        proposer.kv_caches[0][0].shape[0],
        proposer.block_size,
        proposer.kv_caches[0][0].dtype,
        proposer.device,
        len(token_ids),  # the whole sequence in one prefill
    )
    fresh.propose([DraftInput(request_id, token_ids, block_ids)])
    return fresh.kv_caches


def _drafted_by(draft: Path) -> dict[str, object]:
    """LLM options: `draft` drafts 3 tokens a step, into blocks of 4 slots, where the newest token often
    lands on a block's first slot, which the rollback of rejected drafts must not free (the draft has
    written that token's K/V there)."""
    return dict(
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        block_size=4,
        speculative="draft",
        draft_model=str(draft),
        num_speculative_tokens=3,
        speculative_max_batch_size=64,
    )


def test_the_draft_models_kv_is_a_fresh_recompute_after_every_step(tiny_model, other_tiny_model):
    llm = LLM(str(tiny_model), **_drafted_by(other_tiny_model))
    engine = llm.engine
    rng = random.Random(0)
    for n in (5, 9, 14):
        engine.add_request(
            [rng.randrange(3, 16) for _ in range(n)], SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)
        )
    checked = 0
    while engine.has_unfinished():
        engine.step()
        checked += _assert_draft_kv_is_fresh(llm)
    stats = engine.scheduler.spec_decoding
    assert checked > 30 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_no_leaks(llm)


def _assert_draft_kv_is_fresh(llm: LLM) -> int:
    """Check that the draft's K/V of every running request's computed tokens is a fresh recompute;
    the number of requests checked."""
    engine, proposer = llm.engine, llm.engine.runner.proposer
    bs = engine.kv.block_size
    for request in engine.scheduler.running:
        block_ids = engine.kv.block_ids(request)
        computed = min(proposer.num_computed.get(request.request_id, 0), len(block_ids) * bs)
        slots = (torch.tensor(block_ids).unsqueeze(1) * bs + torch.arange(bs)).flatten()[:computed]
        fresh = _fresh_draft_kv(proposer, request.request_id, request.token_ids[:computed], block_ids)
        for (k, v), (fresh_k, fresh_v) in zip(proposer.kv_caches, fresh):
            torch.testing.assert_close((k[slots], v[slots]), (fresh_k[slots], fresh_v[slots]), rtol=1e-4, atol=1e-4)
    return len(engine.scheduler.running)


@pytest.mark.parametrize("failing_forward", [0, 1], ids=["catch-up", "second-draft"])
def test_a_step_whose_draft_fails_is_rerun_request_by_request_from_a_clean_state(
    tiny_model, other_tiny_model, failing_forward
):
    options = _drafted_by(other_tiny_model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 16) for _ in range(n)] for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_model), **options).generate(prompts, params)]
    llm = LLM(str(tiny_model), **options)
    proposer = llm.engine.runner.proposer
    propose, argmax, forwards = proposer.propose, proposer._argmax, []

    def counted(sequences: list[DraftInput]) -> dict[str, list[int]]:
        forwards.clear()
        return propose(sequences)

    def flaky(hidden: torch.Tensor, rows: list[int]) -> list[int]:
        # Drafting for more than one request fails at one forward: every batched step is rerun
        # request by request.
        forwards.append(rows)
        if len(rows) > 1 and len(forwards) == failing_forward + 1:
            raise RuntimeError("draft kernel fault")
        return argmax(hidden, rows)

    proposer.propose, proposer._argmax = counted, flaky
    requests = [llm.engine.add_request(p, params) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
        _assert_draft_kv_is_fresh(llm)
    assert [r.finish_reason.value for r in requests] == ["length"] * 3
    assert [r.output_token_ids for r in requests] == reference
    assert llm.engine.scheduler.spec_decoding.num_drafts > 0
    assert_no_leaks(llm)


def test_the_draft_catch_up_stays_within_the_token_budget(tiny_model):
    """Prompts of 40 and 37 tokens under max_num_batched_tokens=16: the draft model catches up in
    forwards of at most 16 tokens over several steps (it drafts once caught up), its KV computed
    in chunks is right (the target as its own draft gets every draft accepted), and the output is
    plain greedy decoding's."""
    options = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=4, max_num_batched_tokens=16)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 16) for _ in range(n)] for n in (40, 37)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_model), **options).generate(prompts, params)]
    llm = LLM(
        str(tiny_model),
        speculative="draft",
        draft_model=str(tiny_model),
        num_speculative_tokens=3,
        speculative_max_batch_size=64,
        **options,
    )
    draft = llm.engine.runner.proposer.model
    assert draft is not llm.engine.runner.model
    forward, sizes = draft.forward, []

    def counted(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        sizes.append(input_ids.shape[0])
        return forward(input_ids, *args)

    draft.forward = counted
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.scheduler.spec_decoding
    assert sizes and max(sizes) <= 16, sizes
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_no_leaks(llm)


@pytest.mark.parametrize("draft", ["target", "unrelated"])
def test_requests_stop_proposing_while_their_drafts_are_rejected(tiny_model, other_tiny_model, draft):
    """Greedy, under the default acceptance window: the target drafting for itself (every draft
    accepted) proposes after every step that samples; an unrelated model's drafts are mostly
    rejected, and its requests back off. The runner proposes for no request the scheduler holds
    back, and the output is plain greedy decoding's either way."""
    options = _drafted_by(tiny_model if draft == "target" else other_tiny_model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 16) for _ in range(n)] for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_model), **(options | dict(speculative="off")))
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_model), **options)
    engine, proposer = llm.engine, llm.engine.runner.proposer
    traces, propose = _watch_proposals(llm), proposer.propose
    proposals, sampling_steps = Counter(), Counter()

    def counted(sequences: list[DraftInput]) -> dict[str, list[int]]:
        ids = [s.request_id for s in sequences]
        held_back = {i for i in ids if not traces[i][-1][0]}
        assert not held_back, f"the runner proposed for {held_back}, which the scheduler held back"
        proposals.update(ids)
        return propose(sequences)

    proposer.propose = counted
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        sampling_steps.update(o.request_id for o in engine.step() if o.new_token_ids)
    assert [r.output_token_ids for r in requests] == reference
    stats = engine.scheduler.spec_decoding
    if draft == "target":
        assert proposals == sampling_steps and stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert all(proposals[r.request_id] < sampling_steps[r.request_id] / 2 for r in requests), (
            proposals,
            sampling_steps,
        )
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2
    assert engine.scheduler.acceptance == {}
    assert_no_leaks(llm)
