"""The kopf wiring's settings that decide how the operator lives through API outages."""

from __future__ import annotations

import collections.abc
import itertools

import kopf

from kvpilot.operator.controller import handlers


def test_the_operator_retries_api_errors_for_ever_instead_of_exiting() -> None:
    settings = kopf.OperatorSettings()
    memo = kopf.Memo(cluster=object())
    handlers.configure(settings=settings, memo=memo)
    delays = settings.networking.error_backoffs
    # kopf counts the retries of a sized sequence and stops after them (its default stops at 8).
    assert not isinstance(delays, collections.abc.Sized)
    assert isinstance(delays, collections.abc.Iterable)
    first = list(itertools.islice(iter(delays), 1000))
    assert len(first) == 1000 and first[:3] == [1, 1, 2] and max(first) == first[-1] == 21
    # Every request starts its delays afresh.
    assert list(itertools.islice(iter(delays), 3)) == [1, 1, 2]
