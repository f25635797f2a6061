"""The requests the gateways hold, as the autoscaler sees them (pure; loop.py reads them).

A request the gateway (operator/gateway/) holds waits for a wake from zero or for an engine with
room: demand no engine reports. The operator watches the gateway pods (`kvpilot operator
--gateway-pods NAMESPACE:SELECTOR`, the chart's gateway Deployment's labels; an idle watch costs no
requests), and every round the loop reads each ready one's /metrics
(`kvpilot_gateway_held_requests{namespace,service}`) and sums them per service; the decisions count
the sum as waiting work. A gateway pod that cannot be read is unknown, never "holds nothing": the
decisions then hold off any scale-down (decisions.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from kvpilot.operator.api.names import PORT, PORT_NAME, label_selector
from kvpilot.operator.kube.indexes import index_entry, pod_urls
from kvpilot.operator.kube.watches import Index, Watched


class GatewayPods(BaseModel):
    """Where the gateway pods are: a namespace and the labels they all carry."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    labels: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> GatewayPods:
        """`NAMESPACE:key=value,key=value` (neither a namespace nor a label holds a colon)."""
        namespace, colon, selector = text.partition(":")
        pairs = [pair.partition("=") for pair in selector.split(",") if pair]
        if not colon or not namespace or not pairs or any(not key or not eq or not value for key, eq, value in pairs):
            raise ValueError(f"{text!r} is not NAMESPACE:key=value[,key=value...]")
        return cls(namespace=namespace, labels={key: value for key, _, value in pairs})

    def __str__(self) -> str:
        return f"{self.namespace}:{label_selector(self.labels)}"


def gateway_pod_entry(pod: Mapping[str, Any], key_label: str | None = None) -> dict[Any, Any]:
    """What the loop keeps of a gateway pod: index_entry's, with its containers' ports (where its
    /metrics is) of the spec index_entry leaves out."""
    ports = [
        {"name": port.get("name"), "containerPort": port.get("containerPort")}
        for container in (pod.get("spec") or {}).get("containers") or []
        for port in container.get("ports") or []
    ]
    return {key: {**entry, "spec": {"containers": [{"ports": ports}]}} for key, entry in index_entry(pod).items()}


def gateway_watch(where: GatewayPods) -> Watched:
    """The watch that keeps the gateway pods (kube/watches.py)."""
    return Watched("v1", "Pod", label_selector(where.labels), namespace=where.namespace, entry=gateway_pod_entry)


class GatewayView(NamedTuple):
    """Where the gateway pods are, and the index their watch keeps."""

    where: GatewayPods
    pods: Index


def _port(pod: Mapping[str, Any]) -> int:
    """The container port named like the engines' (the chart's gateway names its port so too)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return PORT


def gateway_targets(pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, /metrics URL) of the ready gateway pods that are not going away. One that is not
    ready takes no requests (starting: its watches have not listed; stopping: it answered what it
    held with a 503), so it holds none."""
    return [(name, f"{url}/metrics") for name, url in pod_urls(pods, _port)]


class GatewayRead(BaseModel):
    """What the gateways hold for one service this period: `held`, summed over the gateway pods
    that answered (a floor when some did not); `unknown`, the gateway pods that did not, each with
    why (or why none could be listed)."""

    model_config = ConfigDict(frozen=True)

    held: float = 0.0
    unknown: tuple[str, ...] = ()


class GatewayQueues(BaseModel):
    """One round's read of every gateway pod: the requests held per (namespace, service)."""

    model_config = ConfigDict(frozen=True)

    held: dict[tuple[str, str], float] = {}
    unknown: tuple[str, ...] = ()

    @classmethod
    def of_reads(cls, reads: Sequence[tuple[str, Mapping[tuple[str, str], float] | str]]) -> GatewayQueues:
        """From each gateway pod's parsed /metrics, or why there is none."""
        held: dict[tuple[str, str], float] = {}
        unknown = []
        for name, read in reads:
            if isinstance(read, str):
                unknown.append(f"{name}: {read}")
                continue
            for key, value in read.items():
                held[key] = held.get(key, 0.0) + value
        return cls(held=held, unknown=tuple(sorted(unknown)))

    def of(self, namespace: str, name: str) -> GatewayRead:
        return GatewayRead(held=self.held.get((namespace, name), 0.0), unknown=self.unknown)
