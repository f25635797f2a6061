"""kopf wiring: thin handlers that only queue the InferenceService's key, and the workers that
reconcile the keys of the queue (controller/queue.py), as controller-runtime's reconcilers do.

Importing this module registers the handlers in kopf's default registry (`kvpilot operator`
does); all decisions live in the pure modules, all API calls in `cluster.KubeCluster`. There is one
reconcile path: the service's create, update and resume, its status changes that ask for a re-plan,
and every event of its children and engine pods add its key; a worker reads the service (from kopf's
index when that is the version the last reconcile left, else from the API server), reconciles it and
writes its status when it changed. Failures and statuses that no event will change go back into the
same queue after a delay; a burst of events collapses into one reconcile.

No handler here makes kopf put a finalizer on InferenceServices (kopf adds one only for timers,
daemons and non-optional on.delete handlers; the workers and the autoscaler are asyncio tasks
started on startup instead), so `kubectl delete` never waits for the operator: the children go by
their owner references (garbage collection). Instead of a periodic resync, the operator watches its
children (Deployments, Services, PodDisruptionBudgets, NetworkPolicies and API-key Secrets labelled
as managed by it; not InferencePools, whose CRD is optional): a change or deletion of one reconciles
its owner, so Ready follows the pods within seconds, a child deleted by hand comes back at once, and
an idle cluster costs no API requests. A Service or PDB event whose object is as rendered queues
nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.names import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import status_of
from kvpilot.operator.controller import correction, render
from kvpilot.operator.controller.last_handled import DigestDiffBaseStorage
from kvpilot.operator.controller.queue import Key, WorkQueue
from kvpilot.operator.controller.reconcile import (
    BACKED_OFF,
    Refreshed,
    as_rendered,
    controller_of,
    full_retry_in,
    refresh,
    retry_reason,
)
from kvpilot.operator.hub.client import DEFAULT_ENDPOINT, HubClient
from kvpilot.operator.kube.cluster import KubeCluster, WriteConflict
from kvpilot.operator.kube.indexes import indexed_service, pod_ready

# kopf's bookkeeping annotations, under our own domain instead of kopf.zalando.org.
ANNOTATION_PREFIX = GROUP
# Set by the chart from its engine.image value: the engine image for specs without spec.image.
ENGINE_IMAGE_ENV = "KVPILOT_ENGINE_IMAGE"
# A blocked InferenceService (a same-named object of someone else, a write the API server refused)
# is tried again this often: the object in the way carries no label of ours, so no event says
# when it is gone.
BLOCKED_RETRY_SECONDS = 60.0
BLOCKED = ("NameConflict", "ApplyFailed")
# A spec without accelerator.type that found no GPU on the nodes (the GPU pool scaled to zero, say)
# is planned again this often: nothing watches nodes, so no event says when GPUs are back.
NO_GPU_RETRY_SECONDS = 60.0
# Services reconciled at once (each in a thread of its own: the API client blocks); one service is
# never reconciled by two.
WORKERS = 4


def engine_image(environ: Mapping[str, str]) -> str:
    """The operator's default engine image: the environment's, else the built-in one."""
    return environ.get(ENGINE_IMAGE_ENV) or render.DEFAULT_ENGINE_IMAGE


# Logged once per reconcile (bench/operator_scale.py counts it).
REFRESHED = "Reconciled InferenceService"


def _retry_seconds(reason: str) -> float:
    """How long a status no event will change waits before its reconcile runs again."""
    return BLOCKED_RETRY_SECONDS if reason in BLOCKED else NO_GPU_RETRY_SECONDS


class Reconciler:
    """The workers of the queue: each takes a key, reconciles it, and puts it back when it must run
    again. It remembers the resourceVersion each reconcile left the InferenceService at (after its
    status write, or as read when nothing changed): its entry in kopf's index at that very version is
    the object as it is, and a GET is saved; any other write (kopf's bookkeeping, the autoscaler's
    status, a spec change) is another version, which is read."""

    def __init__(
        self,
        cluster: KubeCluster,
        services: Mapping[Any, Any] | None,
        logger: logging.Logger,
        default_image: str,
        operator_namespace: str | None,
        hub: HubClient | None = None,
        gpu_prices: Mapping[str, float] | None = None,
        capacity_classes: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.queue = WorkQueue()
        self.cluster, self.services, self.logger, self.hub = cluster, services, logger, hub
        self.gpu_prices = dict(gpu_prices or {})
        self.capacity_classes = {name: dict(labels) for name, labels in (capacity_classes or {}).items()}
        self.default_image, self.operator_namespace = default_image, operator_namespace
        self._versions: dict[Key, str] = {}
        self._workers: list[asyncio.Task[None]] = []

    def start(self, workers: int = WORKERS) -> None:
        self._workers = [asyncio.create_task(self._work(), name=f"kvpilot-reconcile-{i}") for i in range(workers)]

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with suppress(asyncio.CancelledError):
                await task

    def _known(self, key: Key) -> dict[str, Any] | None:
        entry = indexed_service(self.services or {}, key)
        if entry is None or entry["metadata"].get("resourceVersion") != self._versions.get(key):
            return None
        return dict(entry)

    async def _work(self) -> None:
        while True:
            await self.reconcile_next()

    async def reconcile_next(self) -> Key:
        """Take the next key (waiting for one), reconcile it, and return it."""
        key = await self.queue.get()
        try:
            await self._reconcile(key)
        finally:
            self.queue.done(key)
        return key

    async def _reconcile(self, key: Key) -> None:
        namespace, name = key
        known = self._known(key)
        self._versions.pop(key, None)
        try:
            result: Refreshed | None = await asyncio.to_thread(
                refresh,
                self.cluster,
                namespace,
                name,
                datetime.now(UTC),
                default_image=self.default_image,
                operator_namespace=self.operator_namespace,
                known=known,
                hub=self.hub,
                gpu_prices=self.gpu_prices,
                capacity_classes=self.capacity_classes,
            )
        except WriteConflict as error:
            # Something changed it meanwhile: read again, soon.
            self.logger.debug(f"{namespace}/{name} changed while reconciling: {error}")
            self.queue.add_rate_limited(key)
            return
        except Exception as error:  # noqa: BLE001 - the API server failing (500, 429, a timeout) must not end the retries
            delay = self.queue.add_rate_limited(key)
            self.logger.warning(f"reconcile of {namespace}/{name} failed, again in {delay:g} s: {error}")
            return
        if result is None:  # gone, or being deleted
            self.queue.forget(key)
            return
        self._versions[key] = result.version
        self.logger.info(f"{REFRESHED} {namespace}/{name}")
        ready = result.status.condition("Ready")
        if ready is not None:
            self.logger.debug(f"{namespace}/{name} Ready={ready.status} ({ready.reason}): {ready.message}")
        retry = retry_reason(result.status)
        if retry is not None and retry[0] in BACKED_OFF:
            delay = self.queue.add_rate_limited(key)
        else:
            self.queue.forget(key)
            if retry is None:
                full = full_retry_in(result.status, datetime.now(UTC), result.any_gpu)
                if full is not None:
                    self.queue.add_after(key, full)
                return
            delay = _retry_seconds(retry[0])
            self.queue.add_after(key, delay)
        self.logger.debug(f"{namespace}/{name}: {retry[0]}, reconciled again in {delay:g} s")


class ApiRetryDelays:
    """kopf's delays between retries of a failed API request (5xx, 429, connection errors), never
    running out. kopf gives up after as many retries as a sized sequence holds (its default: 8, about
    54 s), and then its watchers, and with them the operator, exit: measured with the fault-injection
    proxy, 75 s of 500s ended the process 10 s after the API server recovered. An unsized iterable
    it retries for ever, so an outage only pauses the operator."""

    def __iter__(self) -> Iterator[float]:
        return itertools.chain((1, 1, 2, 3, 5, 8, 13), itertools.repeat(21))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.networking.error_backoffs = ApiRetryDelays()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # Per-object memos are shallow copies of this one, so every handler sees the one client (which
    # `kvpilot operator` builds, else it is built here).
    if memo.get("cluster") is None:
        memo.cluster = KubeCluster.connect()


@kopf.on.startup()
async def start_reconciler(memo: kopf.Memo, logger: logging.Logger, autoscaled_services: kopf.Index, **_: Any) -> None:
    """The queue and its workers, once (kopf may run a startup handler again after another failed).
    The engine image and the operator's namespace are read here, once, so reconciling stays a
    function of the object and these values."""
    if memo.get("reconciler") is not None:
        return
    memo.reconciler = Reconciler(
        memo.cluster,
        autoscaled_services,
        logger,
        engine_image(os.environ),
        os.environ.get(names.OPERATOR_NAMESPACE_ENV) or None,
        # Where model configs are read when a service's env names no HF_ENDPOINT of its own.
        HubClient(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT),
        memo.get("gpu_prices"),
        memo.get("capacity_classes"),
    )
    memo.reconciler.start()


@kopf.on.cleanup()
async def stop_reconciler(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("reconciler") is not None:
        await memo.reconciler.stop()


def _queue(memo: kopf.Memo, namespace: str, name: str) -> None:
    memo.reconciler.queue.add((namespace, name))


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def reconcile_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _queue(memo, body["metadata"]["namespace"], body["metadata"]["name"])


@kopf.on.event(GROUP, VERSION, PLURAL)
async def correction_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A status the autoscaler wrote may hold a new PlanAccurate verdict, after which the plan's
    replicas are chosen with another correction (controller/correction.py): re-plan then. A status
    change is no update for kopf's handlers above (its essence leaves status out)."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return
    if body["metadata"].get("deletionTimestamp") or not correction.stale(status_of(body), spec):
        return
    _queue(memo, body["metadata"]["namespace"], body["metadata"]["name"])


@kopf.on.event("v1", "pods", labels=names.MANAGED_BY)
async def pod_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """An engine pod changed (scheduled, crash-looping, ready), or an inspection Job's pod ended: its
    InferenceService's status may have a new reason or a checkpoint's config. Engine pods are owned
    by ReplicaSets, so the owner comes from the instance label."""
    name = (body["metadata"].get("labels") or {}).get(names.INSTANCE_LABEL)
    ended = (body.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    if not name or body["metadata"].get("deletionTimestamp") or (pod_ready(body) and not ended):
        # A running pod becoming ready or going away changes its Deployment's status, whose own event
        # reconciles; only a pod stuck before ready, or an inspection Job's ended pod (whatever
        # its Ready condition says), has something to add.
        return
    _queue(memo, body["metadata"]["namespace"], name)


@kopf.on.event("apps/v1", "deployments", labels=names.MANAGED_BY)
@kopf.on.event("v1", "services", labels=names.MANAGED_BY)
@kopf.on.event("policy/v1", "poddisruptionbudgets", labels=names.MANAGED_BY)
@kopf.on.event("networking.k8s.io/v1", "networkpolicies", labels=names.MANAGED_BY)
@kopf.on.event("v1", "secrets", labels=names.MANAGED_BY)
async def child_handler(body: kopf.Body, memo: kopf.Memo, type: str | None = None, **_: Any) -> None:
    owner = controller_of(body)
    if owner is None or (owner.get("apiVersion"), owner.get("kind")) != (API_VERSION, KIND):
        return
    if type != "DELETED" and as_rendered(body, owner):
        # A Service or PDB as we made it (our own create or update, or a status or defaults
        # change of another controller): the owner's status does not depend on it.
        return
    _queue(memo, body["metadata"]["namespace"], owner["name"])
