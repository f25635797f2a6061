"""kopf wiring: thin handlers that run `reconcile` and write its status.

Importing this module registers the handlers in kopf's default registry (`kvpilot operator`
does); all decisions live in the pure modules, all API calls in `cluster.KubeCluster`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from kvpilot.operator import render
from kvpilot.operator.cluster import KubeCluster
from kvpilot.operator.reconcile import reconcile
from kvpilot.operator.spec import GROUP, PLURAL, VERSION

# How often every InferenceService is re-reconciled even without events: this repairs children
# deleted or edited by hand and refreshes readyReplicas from the Deployment. kopf puts a finalizer
# on objects that have a timer (to stop it cleanly), so deleting an InferenceService waits for a
# running operator; its children then go by their owner references.
RESYNC_SECONDS = 15.0
# kopf's bookkeeping annotations, under our own domain instead of kopf.zalando.org.
ANNOTATION_PREFIX = GROUP
# Set by the chart from its engine.image value: the engine image for specs without spec.image.
ENGINE_IMAGE_ENV = "KVPILOT_ENGINE_IMAGE"


def engine_image(environ: Mapping[str, str]) -> str:
    """The operator's default engine image: the environment's, else the built-in one."""
    return environ.get(ENGINE_IMAGE_ENV) or render.DEFAULT_ENGINE_IMAGE


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    # Per-object memos are shallow copies of this one, so every handler sees the client.
    memo.cluster = KubeCluster.connect()
    # Read once here, so reconciliation stays a function of the object and this value.
    memo.engine_image = engine_image(os.environ)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, id="resync", interval=RESYNC_SECONDS,
            initial_delay=RESYNC_SECONDS)
def reconcile_handler(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                      logger: logging.Logger, **_: Any) -> None:
    status = reconcile(body, memo.cluster, datetime.now(UTC), default_image=memo.engine_image)
    patch.status.update(status)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    logger.debug(f"Ready={ready['status']} ({ready['reason']}): {ready['message']}")
