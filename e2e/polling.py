"""Waiting with a deadline instead of sleeping a guessed time, and loops that run beside a test.

The one polling loop of the repository: the e2e harness, tests/server and the benchmarks all wait
through `poll` (tests/server's `wait_until` is a thin wrapper over it). `Background` is the one
way a test runs something in a thread for the length of a `with` block (load, pod runner,
timeline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Self, TypeVar

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


class Background:
    """A context manager that runs `loop()` in a daemon thread for the length of its block: `loop`
    returns once `stopping` is set (on leaving the block), then `close()` releases what it used."""

    def __init__(self, name: str) -> None:
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.loop, name=name, daemon=True)

    def loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """What to release after the loop has stopped (nothing by default)."""

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self._thread.join()
        self.close()
