"""The chart's gateway, run as a local process under the gateway's own ServiceAccount.

As for the operator (local_operator.py): kwok's gateway pods run no code, so `kvpilot gateway`
runs here with the command and arguments of the chart's gateway Deployment and a kubeconfig whose
only credential is a token of the gateway's ServiceAccount: it can do exactly what the chart's
gateway RBAC grants. It listens on its pod's loopback IP and port instead of 0.0.0.0, as the
engines do behind theirs (pod_runner.py), so the operator reads its held queue from the pod it
lists; the e2e chart runs one gateway replica (a second pod would have nothing behind it, and the
autoscaler scales nothing down while a gateway cannot be read). It is ready (its /readyz) once its
watches have listed everything.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import service_account_kubeconfig
from e2e.local_process import LocalProcess
from e2e.polling import poll
from e2e.procs import Process, kvpilot_executable
from kvpilot.operator.api.names import label_selector

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


def gateway_argv(deployment: dict[str, Any], address: str, extra: list[str] | None = None) -> list[str]:
    """The chart gateway Deployment's command line, listening on `address` (host:port) of this machine."""
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER)
    if container["command"] != ["kvpilot"] or container["args"][0] != "gateway":
        raise ValueError(f"unexpected gateway command {container['command']} {container['args'][:1]}")
    args = [f"--listen={address}" if a.startswith("--listen=") else a for a in container["args"]]
    return [kvpilot_executable(), *args, *(extra or [])]


def gateway_pod_address(cluster: Cluster, deployment: dict[str, Any]) -> str:
    """host:port of the gateway Deployment's one running pod (its loopback IP, its container port)."""
    selector = label_selector(deployment["spec"]["selector"]["matchLabels"])
    namespace = deployment["metadata"]["namespace"]

    def running() -> list[dict[str, Any]] | None:
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
        up = [p for p in pods if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]
        return up if len(up) == len(pods) == deployment["spec"]["replicas"] else None

    pods = poll(running, 60, f"the gateway pods of {namespace}/{deployment['metadata']['name']}")
    if len(pods) != 1:
        raise ValueError(f"the e2e chart runs one gateway replica, not {len(pods)} (gateway.replicas)")
    ip = pods[0]["status"]["podIP"]
    if not ipaddress.ip_address(ip).is_loopback:
        raise ValueError(f"gateway pod IP {ip} is not loopback: nothing here may listen there")
    container = next(c for c in pods[0]["spec"]["containers"] if c["name"] == CONTAINER)
    return f"{ip}:{container['ports'][0]['containerPort']}"


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
        deployment = self.deployment(f"{self.installation.fullname}-gateway")
        address = gateway_pod_address(self.cluster, deployment)
        self.url = f"http://{address}"
        return self.launch(gateway_argv(deployment, address, extra), f"{self.url}/readyz", timeout_s)
