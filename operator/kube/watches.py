"""Objects of a few kinds, each listed once and then watched, kept as index entries
(kube/indexes.py) under the keys the operator's kopf indexes use: for the processes that read the
cluster without kopf (the gateway) or beside it (the operator's view of the gateway pods, in a
namespace kopf does not watch).

Each kind is listed and watched in a thread of its own (the Kubernetes client blocks); every change
is applied on the event loop, so a reader there never sees an index change under it. A watch that
ends is resumed from its last resourceVersion; one that expired (410 Gone) or failed lists again. An
idle watch costs no requests."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError

from kvpilot.operator.kube.cluster import api_message
from kvpilot.operator.kube.indexes import index_entry

WATCH_SECONDS = 300
RETRY_SECONDS = 2.0

log = logging.getLogger(__name__)

Entry = Callable[[Mapping[str, Any], str | None], dict[Any, Any]]


class Watched(NamedTuple):
    """One kind to keep: where (all namespaces when None), which (a label selector), keyed how
    (index_entry's key label), and the entry kept of each object."""

    api_version: str
    kind: str
    selector: str | None = None
    key_label: str | None = None
    namespace: str | None = None
    entry: Entry = index_entry


class Index:
    """One kind's index entries, key -> list of entries, changed only on the event loop. `synced`:
    listed at least once; `failure`: why the last list or watch failed, until one succeeds."""

    def __init__(self, watched: Watched) -> None:
        self.kind, self.key_label, self._entry = watched.kind, watched.key_label, watched.entry
        self.entries: dict[Any, list[Any]] = {}
        self._where: dict[str, Any] = {}  # uid -> key
        self.synced = False
        self.failure: str | None = None

    def put(self, obj: Mapping[str, Any]) -> None:
        self.delete(obj)
        uid = obj["metadata"]["uid"]
        for key, entry in self._entry({**obj, "kind": self.kind}, self.key_label).items():
            self.entries[key] = [*self.entries.get(key, []), entry]
            self._where[uid] = key

    def delete(self, obj: Mapping[str, Any]) -> None:
        uid = obj["metadata"]["uid"]
        key = self._where.pop(uid, None)
        if key is None:
            return
        left = [e for e in self.entries.get(key, []) if e["metadata"].get("uid") != uid]
        if left:
            self.entries[key] = left
        else:
            self.entries.pop(key, None)

    def reset(self, items: list[Mapping[str, Any]]) -> None:
        self.entries.clear()
        self._where.clear()
        for item in items:
            self.put(item)
        self.synced, self.failure = True, None

    def failed(self, why: str) -> None:
        self.failure = why

    def values(self) -> list[Any]:
        return [entry for entries in self.entries.values() for entry in entries]


class Watches:
    """One index per watched kind and the threads that keep them."""

    def __init__(self, client: DynamicClient, loop: asyncio.AbstractEventLoop, kinds: Sequence[Watched]) -> None:
        self._client, self._loop = client, loop
        self.indexes = [Index(watched) for watched in kinds]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._keep, args=(index, watched), name=f"watch-{index.kind}", daemon=True)
            for index, watched in zip(self.indexes, kinds, strict=True)
        ]

    def start(self) -> Watches:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def synced(self) -> bool:
        return all(index.synced for index in self.indexes)

    def _on_loop(self, change: Callable[..., None], *args: Any) -> None:
        self._loop.call_soon_threadsafe(change, *args)

    def _keep(self, index: Index, watched: Watched) -> None:
        where = {"label_selector": watched.selector, "namespace": watched.namespace}
        while not self._stop.is_set():
            try:
                resource = self._client.resources.get(api_version=watched.api_version, kind=watched.kind)
                listed = resource.get(**where).to_dict()
                self._on_loop(index.reset, listed.get("items") or [])
                self._follow(resource, index, where, listed["metadata"]["resourceVersion"])
            # A thread that stopped would leave its readers on a stale picture: whatever the failure
            # (the API server away, a token refused, a malformed answer), list again later.
            except Exception as failure:  # noqa: BLE001
                # The API server's own words (its Status message) where it answered.
                why = (
                    api_message(failure)
                    if isinstance(failure, DynamicApiError)
                    else f"{type(failure).__name__}: {failure}"
                )
                log.warning(f"watching {watched.kind}: {why}")
                self._on_loop(index.failed, why)
            self._stop.wait(RETRY_SECONDS)

    def _follow(self, resource: Any, index: Index, where: Mapping[str, Any], version: str) -> None:
        """Apply watch events from `version` on until the watch expires (then return: list again)."""
        while not self._stop.is_set():
            for event in resource.watch(**where, resource_version=version, timeout=WATCH_SECONDS):
                obj = event["raw_object"]
                if event["type"] == "ERROR":
                    return  # 410 Gone: the version is too old to resume from
                version = obj["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK":
                    continue
                self._on_loop(index.delete if event["type"] == "DELETED" else index.put, obj)
                if self._stop.is_set():
                    return
