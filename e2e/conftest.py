"""Session fixtures for the end-to-end tests: one real local control plane for the whole run.

`k8s` builds (or reuses) the binaries with e2e/build-binaries.sh, starts a kwokctl binary-runtime
cluster with fake GPU nodes on loopback, yields the `Cluster` handle (kubeconfig path, kubectl and
helm paths, `kubectl()`/`helm()`/`apply()` helpers) and deletes it at the end, even on failure.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from e2e.cluster import Binaries, Cluster, build_binaries, reap_stale_clusters, start_cluster


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
