"""The operator's only door to the Kubernetes API: read, create, update, status, scale, Events,
node GPUs. One `KubeCluster` is built at start-up and handed to every user: the reconciles, the
autoscaler's loop and the gateway.

`Cluster` is what reconciliation needs. Writes never take over an object that exists already:
`create` refuses one that is there (whoever made it), and `update` applies onto exactly the
version that was read, so an object deleted and made again by someone else in between is refused
too. Both are server-side apply under the operator's field manager, so a field the operator stops
rendering is removed by the next update. Refusals come back as `WriteConflict` (the object changed:
read again) or `WriteRefused` (any other error answer; its message is for the status).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, Protocol

from kubernetes import config
from kubernetes.client import ApiClient
from kubernetes.config.config_exception import ConfigException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, DynamicApiError, NotFoundError, ResourceNotFoundError

from kvpilot.operator.api.names import (
    AMD_GPU_RESOURCE,
    AMD_PRODUCT_LABEL,
    API_VERSION,
    KIND,
    NVIDIA_GPU_COUNT_LABEL,
    NVIDIA_GPU_RESOURCE,
    NVIDIA_PRODUCT_LABEL,
    label_selector,
)

Manifest = dict[str, Any]

FIELD_MANAGER = "kvpilot-operator"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
PEERING_API_VERSION = "kopf.dev/v1"
# An apply that carries a resourceVersion changes only the object at that version, and creates the
# object when there is none (a create ignores the version). No object is ever at version "1" (the
# first write of the whole cluster), so an apply with it creates or fails with a conflict.
CREATE_ONLY_VERSION = "1"


class WriteConflict(Exception):
    """The object is not at the version that was read (or exists where none was): read again."""


class WriteRefused(Exception):
    """The API server answered a write with an error other than a conflict; `message` is its
    own words. Not only 4xx: an apply whose quantity the API server cannot parse gets a 500
    ("failed to convert new object ... quantities must match the regular expression"), which a
    retry of the same request does not fix either."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what}: {message}")
        self.what, self.code, self.message = what, code, message


def describe(manifest: Manifest) -> str:
    """`Kind namespace/name`, the way conditions and logs name an object."""
    metadata = manifest["metadata"]
    where = f"{metadata['namespace']}/" if metadata.get("namespace") else ""
    return f"{manifest['kind']} {where}{metadata['name']}"


def api_message(error: DynamicApiError) -> str:
    """The API server's message from an error response (its Status object), else the body."""
    body = error.body.decode(errors="replace") if isinstance(error.body, bytes) else error.body
    try:
        message = json.loads(body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or body or f"{error.status} {error.reason}")


@contextmanager
def _translated(what: str) -> Iterator[None]:
    """The API server's error answers to a write as WriteConflict or WriteRefused."""
    try:
        yield
    except ConflictError as error:
        raise WriteConflict(f"{what}: {api_message(error)}") from None
    except DynamicApiError as error:
        raise WriteRefused(what, error.status, api_message(error)) from None
    except ResourceNotFoundError as error:
        # A kind the API server does not serve: an optional CRD (InferencePool) not installed.
        raise WriteRefused(
            what, 404, f"the API server does not serve this kind (is its CRD installed?): {error}"
        ) from None


class Cluster(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None: ...

    def create(self, manifest: Manifest) -> Manifest:
        """Create `manifest` and return the object; WriteConflict when one of its name exists."""
        ...

    def update(self, manifest: Manifest, resource_version: str) -> Manifest:
        """Apply `manifest` onto the object at `resource_version`; WriteConflict when it is not
        at that version any more."""
        ...

    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Manifest,
        resource_version: str | None = None,
    ) -> str:
        """Merge-patch the status subresource (None values remove fields), only onto
        `resource_version` when given (else WriteConflict); the object's new resourceVersion."""
        ...

    def set_pod_condition(self, namespace: str, name: str, condition: Manifest) -> None:
        """Set one condition of a pod's status (a readiness gate's), the others left as they are."""
        ...

    def gpu_nodes(self) -> dict[str, int]:
        """The nodes' GPU products (their product labels), each with the most GPUs one node of it
        carries (the GPU count label, else the node's allocatable GPUs)."""
        ...

    def post_event(self, event: Manifest) -> None:
        """Post a core/v1 Event (named by generateName); WriteRefused when the API server refuses it."""
        ...

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """The pods in `namespace` that carry all of `labels`."""
        ...


def _count(value: Any) -> int:
    try:
        return max(int(str(value)), 0)
    except ValueError:
        return 0


