"""What a stream may send of a growing output text, and what it must hold back."""

from __future__ import annotations

from kvpilot.engine.output_processor import TextDeltas


def test_plain_text_streams_as_it_grows() -> None:
    d = TextDeltas(stop=[])
    assert [d.next("Hel", False), d.next("Hello", False), d.next("Hello!", True)] == ["Hel", "lo", "!"]


def test_partial_utf8_is_held_until_complete() -> None:
    d = TextDeltas(stop=[])
    assert d.next("caf", False) == "caf"
    assert d.next("caf\ufffd", False) == ""  # first byte of "é" only
    assert d.next("café", False) == "é"


def test_possible_start_of_a_stop_string_is_held() -> None:
    d = TextDeltas(stop=["END", "xyz"])
    assert d.next("abc E", False) == "abc "
    assert d.next("abc EN", False) == ""
    assert d.next("abc ENo", False) == "ENo"  # not the stop string after all: released
    assert d.next("abc ENo x", False) == " "
    # "xyz" completed: the engine cut the text before it and finished; the held "x" was never sent.
    assert d.next("abc ENo ", True) == ""


def test_finished_text_is_sent_whole() -> None:
    d = TextDeltas(stop=["STOP"])
    assert d.next("ab ST", False) == "ab "
    assert d.next("ab ST\ufffd", True) == "ST\ufffd"
