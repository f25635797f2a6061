"""The operator's work queue of InferenceService keys, as controller-runtime's reconcilers have one.

Every event (the service's own, its children's, its pods') only adds the service's key; workers take
keys and reconcile them. A key is in the queue at most once, so a burst of events collapses into one
reconcile, and it is never reconciled by two workers at once: an event that comes while its key is
being reconciled marks it dirty, and it is queued again when that reconcile ends (the one running
may have read the cluster before the event). Retries are the same queue: `add_after` (a status no
event will change, tried again later) and `add_rate_limited` (a failed reconcile: 1 s doubling up to
60 s per key, reset by `forget` after a clean one). asyncio only: no threads, no timers of its own.
"""

from __future__ import annotations

import asyncio

Key = tuple[str, str]


class WorkQueue:
    def __init__(self, first_retry_seconds: float = 1.0, last_retry_seconds: float = 60.0) -> None:
        self.first_retry_seconds, self.last_retry_seconds = first_retry_seconds, last_retry_seconds
        self._ready: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()  # in _ready, not yet taken
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()  # added while processing: queued again by done()
        self._later: dict[Key, asyncio.TimerHandle] = {}
        self._failures: dict[Key, int] = {}

    def add(self, key: Key) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        """Add `key` after `delay` seconds, unless an earlier add of it is already pending."""
        loop = asyncio.get_running_loop()
        pending = self._later.get(key)
        if pending is not None and pending.when() <= loop.time() + delay:
            return
        if pending is not None:
            pending.cancel()
        self._later[key] = loop.call_later(delay, self._fire, key)

    def add_rate_limited(self, key: Key) -> float:
        """Add `key` after its next backoff step; the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self.first_retry_seconds * 2**failures, self.last_retry_seconds)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Key) -> None:
        """`key` reconciled cleanly: its next failure backs off from the first step again."""
        self._failures.pop(key, None)

    async def get(self) -> Key:
        key = await self._ready.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Key) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def later(self, key: Key) -> float | None:
        """Seconds until `key` is added by `add_after`, None when no such add is pending."""
        pending = self._later.get(key)
        return None if pending is None else max(0.0, pending.when() - asyncio.get_running_loop().time())

    def pending(self) -> int:
        """Keys waiting to be reconciled now (not those added for later)."""
        return len(self._queued)

    def _fire(self, key: Key) -> None:
        self._later.pop(key, None)
        self.add(key)
