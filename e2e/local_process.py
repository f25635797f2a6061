"""What the chart's operator and gateway have in common when run here as local processes: a
kubeconfig of their own ServiceAccount in `workdir`, the chart's Deployment of them to take the
command line from, a fresh log file a start, and stop by the process's own PID."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.procs import Process, start_http


class LocalProcess:
    """start / stop one of the chart's components; start `n` logs to `{component}-{n}.log` under `workdir`."""

    component: str

    def __init__(self, cluster: Cluster, installation: Installation, workdir: Path) -> None:
        self.cluster = cluster
        self.installation = installation
        self.workdir = workdir
        self.kubeconfig = workdir / f"{self.component}-kubeconfig.yaml"
        self.process: Process | None = None
        self.starts = 0

    def deployment(self, name: str) -> dict[str, Any]:
        """The chart's Deployment `name` in the installation's namespace."""
        return self.cluster.kubectl_json("get", "deployment", name, "-n", self.installation.namespace)

    def launch(self, argv: list[str], ready_url: str, timeout_s: float) -> Process:
        """Run `argv` with the ServiceAccount kubeconfig, once `ready_url` answers."""
        self.starts += 1
        self.process = start_http(
            argv,
            self.workdir / f"{self.component}-{self.starts}.log",
            ready_url,
            timeout_s,
            # Where it runs, as the chart's downward API tells its pod (profile ConfigMaps, NetworkPolicies).
            self.cluster.env(
                KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1", KVPILOT_NAMESPACE=self.installation.namespace
            ),
        )
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def log(self) -> str:
        """Everything every start has logged so far."""
        return "\n".join(f.read_text(errors="replace") for f in sorted(self.workdir.glob(f"{self.component}-*.log")))
