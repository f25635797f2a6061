"""The chart's operator, run as a local process under the chart's ServiceAccount.

kwok simulates the operator's pod, which runs no code, so the real operator runs here instead:
with the command and arguments of the chart's Deployment, and a kubeconfig whose only credential
is a token of the chart's ServiceAccount (`kubectl create token`). It can therefore do exactly what
the chart's RBAC grants, as in the cluster. Its liveness and /metrics endpoints move from 0.0.0.0 to loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_process import LocalProcess
from e2e.procs import LOOPBACK, Process, free_port, kvpilot_executable

CONTAINER = "operator"


def service_account_kubeconfig(
    cluster: Cluster, installation: Installation, path: Path, duration: str = "24h", server: str | None = None
) -> Path:
    """A kubeconfig for the API server of `cluster` that authenticates as the chart's ServiceAccount;
    `server`: another address to reach it by (a plain-HTTP proxy in front of it, fault_proxy.py)."""
    token = cluster.kubectl(
        "create", "token", installation.service_account, "-n", installation.namespace, f"--duration={duration}"
    ).stdout.strip()
    admin = cluster.kubectl_json("config", "view", "--raw", "--minify", "--flatten")
    entry = admin["clusters"][0]
    if server is not None:
        entry = {"name": entry["name"], "cluster": {"server": server}}
    user = installation.subject
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [entry],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": entry["name"], "user": user}}],
        "current-context": user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def operator_argv(deployment: dict[str, Any], liveness_port: int, metrics_port: int) -> list[str]:
    """The chart Deployment's operator command line, runnable here: the liveness probe and the
    operator's /metrics listen on loopback ports of this machine."""
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER)
    if container["command"] != ["kvpilot"]:
        raise ValueError(f"unexpected operator command {container['command']}")
    args = [a for a in container["args"] if not a.startswith(("--liveness", "--metrics"))]
    return [
        kvpilot_executable(),
        *args,
        f"--liveness=http://{LOOPBACK}:{liveness_port}/healthz",
        f"--metrics={LOOPBACK}:{metrics_port}",
    ]


class LocalOperator(LocalProcess):
    """start / stop / restart the operator; each start logs to a fresh file under `workdir`."""

    component = "operator"

    def __init__(self, cluster: Cluster, installation: Installation, workdir: Path) -> None:
        super().__init__(cluster, installation, workdir)
        # Another address of the API server for the next starts (a fault proxy); None: its own.
        self.api_server: str | None = None
        self.metrics_url = ""  # the operator's own /metrics, on a loopback port

    def prepare_kubeconfig(self) -> Path:
        """Write the ServiceAccount kubeconfig for this cluster, over whatever is there: a fresh
        token and the cluster's own CA and address (a kubeconfig left in `workdir` may be from
        another cluster, say a demo brought down and up again)."""
        return service_account_kubeconfig(self.cluster, self.installation, self.kubeconfig, server=self.api_server)

    def start(self, timeout_s: float = 60.0) -> Process:
        self.prepare_kubeconfig()
        liveness, metrics = free_port(), free_port()
        self.metrics_url = f"http://{LOOPBACK}:{metrics}/metrics"
        argv = operator_argv(self.deployment(self.installation.fullname), liveness, metrics)
        return self.launch(argv, f"http://{LOOPBACK}:{liveness}/healthz", timeout_s)

    def restart(self) -> Process:
        self.stop()
        return self.start()
