"""The chart's gateway, run as a local process under the gateway's own ServiceAccount.

As for the operator (local_operator.py): kwok's gateway pods run no code, so `kvpilot gateway`
runs here with the command and arguments of the chart's gateway Deployment and a kubeconfig whose
only credential is a token of the gateway's ServiceAccount: it can do exactly what the chart's
gateway RBAC grants. It listens on a loopback port instead of 0.0.0.0, and is ready (its /readyz)
once its watches have listed everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import service_account_kubeconfig
from e2e.local_process import LocalProcess
from e2e.procs import LOOPBACK, Process, free_port, kvpilot_executable

CONTAINER = "gateway"


@dataclass(frozen=True)
class GatewayAccount:
    """The gateway's ServiceAccount, as service_account_kubeconfig reads an installation."""

    service_account: str
    namespace: str

    @property
    def subject(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def gateway_account(installation: Installation) -> GatewayAccount:
    return GatewayAccount(f"{installation.fullname}-gateway", installation.namespace)


def gateway_argv(deployment: dict[str, Any], port: int, extra: list[str] | None = None) -> list[str]:
    """The chart gateway Deployment's command line, listening on a loopback port of this machine."""
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER)
    if container["command"] != ["kvpilot"] or container["args"][0] != "gateway":
        raise ValueError(f"unexpected gateway command {container['command']} {container['args'][:1]}")
    args = [f"--listen={LOOPBACK}:{port}" if a.startswith("--listen=") else a for a in container["args"]]
    return [kvpilot_executable(), *args, *(extra or [])]


class LocalGateway(LocalProcess):
    """start / stop the gateway; each start logs to a fresh file under `workdir`."""

    component = "gateway"

    def __init__(self, cluster: Cluster, installation: Installation, workdir: Path) -> None:
        super().__init__(cluster, installation, workdir)
        self.account = gateway_account(installation)
        self.url = ""

    def base_url(self, namespace: str) -> str:
        """The OpenAI base URL of the models in `namespace`."""
        return f"{self.url}/namespaces/{namespace}/v1"

    def start(self, extra: list[str] | None = None, timeout_s: float = 60.0) -> Process:
        service_account_kubeconfig(self.cluster, self.account, self.kubeconfig)  # type: ignore[arg-type]
        port = free_port()
        self.url = f"http://{LOOPBACK}:{port}"
        argv = gateway_argv(self.deployment(f"{self.installation.fullname}-gateway"), port, extra)
        return self.launch(argv, f"{self.url}/readyz", timeout_s)
