"""One reconcile of an InferenceService at a time, and a burst of its events collapsed into one.

kopf runs the InferenceService handlers and the children's and pods' event handlers in parallel
worker threads. `Reconciles` (one per operator, kept in kopf's memo) gives each InferenceService a
lock, lets an event return at once when a reconcile of the same service is already waiting for
that lock (the waiting one reads the cluster after the event happened, so it covers it), and
remembers the resourceVersion each event reconcile left, so the next event can reconcile from
kopf's index instead of a GET. kopf never retries an event handler, so it also runs a failed
event reconcile again later (`retry`), with backoff, one pending retry per service: no finalizer
and no periodic resync, and an idle cluster still costs no API requests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.operator.controller.reconcile import Refreshed
from kvpilot.operator.kube.indexes import indexed_service

Key = tuple[str, str]


class Reconciles:
    def __init__(self, first_retry_seconds: float = 1.0, last_retry_seconds: float = 60.0) -> None:
        self._locks: dict[Key, threading.Lock] = {}
        self._retries: dict[Key, threading.Timer] = {}
        self._failures: dict[Key, int] = {}
        self.first_retry_seconds, self.last_retry_seconds = first_retry_seconds, last_retry_seconds
        # Services with an event's reconcile waiting for the lock (guarded by _guard).
        self.waiting: set[Key] = set()
        self._guard = threading.Lock()
        # The resourceVersion each InferenceService had when an event's reconcile last left it
        # (after its status write, or as read when nothing changed). Its entry in the services
        # index at that very version is the object as it is (our status fields included: only
        # reconciles, which hold its lock, write them). Any other write (kopf's handler, the
        # autoscaler's status, a spec change) is another version: read.
        self._known_versions: dict[Key, str] = {}

    def lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def forget(self, key: Key) -> None:
        """The service is about to be written by something other than an event's reconcile."""
        self._known_versions.pop(key, None)

    def known(self, services: Mapping[Any, Any] | None, key: Key) -> dict[str, Any] | None:
        """The InferenceService's index entry when it is at the version the last reconcile left."""
        try:
            entry = indexed_service(services or {}, key)
        except RuntimeError:  # kopf's loop changed the index under this worker thread: read instead
            return None
        version = self._known_versions.get(key)
        if entry is None or version is None or entry["metadata"].get("resourceVersion") != version:
            return None
        return dict(entry)

    def collapsed(
        self,
        key: Key,
        services: Mapping[Any, Any] | None,
        reconcile: Callable[[dict[str, Any] | None], Refreshed | None],
    ) -> Refreshed | None:
        """Run `reconcile(known entry or None)` for an event of `key`, unless one is already waiting
        (then None at once). The resourceVersion it left (None: nothing reconciled) is
        remembered; a WriteConflict propagates (whatever changed is an event of its own)."""
        with self._guard:
            if key in self.waiting:
                return None
            self.waiting.add(key)
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            with self._guard:
                # From here on this reconcile reads the cluster: a later event must queue its own.
                self.waiting.discard(key)
            try:
                result = reconcile(self.known(services, key))
            finally:
                self.forget(key)
            if result is not None:
                self._known_versions[key] = result.version
            return result

    def retry(self, key: Key, action: Callable[[], None], delay: float | None = None) -> float | None:
        """Run `action` after `delay` seconds (default: the next backoff step of this service's
        failures, 1 s doubling up to 60 s), unless a retry of `key` is already pending; the delay,
        or None when one was."""
        with self._guard:
            if key in self._retries:
                return None
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
            if delay is None:
                delay = min(self.first_retry_seconds * 2**failures, self.last_retry_seconds)
            timer = threading.Timer(delay, self._fire, (key, action))
            timer.daemon = True
            self._retries[key] = timer
        timer.start()
        return delay

    def succeeded(self, key: Key) -> None:
        """The service reconciled cleanly: its next failure backs off from the first step again."""
        with self._guard:
            self._failures.pop(key, None)

    def _fire(self, key: Key, action: Callable[[], None]) -> None:
        with self._guard:
            self._retries.pop(key, None)
        action()
