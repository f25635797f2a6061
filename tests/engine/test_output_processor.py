"""Stop strings and held-back text: one implementation for the offline API and the server."""

from __future__ import annotations

import itertools
import time

import pytest

from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import EngineCoreOutput
from kvpilot.engine.output_processor import OutputProcessor, find_stop, held_back


@pytest.mark.parametrize("stops", list(itertools.permutations(["is", "Par", "ari"])))
def test_earliest_stop_in_the_text_wins_whatever_the_list_order(stops):
    assert find_stop(" Paris is", list(stops)) == (1, "Par")


def test_stop_search_starts_where_the_last_one_ended_but_catches_straddlers():
    assert find_stop("abcSTOP", ["STOP"], start=5) == (3, "STOP")  # "ST" was already there
    assert find_stop("STOP abc", ["STOP"], start=6) is None  # searched before, and not reported twice


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("abc EN", 6, ["END", "xyz"]) == 2
    assert held_back("abc ENo", 7, ["END"]) == 0
    assert held_back("aaaa", 4, ["aaab"]) == 3


def test_held_back_is_cheap_for_long_stop_strings():
    stops = [("ab" * 50_000) + str(i) for i in range(16)]
    text = "x" * 10_000 + "ab" * 3
    start = time.perf_counter()
    assert held_back(text, len(text), stops) == 6
    assert time.perf_counter() - start < 0.5


def _request(tokenizer, text: str, **params: object) -> Request:
    request = Request("r", [1], SamplingParams(**params))
    request.token_ids += tokenizer.encode(text, add_special_tokens=False)
    return request


def test_a_stop_string_overrides_a_length_finish_and_cuts_the_text(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = _request(tokenizer, " Paris is nice", stop=["is", "Par"])
    processor.add_request(request)
    (out,), stopped, failed = processor.process(
        [EngineCoreOutput(request, request.output_token_ids, FinishReason.LENGTH)]
    )
    assert (out.text_delta, out.finish_reason, out.stop_reason) == (" ", "stop", "Par")
    assert stopped == [] and failed == []  # already finished by the scheduler: nothing more to finish


def test_a_stop_string_in_a_running_request_is_reported_for_finishing(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = _request(tokenizer, " Paris is nice", stop=["nice"])
    processor.add_request(request)
    (out,), stopped, failed = processor.process([EngineCoreOutput(request, request.output_token_ids)])
    assert stopped == [(request, "nice")] and out.text_delta == " Paris is " and out.finish_reason == "stop"


@pytest.mark.parametrize("tokens_per_step", [1, 2, 7])
def test_stop_strings_count_only_after_the_first_min_tokens(tokenizer, tokens_per_step):
    # " Paris is nice" is the first 3 tokens: its "nice" ends in the min_tokens-th token and is
    # ignored (as in vLLM); the one at the end stops the request.
    processor = OutputProcessor(tokenizer)
    request = Request("r", [1], SamplingParams(stop=["nice"], min_tokens=3))
    processor.add_request(request)
    tokens = tokenizer.encode(" Paris is nice and warm, nice", add_special_tokens=False)
    text, stopped = "", []
    for at in range(0, len(tokens), tokens_per_step):
        new = tokens[at : at + tokens_per_step]
        request.token_ids += new
        (out,), stopped, _ = processor.process([EngineCoreOutput(request, new)])
        text += out.text_delta
        if stopped:
            break
    assert stopped == [(request, "nice")] and request.num_output_tokens == 7
    assert text == " Paris is nice and warm, "


def test_a_request_whose_output_cannot_be_made_fails_alone(tokenizer):
    class BrokenTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            if 666 in ids:
                raise OverflowError("out of range integral type conversion attempted")
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    processor = OutputProcessor(BrokenTokenizer())
    good, bad = _request(tokenizer, " Paris"), Request("bad", [1], SamplingParams())
    bad.token_ids.append(666)
    processor.add_request(good)
    processor.add_request(bad)
    outputs, stopped, failed = processor.process(
        [EngineCoreOutput(bad, [666]), EngineCoreOutput(good, good.output_token_ids)]
    )
    assert failed == [bad] and stopped == []
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finish_reason == "abort" and "OverflowError" in by_id["bad"].error
    assert by_id["r"].error is None and by_id["r"].text_delta == " Paris"
