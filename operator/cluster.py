"""The operator's only door to the Kubernetes API: apply, get, delete, and node GPU discovery.

`Cluster` is what reconciliation needs; `KubeCluster` implements it with server-side apply, which
is idempotent by construction (the same manifest applied twice is one object, and a restarted
operator re-applying finds its own field manager's fields).
"""

from __future__ import annotations

from typing import Any, Protocol

from kubernetes import config
from kubernetes.client import ApiClient
from kubernetes.config.config_exception import ConfigException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

from kvpilot.operator.gpu_catalog import AMD_PRODUCT_LABEL, NVIDIA_PRODUCT_LABEL

Manifest = dict[str, Any]

FIELD_MANAGER = "kvpilot-operator"
PEERING_API_VERSION = "kopf.dev/v1"


class Cluster(Protocol):
    def apply(self, manifest: Manifest) -> None: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...

    def gpu_products(self) -> list[str]: ...


class KubeCluster:
    def __init__(self, client: DynamicClient) -> None:
        self._client = client

    @classmethod
    def connect(cls) -> KubeCluster:
        """In a pod use its service account, elsewhere the local kubeconfig."""
        try:
            config.load_incluster_config()
        except ConfigException:
            config.load_kube_config()
        return cls(DynamicClient(ApiClient()))

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._client.resources.get(api_version=api_version, kind=kind)

    def apply(self, manifest: Manifest) -> None:
        self._resource(manifest["apiVersion"], manifest["kind"]).server_side_apply(
            body=manifest, namespace=manifest["metadata"].get("namespace"),
            field_manager=FIELD_MANAGER, force_conflicts=True)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            found = self._resource(api_version, kind).get(name=name, namespace=namespace)
        except NotFoundError:
            return None
        return dict(found.to_dict())

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace)
        except NotFoundError:
            pass

    def gpu_products(self) -> list[str]:
        nodes = self._resource("v1", "Node").get().to_dict().get("items", [])
        return sorted({
            labels[key]
            for node in nodes
            for labels in [node.get("metadata", {}).get("labels") or {}]
            for key in (NVIDIA_PRODUCT_LABEL, AMD_PRODUCT_LABEL)
            if key in labels
        })

    def ensure_peering(self, name: str, namespaces: list[str] | None) -> None:
        """Create the kopf peering object(s) replicas coordinate through, if missing:
        one ClusterKopfPeering cluster-wide (namespaces None), else a KopfPeering per namespace.

        Looks before creating: where the Helm chart made them, the operator's role has no
        `create` on peerings, and the API server authorizes a create before checking existence.
        """
        targets = ([("ClusterKopfPeering", None)] if namespaces is None
                   else [("KopfPeering", namespace) for namespace in namespaces])
        for kind, namespace in targets:
            resource = self._resource(PEERING_API_VERSION, kind)
            try:
                resource.get(name=name, namespace=namespace)
                continue
            except NotFoundError:
                pass
            metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
            try:
                resource.create(
                    body={"apiVersion": PEERING_API_VERSION, "kind": kind, "metadata": metadata},
                    namespace=namespace)
            except ConflictError:
                pass  # another replica, or the Helm chart, created it first
