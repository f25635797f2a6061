"""Structured outputs below the server: compiling and caching grammars, the matchers that follow a
request's committed tokens, and the sampler's bitmask on the rows it constrains."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.structured_output import StructuredOutput
from kvpilot.engine.worker.grammar import GrammarMatchers, Grammars
from kvpilot.engine.worker.sampler import Sampler, SamplingMetadata

EOS = 2


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, 49152, frozenset({EOS}))


def allowed(mask: torch.Tensor, row: int) -> set[int]:
    bits = (mask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


def test_grammars_are_cached_by_spec(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = StructuredOutput.json_schema(schema)
    assert not grammars.cached(spec)
    first = grammars.compile(spec)
    assert grammars.cached(spec)
    assert grammars.compile(StructuredOutput.json_schema(dict(schema))) is first
    # Property order is part of the spec: the grammar writes "b" before "a".
    assert StructuredOutput.json_schema(dict(reversed(list(schema.items())))) != spec


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput("json", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (StructuredOutput("json", "{not json"), "Failed to parse JSON"),
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput("grammar", "root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_bad_specs_are_value_errors_that_say_why(grammars: Grammars, spec: StructuredOutput, says: str) -> None:
    with pytest.raises(ValueError, match="cannot be compiled") as err:
        grammars.compile(spec)
    assert says in str(err.value)
    assert ".cc:" not in str(err.value)  # no C++ source path in a client's message


def test_bad_choice_and_empty_spec_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one choice"):
        StructuredOutput.choice([])
    with pytest.raises(ValueError, match="non-empty regex"):
        StructuredOutput("regex", "")


def test_structured_requests_do_not_speculate() -> None:
    assert SamplingParams().speculable
    assert not SamplingParams(structured=StructuredOutput("json_object")).speculable


def test_matcher_follows_the_requests_committed_tokens(grammars: Grammars, tokenizer) -> None:
    """The mask depends on the tokens the request holds, however often it is built: a step that
    failed (built a mask, committed nothing) leaves the grammar where it was."""
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")
    params = SamplingParams(structured=StructuredOutput("regex", "ab(c|d)"))
    constrained = Request("r", [5, 6], params)
    free = Request("f", [5, 6], SamplingParams())
    matchers = GrammarMatchers(grammars)
    for _ in range(2):
        mask, rows = matchers.bitmask([free, constrained], torch.device("cpu"))
        assert rows == [1]
        assert a in allowed(mask, 1) and b not in allowed(mask, 1)
    constrained.token_ids += [a, b]
    mask, _ = matchers.bitmask([constrained], torch.device("cpu"))
    assert {c, d} <= allowed(mask, 0) and a not in allowed(mask, 0) and EOS not in allowed(mask, 0)
    constrained.token_ids.append(c)
    mask, _ = matchers.bitmask([constrained], torch.device("cpu"))
    assert allowed(mask, 0) == {EOS}
    constrained.token_ids.append(EOS)  # finished grammar, request kept going (ignore_eos): unmasked
    assert matchers.bitmask([constrained], torch.device("cpu")) is None
    matchers.forget(["r"])
    fresh = Request("r", [5, 6], params)
    mask, _ = matchers.bitmask([fresh], torch.device("cpu"))
    assert a in allowed(mask, 0)


def test_sampler_masks_only_the_constrained_rows() -> None:
    vocab = 64
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 5.0  # every row's favourite
    mask = xgrammar.allocate_token_bitmask(3, vocab)
    mask.zero_()
    mask[1, 0] = 1 << 3 | 1 << 9  # row 1 may say 3 or 9
    meta = SamplingMetadata(
        temperature=torch.ones(3),
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        greedy=torch.tensor([True, False, True]),
        all_greedy=False,
        token_bitmask=(mask, [1]),
    )
    sampler = Sampler(torch.Generator().manual_seed(0))
    drawn = {sampler(logits.clone(), meta).tokens[1].item() for _ in range(200)}
    assert drawn == {3, 9}
    assert sampler(logits.clone(), meta).tokens[[0, 2]].tolist() == [7, 7]
