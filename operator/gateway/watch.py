"""What the gateway knows of the cluster: the InferenceServices, and the Deployments, ReplicaSets
and pods the operator manages, each kind listed once and then watched (cluster-wide), kept as
index entries (kube/indexes.py) under the keys the operator's kopf indexes use. The gateway's
process needs no kopf: it handles nothing, it only reads.

Each kind is listed and watched in a thread of its own (the Kubernetes client blocks); every change
is applied on the event loop, so the gateway's handlers never see an index change under them. A
watch that ends is resumed from its last resourceVersion; one that expired (410 Gone) or failed
lists again."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.dynamic import DynamicClient

from kvpilot.operator.api import names
from kvpilot.operator.kube.indexes import index_entry

WATCH_SECONDS = 300
RETRY_SECONDS = 2.0

log = logging.getLogger(__name__)

_SELECTOR = ",".join(f"{k}={v}" for k, v in names.MANAGED_BY.items())
# (api version, kind, label selector, key label) of each index, in the order the gateway takes them.
KINDS = (
    (names.API_VERSION, names.KIND, None, None),
    ("apps/v1", "Deployment", _SELECTOR, None),
    ("apps/v1", "ReplicaSet", _SELECTOR, names.INSTANCE_LABEL),
    ("v1", "Pod", _SELECTOR, names.INSTANCE_LABEL),
)


class Index:
    """One kind's index entries, key -> list of entries, changed only on the event loop."""

    def __init__(self, kind: str, key_label: str | None) -> None:
        self.kind, self.key_label = kind, key_label
        self.entries: dict[Any, list[Any]] = {}
        self._where: dict[str, Any] = {}  # uid -> key
        self.synced = False

    def put(self, obj: Mapping[str, Any]) -> None:
        self.delete(obj)
        uid = obj["metadata"]["uid"]
        for key, entry in index_entry({**obj, "kind": self.kind}, self.key_label).items():
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
        self.synced = True


class Watches:
    """The four indexes and the threads that keep them."""

    def __init__(self, client: DynamicClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client, self._loop = client, loop
        self.indexes = [Index(kind, key_label) for _, kind, _, key_label in KINDS]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._keep, args=(index, version, selector), name=f"watch-{index.kind}", daemon=True
            )
            for index, (version, _, selector, _) in zip(self.indexes, KINDS, strict=True)
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

    def _keep(self, index: Index, api_version: str, selector: str | None) -> None:
        resource = self._client.resources.get(api_version=api_version, kind=index.kind)
        while not self._stop.is_set():
            try:
                listed = resource.get(label_selector=selector).to_dict()
                self._on_loop(index.reset, listed.get("items") or [])
                self._follow(resource, index, selector, listed["metadata"]["resourceVersion"])
            # A thread that stopped would leave the gateway routing on a stale picture: whatever the
            # failure (the API server away, a token refused, a malformed answer), list again later.
            except Exception as failure:  # noqa: BLE001
                log.warning(f"gateway: watching {index.kind}: {type(failure).__name__}: {failure}")
            self._stop.wait(RETRY_SECONDS)

    def _follow(self, resource: Any, index: Index, selector: str | None, version: str) -> None:
        """Apply watch events from `version` on until the watch expires (then return: list again)."""
        while not self._stop.is_set():
            for event in resource.watch(label_selector=selector, resource_version=version, timeout=WATCH_SECONDS):
                obj = event["raw_object"]
                if event["type"] == "ERROR":
                    return  # 410 Gone: the version is too old to resume from
                version = obj["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK":
                    continue
                self._on_loop(index.delete if event["type"] == "DELETED" else index.put, obj)
                if self._stop.is_set():
                    return
