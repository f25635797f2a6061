"""What the operator process runs beside the reconcile handlers (controller/handlers.py): the
kopf indexes the autoscaler and event reconciles read, and the SLO autoscaler's loop. Importing it
registers them in kopf's default registry (`kvpilot operator` does); all of them write through the
one cluster adapter in kopf's memo. The gateway is a process of its own (`kvpilot gateway`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Any

import kopf

from kvpilot.operator.api import names
from kvpilot.operator.api.names import GROUP, PLURAL, VERSION
from kvpilot.operator.autoscaling.decisions import INTERVAL_SECONDS
from kvpilot.operator.autoscaling.gateways import GatewayView, gateway_watch
from kvpilot.operator.autoscaling.loop import AutoscalingLoop
from kvpilot.operator.autoscaling.operator_metrics import OperatorMetrics
from kvpilot.operator.kube.indexes import index_entry
from kvpilot.operator.kube.watches import Watches

log = logging.getLogger(__name__)


# What the autoscaler's loop reads, indexed by kopf from the watches it runs anyway: a period
# costs no API reads. Indexes add no finalizer (only timers, daemons and on.delete handlers do).
@kopf.index(GROUP, VERSION, PLURAL)
def autoscaled_services(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return index_entry(body)


# Keyed by their InferenceService (its instance label), as the ReplicaSets and pods are: a mixed
# pool's Deployments are named after their GPU types (<service>-<type>), and keyed by name the
# service would have no Deployment, so no autoscaler period and no adapter sync.
@kopf.index("apps/v1", "deployments", labels=names.MANAGED_BY)
def engine_deployments(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return index_entry(body, key_label=names.INSTANCE_LABEL)


# The Deployment controller gives a ReplicaSet its pod template's labels (managed-by among them):
# the link by uid from an engine pod to its service's Deployment (kube/indexes.py, `children`).
@kopf.index("apps/v1", "replicasets", labels=names.MANAGED_BY)
def engine_replicasets(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return index_entry(body, key_label=names.INSTANCE_LABEL)


@kopf.index("v1", "pods", labels=names.MANAGED_BY)
def engine_pods(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return index_entry(body, key_label=names.INSTANCE_LABEL)


@kopf.on.startup()
async def start_autoscaler(
    memo: kopf.Memo,
    autoscaled_services: kopf.Index,
    engine_deployments: kopf.Index,
    engine_replicasets: kopf.Index,
    engine_pods: kopf.Index,
    **_: Any,
) -> None:
    """The SLO autoscaler's periodic loop (autoscaling/loop.py), as a plain asyncio task: a kopf
    timer or daemon would put a finalizer on every InferenceService. Once: a startup handler that
    kopf runs again (after a failure of another) must not start a second loop."""
    if memo.get("autoscaler") is not None:
        return
    gateways = None
    where = memo.get("gateway_pods")
    if where is not None:
        # The gateway pods live where kopf does not watch (the release namespace): a watch of their
        # own, which costs nothing while they do not change.
        memo.gateway_watches = Watches(memo.cluster.client, asyncio.get_running_loop(), [gateway_watch(where)]).start()
        gateways = GatewayView(where, memo.gateway_watches.indexes[0])
    metrics = OperatorMetrics(autoscaled_services)
    await serve_metrics(memo, metrics)
    loop = AutoscalingLoop(
        memo.cluster,
        autoscaled_services,
        engine_deployments,
        engine_replicasets,
        engine_pods,
        memo.get("autoscale_interval", INTERVAL_SECONDS),
        memo.get("prometheus_url_allow", ()),
        gateways,
        metrics,
    )
    memo.autoscaler = asyncio.create_task(loop.run(), name="kvpilot-autoscaler")


async def serve_metrics(memo: kopf.Memo, metrics: OperatorMetrics) -> None:
    """The operator's /metrics (`kvpilot operator --metrics`), on kopf's event loop. An address it
    cannot listen on is logged and the operator runs on without: reconciling matters more than
    its own metrics, and Prometheus shows the target down."""
    address = memo.get("metrics_address")
    if address is None:
        return
    try:
        memo.metrics_server = await metrics.serve(*address)
    except OSError as error:
        log.error(f"operator: cannot serve /metrics on {address[0]}:{address[1]}: {error}")
        return
    log.info(f"operator: /metrics on {address[0]}:{address[1]}")


@kopf.on.cleanup()
async def stop_autoscaler(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("metrics_server") is not None:
        await memo.metrics_server.cleanup()
    if memo.get("gateway_watches") is not None:
        memo.gateway_watches.stop()
    task = memo.get("autoscaler")
    if task is not None:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
