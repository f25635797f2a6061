"""Waiting with a deadline instead of sleeping a guessed time.

The one polling loop of the repository: the e2e harness, tests/server and the benchmarks all wait
through `poll` (tests/server's `wait_until` is a thin wrapper over it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.5) -> T:
    """Call `check` until it returns something other than None or False, and return that; raise
    TimeoutError naming `what` after `timeout_s`. An exception from `check` propagates at once
    (that is how a check fails fast, e.g. when the process it waits for has exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout_s:g}s: {what}")
        time.sleep(interval_s)
