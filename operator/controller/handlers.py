"""kopf wiring: thin handlers that run `reconcile` and write its status.

Importing this module registers the handlers in kopf's default registry (`kvpilot operator`
does); all decisions live in the pure modules, all API calls in `cluster.KubeCluster`.

No handler here makes kopf put a finalizer on InferenceServices (kopf adds one only for timers,
daemons and non-optional on.delete handlers; the autoscaler's periodic work is an asyncio task
started on startup instead), so `kubectl delete` never waits for the operator: the children go by
their owner references (garbage collection). Instead of a periodic resync, the operator watches its
children (Deployments, Services, PodDisruptionBudgets, NetworkPolicies and API-key Secrets labelled
as managed by it; not InferencePools, whose CRD is optional): a change or deletion of one reconciles
its owner, so Ready follows the pods within seconds, a child deleted by hand comes back at once, and
an idle cluster costs no API requests. In a burst, events of one InferenceService collapse into the
reconcile already waiting for it, and a Service or PDB event whose object is as rendered reconciles
nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.names import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import correction, render
from kvpilot.operator.controller.last_handled import DigestDiffBaseStorage
from kvpilot.operator.controller.reconcile import (
    as_rendered,
    controller_of,
    reconcile,
    refresh,
    retry_reason,
)
from kvpilot.operator.controller.serial import Reconciles
from kvpilot.operator.kube.cluster import KubeCluster, WriteConflict
from kvpilot.operator.kube.indexes import pod_ready
from kvpilot.operator.kube.merge_patch import merge_patch

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


def engine_image(environ: Mapping[str, str]) -> str:
    """The operator's default engine image: the environment's, else the built-in one."""
    return environ.get(ENGINE_IMAGE_ENV) or render.DEFAULT_ENGINE_IMAGE


# Logged once per reconcile that an event of a child or pod ran (bench/operator_scale.py counts it).
REFRESHED = "Reconciled InferenceService"


def _retry_seconds(reason: str) -> float:
    """How long a status no event will change waits before its reconcile runs again."""
    return BLOCKED_RETRY_SECONDS if reason in BLOCKED else NO_GPU_RETRY_SECONDS


def _refresh(
    namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, services: Mapping[Any, Any] | None
) -> None:
    """Reconcile `namespace/name` for an event of a child or pod (collapsed with the other events
    of a burst: controller/serial.py). kopf does not retry event handlers: a reconcile that
    failed, or wrote a status no event will change, is run again later from here."""
    key = (namespace, name)

    def again() -> None:
        _refresh(namespace, name, memo, logger, None)

    try:
        result = memo.reconciles.collapsed(
            key,
            services,
            lambda known: refresh(
                memo.cluster,
                namespace,
                name,
                datetime.now(UTC),
                default_image=memo.engine_image,
                operator_namespace=memo.operator_namespace,
                known=known,
            ),
        )
    except WriteConflict as error:
        # Whatever changed it is an event of its own, which reconciles again.
        logger.debug(f"{namespace}/{name} changed while reconciling: {error}")
        return
    except Exception as error:  # noqa: BLE001 - the API server failing (500, 429, a timeout) must not end the retries
        delay = memo.reconciles.retry(key, again)
        if delay is not None:
            logger.warning(f"reconcile of {namespace}/{name} failed, again in {delay:g} s: {error}")
        return
    if result is None:
        return
    logger.info(f"{REFRESHED} {namespace}/{name}")
    retry = retry_reason(result.status)
    if retry is None:
        memo.reconciles.succeeded(key)
        return
    memo.reconciles.retry(key, again, _retry_seconds(retry[0]))


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
    # `kvpilot operator` builds, else it is built here) and the one set of per-service locks.
    if memo.get("cluster") is None:
        memo.cluster = KubeCluster.connect()
    memo.reconciles = Reconciles()
    # Read once here, so reconciliation stays a function of the object and this value.
    memo.engine_image = engine_image(os.environ)
    memo.operator_namespace = os.environ.get(names.OPERATOR_NAMESPACE_ENV) or None


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile_handler(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    metadata = body["metadata"]
    key = (metadata["namespace"], metadata["name"])
    with memo.reconciles.lock(key):
        # kopf writes this status after the handler: a version no event's reconcile has seen.
        memo.reconciles.forget(key)
        try:
            status = reconcile(
                body,
                memo.cluster,
                datetime.now(UTC),
                default_image=memo.engine_image,
                operator_namespace=memo.operator_namespace,
            )
        except WriteConflict as error:
            raise kopf.TemporaryError(f"changed while reconciling: {error}", delay=1) from None
    patch.status.update(merge_patch(body.get("status") or {}, status))
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    logger.debug(f"Ready={ready['status']} ({ready['reason']}): {ready['message']}")
    retry = retry_reason(status)
    if retry is not None:
        # The status above is written either way; kopf calls the handler again after the delay.
        reason, message = retry
        raise kopf.TemporaryError(f"{reason}: {message}", delay=_retry_seconds(reason))


@kopf.on.event(GROUP, VERSION, PLURAL)
def correction_handler(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, autoscaled_services: kopf.Index | None = None, **_: Any
) -> None:
    """A status the autoscaler wrote may hold a new PlanAccurate verdict, after which the plan's
    replicas are chosen with another correction (controller/correction.py): re-plan then. A status
    change is no update for kopf's handlers above (its essence leaves status out)."""
    try:
        spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return
    if body["metadata"].get("deletionTimestamp") or not correction.stale(body.get("status") or {}, spec):
        return
    _refresh(body["metadata"]["namespace"], body["metadata"]["name"], memo, logger, autoscaled_services)


@kopf.on.event("v1", "pods", labels=names.MANAGED_BY)
def pod_handler(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, autoscaled_services: kopf.Index | None = None, **_: Any
) -> None:
    """An engine pod changed (scheduled, crash-looping, ready): its InferenceService's status may
    have a new reason. Pods are owned by ReplicaSets, so the owner comes from the instance label."""
    namespace = body["metadata"]["namespace"]
    name = (body["metadata"].get("labels") or {}).get(names.INSTANCE_LABEL)
    if not name or body["metadata"].get("deletionTimestamp") or pod_ready(body):
        # A pod becoming ready or going away changes its Deployment's status, whose own event
        # reconciles; only a pod stuck before ready has something to add.
        return
    _refresh(namespace, name, memo, logger, autoscaled_services)


@kopf.on.event("apps/v1", "deployments", labels=names.MANAGED_BY)
@kopf.on.event("v1", "services", labels=names.MANAGED_BY)
@kopf.on.event("policy/v1", "poddisruptionbudgets", labels=names.MANAGED_BY)
@kopf.on.event("networking.k8s.io/v1", "networkpolicies", labels=names.MANAGED_BY)
@kopf.on.event("v1", "secrets", labels=names.MANAGED_BY)
def child_handler(
    body: kopf.Body,
    memo: kopf.Memo,
    logger: logging.Logger,
    type: str | None = None,
    autoscaled_services: kopf.Index | None = None,
    **_: Any,
) -> None:
    owner = controller_of(body)
    if owner is None or (owner.get("apiVersion"), owner.get("kind")) != (API_VERSION, KIND):
        return
    if type != "DELETED" and as_rendered(body, owner):
        # A Service or PDB as we made it (our own create or update, or a status or defaults
        # change of another controller): the owner's status does not depend on it.
        return
    _refresh(body["metadata"]["namespace"], owner["name"], memo, logger, autoscaled_services)