def gpu_nodes(nodes: list[Manifest]) -> dict[str, int]:
    """Node manifests -> {GPU product: the most GPUs one node of it carries}."""
    found: dict[str, int] = {}
    for node in nodes:
        labels = node.get("metadata", {}).get("labels") or {}
        allocatable = node.get("status", {}).get("allocatable") or {}
        for product, count_label, resource in (
            (NVIDIA_PRODUCT_LABEL, NVIDIA_GPU_COUNT_LABEL, NVIDIA_GPU_RESOURCE),
            (AMD_PRODUCT_LABEL, None, AMD_GPU_RESOURCE),
        ):
            if product in labels:
                count = _count((count_label and labels.get(count_label)) or allocatable.get(resource, 0))
                found[labels[product]] = max(found.get(labels[product], 0), count)
    return found


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

    @property
    def client(self) -> DynamicClient:
        """The one client, for the watches of what kopf does not watch (kube/watches.py)."""
        return self._client

    def _resource(self, api_version: str, kind: str) -> Any:
        return self._client.resources.get(api_version=api_version, kind=kind)

    def _apply(self, manifest: Manifest, resource_version: str) -> Manifest:
        body = {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": resource_version}}
        with _translated(describe(manifest)):
            result = self._resource(manifest["apiVersion"], manifest["kind"]).server_side_apply(
                body=body,
                namespace=manifest["metadata"].get("namespace"),
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
            )
        return dict(result.to_dict())

    def create(self, manifest: Manifest) -> Manifest:
        return self._apply(manifest, CREATE_ONLY_VERSION)

    def update(self, manifest: Manifest, resource_version: str) -> Manifest:
        return self._apply(manifest, resource_version)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            found = self._resource(api_version, kind).get(name=name, namespace=namespace)
        except (NotFoundError, ResourceNotFoundError):
            # No such object, or no such kind (so no such object).
            return None
        return dict(found.to_dict())

    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Manifest,
        resource_version: str | None = None,
    ) -> str:
        body: Manifest = {"status": patch}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        with _translated(f"{kind} {namespace}/{name} status"):
            patched = self._resource(api_version, kind).status.patch(
                body=body, name=name, namespace=namespace, content_type="application/merge-patch+json"
            )
        return str(patched.metadata.resourceVersion)

    def set_pod_condition(self, namespace: str, name: str, condition: Manifest) -> None:
        # A strategic merge patch merges status.conditions by type; a JSON merge patch would
        # replace the list, Ready and the kubelet's others with it.
        with _translated(f"Pod {namespace}/{name} status"):
            self._resource("v1", "Pod").status.patch(
                body={"status": {"conditions": [condition]}},
                name=name,
                namespace=namespace,
                content_type="application/strategic-merge-patch+json",
            )

    def set_deletion_costs(self, namespace: str, costs: Mapping[str, int]) -> None:
        """Annotate pods with controller.kubernetes.io/pod-deletion-cost (the ReplicaSet removes
        the lowest first); a pod gone meanwhile is no matter."""
        for name, cost in costs.items():
            with _translated(f"Pod {namespace}/{name}"), suppress(NotFoundError):
                self._resource("v1", "Pod").patch(
                    body={"metadata": {"annotations": {DELETION_COST: str(cost)}}},
                    name=name,
                    namespace=namespace,
                    content_type="application/merge-patch+json",
                )

    def write_replicas(
        self, body: Mapping[str, Any], replicas: int, event: Manifest, resource_version: str | None = None
    ) -> None:
        """Set the InferenceService `body`'s replicas through its scale subresource (only at
        `resource_version`, when given: else WriteConflict) and post `event` on it."""
        metadata = body["metadata"]
        patch: Manifest = {"spec": {"replicas": replicas}}
        if resource_version is not None:
            patch["metadata"] = {"resourceVersion": resource_version}
        with _translated(f"{KIND} {metadata['namespace']}/{metadata['name']} scale"):
            self._resource(API_VERSION, KIND).scale.patch(
                body=patch,
                name=metadata["name"],
                namespace=metadata["namespace"],
                content_type="application/merge-patch+json",
            )
            self._resource("v1", "Event").create(body=event, namespace=metadata["namespace"])

    def post_event(self, event: Manifest) -> None:
        with _translated(f"Event on {event['involvedObject']['kind']} {event['involvedObject']['name']}"):
            self._resource("v1", "Event").create(body=event, namespace=event["metadata"]["namespace"])

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        found = self._resource("v1", "Pod").get(namespace=namespace, label_selector=label_selector(labels))
        return list(found.to_dict().get("items", []))

    def gpu_nodes(self) -> dict[str, int]:
        return gpu_nodes(self._resource("v1", "Node").get().to_dict().get("items", []))

    def ensure_peering(self, name: str, namespaces: list[str] | None) -> None:
        """Create the kopf peering object(s) replicas coordinate through, if missing:
        one ClusterKopfPeering cluster-wide (namespaces None), else a KopfPeering per namespace.

        Looks before creating: where the Helm chart made them, the operator's role has no
        `create` on peerings, and the API server authorizes a create before checking existence.
        """
        targets = (
            [("ClusterKopfPeering", None)]
            if namespaces is None
            else [("KopfPeering", namespace) for namespace in namespaces]
        )
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
                    body={"apiVersion": PEERING_API_VERSION, "kind": kind, "metadata": metadata}, namespace=namespace
                )
            except ConflictError:
                pass  # another replica, or the Helm chart, created it first
