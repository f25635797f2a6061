"""Install the kvpilot Helm chart into a local cluster, the way a user does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import Cluster
from e2e.polling import poll

CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "kvpilot"
RELEASE = "kvpilot"
NAMESPACE = "kvpilot-system"
CRD = "inferenceservices.kvpilot.dev"


@dataclass(frozen=True)
class Installation:
    release: str
    namespace: str
    watch_namespaces: tuple[str, ...]

    @property
    def fullname(self) -> str:
        """The chart's kvpilot.fullname: the name of its Deployment, ServiceAccount and roles."""
        return self.release if "kvpilot" in self.release else f"{self.release}-kvpilot"

    @property
    def service_account(self) -> str:
        return self.fullname

    @property
    def subject(self) -> str:
        """The ServiceAccount as an RBAC user name (kubectl --as)."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def ensure_namespaces(cluster: Cluster, names: Sequence[str]) -> None:
    cluster.apply(*({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names))


def install(
    cluster: Cluster,
    watch_namespaces: Sequence[str],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    values: dict[str, Any] | None = None,
    timeout_s: int = 180,
) -> Installation:
    """`helm install` the chart (the InferenceService CRD among its templates), wait for the operator Deployment to
    roll out and the InferenceService CRD to be Established."""
    # The chart puts a Role and a KopfPeering into each watched namespace: they must exist first.
    ensure_namespaces(cluster, watch_namespaces)
    values_file = cluster.state_dir / f"helm-values-{release}.yaml"
    values_file.write_text(yaml.safe_dump({"watchNamespaces": list(watch_namespaces), **(values or {})}))
    cluster.helm(
        "install",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--create-namespace",
        "--values",
        str(values_file),
        "--wait",
        f"--timeout={timeout_s}s",
        timeout=timeout_s + 30,
    )
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s", timeout=70)
    # Established comes a moment before the API server can list the new resource (429 "storage
    # is (re)initializing"); wait for that too, so the operator's first list succeeds.
    poll(lambda: cluster.kubectl("get", CRD, "-A", check=False, timeout=10).returncode == 0, 60.0, f"{CRD} served")
    return Installation(release=release, namespace=namespace, watch_namespaces=tuple(watch_namespaces))
