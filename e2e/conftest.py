"""Session fixtures for the end-to-end tests: one real local control plane for the whole run.

`k8s` builds (or reuses) the binaries with e2e/build-binaries.sh, starts a kwokctl binary-runtime
cluster with fake GPU nodes on loopback, yields the `Cluster` handle (kubeconfig path, kubectl and
helm paths, `kubectl()`/`helm()`/`apply()` helpers) and deletes it at the end, even on failure.
`kvpilot` helm-installs the chart into it; `operator` runs the chart's operator locally under the
chart's ServiceAccount (kwok's pods run no code) and stops it at the end.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import pytest

from e2e import kvis
from e2e.chart import Installation, install
from e2e.cluster import Binaries, Cluster, build_binaries, reap_stale_clusters, start_cluster
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator

# The namespace the chart's operator watches; every InferenceService of the tests lives here.
WATCHED = "kvpilot-e2e"
# The chart's autoscaler.intervalSeconds: short, so that scaling scenarios take seconds, not minutes.
AUTOSCALE_INTERVAL_S = 2.0
# One gateway pod, with the local gateway behind its IP (local_gateway.py).
GATEWAY_REPLICAS = 1
# The chart's capacityClasses (issue 41): the label a class's nodes carry, and spot's own price of an
# L40S (well below its list price; on-demand has none, so it costs the list price). No GPU node of the
# session fleet carries the label, and only test_operator's capacity-class tests name a class.
CAPACITY_LABEL = "kvpilot.dev/e2e-capacity"
SPOT_L40S_PRICE = 0.6
CAPACITY_CLASSES = {
    "spot": {"nodeSelector": {CAPACITY_LABEL: "spot"}, "gpuPrices": {"L40S": SPOT_L40S_PRICE}},
    "on-demand": {"nodeSelector": {CAPACITY_LABEL: "on-demand"}},
}


@pytest.fixture(scope="session")
def k8s_binaries() -> Binaries:
    return build_binaries()


@pytest.fixture(scope="session")
def k8s(k8s_binaries: Binaries) -> Iterator[Cluster]:
    # A SIGTERM (CI cancelling the run) becomes KeyboardInterrupt, so teardown still runs.
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    reap_stale_clusters(k8s_binaries)  # left by runs that were SIGKILLed
    cluster = start_cluster(k8s_binaries)
    try:
        yield cluster
    finally:
        try:
            cluster.delete()
        finally:
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def kvpilot(k8s: Cluster) -> Installation:
    """The chart, installed with Helm, reconciling InferenceServices in WATCHED."""
    return install(
        k8s,
        [WATCHED],
        values={
            "autoscaler": {"intervalSeconds": AUTOSCALE_INTERVAL_S},
            "gateway": {"replicas": GATEWAY_REPLICAS},
            "capacityClasses": CAPACITY_CLASSES,
        },
    )


Local = TypeVar("Local", LocalOperator, LocalGateway)


def _running(local: Local) -> Iterator[Local]:
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def operator(
    k8s: Cluster, kvpilot: Installation, gateway: LocalGateway, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalOperator]:
    """The chart's operator as a local process under the chart's ServiceAccount (logs kept in tmp).
    The gateway runs beside it, as the chart installs them: the autoscaler reads the gateway pod's
    held queue, and scales nothing down while a gateway pod cannot be read."""
    yield from _running(LocalOperator(k8s, kvpilot, tmp_path_factory.mktemp("operator")))


@pytest.fixture(scope="session")
def gateway(k8s: Cluster, kvpilot: Installation, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    """The chart's gateway as a local process under the gateway's own ServiceAccount."""
    yield from _running(LocalGateway(k8s, kvpilot, tmp_path_factory.mktemp("gateway")))


@pytest.fixture()
def apply_isvc(k8s: Cluster, kvpilot: Installation) -> Iterator[Callable[[str, dict[str, Any]], dict[str, Any]]]:
    """Apply InferenceServices into the watched namespace; delete them after the test."""
    applied: list[str] = []

    def apply(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        obj = kvis.manifest(name, kvpilot.watch_namespaces[0], spec)
        k8s.apply(obj)
        applied.append(name)
        return obj

    yield apply
    for name in applied:
        k8s.kubectl(
            "delete", "inferenceservice", name, "-n", kvpilot.watch_namespaces[0], "--ignore-not-found", "--wait=false"
        )
