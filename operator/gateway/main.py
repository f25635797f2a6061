"""The gateway's process (`kvpilot gateway`): its watches, its HTTP server, and its stop.

On SIGTERM (a rollout, a node drain) it stops being ready, answers what it holds with 503 and
Retry-After (a client or its retry policy sends it again, to a replica that stays), lets the
streams in flight finish for up to `drain_seconds`, and only then closes: a stream still running
then is cut, which its client sees as a failure, never as a short success."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from kubernetes.client import ApiClient
from kubernetes.dynamic import DynamicClient

from kvpilot.operator.api import names
from kvpilot.operator.gateway.limits import Limits
from kvpilot.operator.gateway.server import POLL_SECONDS, Gateway
from kvpilot.operator.kube.cluster import KubeCluster
from kvpilot.operator.kube.watches import Watched, Watches

log = logging.getLogger(__name__)

_MANAGED = names.label_selector(names.MANAGED_BY)
# What the gateway routes by, cluster-wide, in the order Gateway takes them: the InferenceServices,
# and the Deployments, ReplicaSets and pods the operator manages, the three keyed by their
# InferenceService (its instance label): a mixed pool's Deployments are named after their GPU
# types (<service>-<type>), and keyed by name the service would have no Deployment and no pods.
WATCHED = (
    Watched(names.API_VERSION, names.KIND),
    Watched("apps/v1", "Deployment", _MANAGED, names.INSTANCE_LABEL),
    Watched("apps/v1", "ReplicaSet", _MANAGED, names.INSTANCE_LABEL),
    Watched("v1", "Pod", _MANAGED, names.INSTANCE_LABEL),
)


async def run(host: str, port: int, limits: Limits, drain_seconds: float) -> None:
    cluster = KubeCluster.connect()  # loads the credentials the watches' client uses too
    watches = Watches(DynamicClient(ApiClient()), asyncio.get_running_loop(), WATCHED).start()
    services, deployments, replicasets, pods = (index.entries for index in watches.indexes)
    try:
        gateway = Gateway(services, deployments, replicasets, pods, cluster, limits, watches.synced)
        await serve_until_stopped(gateway, host, port, drain_seconds)
    finally:
        watches.stop()


async def serve_until_stopped(gateway: Gateway, host: str, port: int, drain_seconds: float) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see above) and close."""
    runner = await gateway.serve(host, port)
    log.info(f"gateway: listening on {host}:{port}")
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    gateway.draining = True
    deadline = time.monotonic() + drain_seconds
    while gateway.busy() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
    log.info(f"gateway: stopping ({'streams cut' if gateway.busy() else 'nothing in flight'})")
    await runner.cleanup()
