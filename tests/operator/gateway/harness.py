"""What the gateway's tests share: the objects the watches would hold, those watches' stand-in
(dicts the test edits), the cluster's stand-in (a recorder of scale writes), stand-in engines
(real aiohttp servers on loopback addresses at names.PORT) and the gateway itself on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from e2e.procs import free_port
from kvpilot.operator.api.names import INSTANCE_LABEL, PORT, SCALED_TO_ZERO_AT
from kvpilot.operator.gateway import server as gw
from kvpilot.operator.gateway.limits import Limits
from kvpilot.operator.gateway.main import WATCHED
from kvpilot.operator.kube.indexes import index_entry

NS = "team"
UID = "uid-1"
# Pods listen on names.PORT; each stand-in engine gets its own loopback address for it.
POD_IPS = ("127.77.0.1", "127.77.0.2", "127.77.0.3")


def service(
    name: str = "chat",
    model: str = "SmolLM2",
    replicas: int | None = 1,
    served: str | None = None,
    namespace: str = NS,
    uid: str = UID,
    autoscaling: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": model, **({"servedModelName": served} if served else {})}}
    if replicas is not None:
        spec["replicas"] = replicas
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        "spec": spec,
        "status": status or {},
    }


def asleep(**changes: Any) -> dict[str, Any]:
    """A service the SLO autoscaler scaled to zero (minReplicas 0, its marker in the status)."""
    return service(
        **{
            "replicas": 0,
            "autoscaling": {"mode": "slo", "minReplicas": 0},
            "status": {"autoscaler": {SCALED_TO_ZERO_AT: "2026-01-01T00:00:00Z"}},
            **changes,
        }
    )


def deployment(
    name: str = "chat", replicas: int = 1, uid: str = UID, namespace: str = NS, instance: str | None = None
) -> dict[str, Any]:
    """The service's Deployment (`instance`: the service's name where the Deployment's differs, as
    a mixed pool's `<service>-<gpu type>`)."""
    return {
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"dep-{uid}" if instance is None else f"dep-{uid}-{name}",
            "labels": {INSTANCE_LABEL: instance or name},
            "ownerReferences": [{"controller": True, "uid": uid}],
        },
        "spec": {"replicas": replicas},
    }


def replicaset(
    name: str = "chat-5d8f", owner: str = f"dep-{UID}", instance: str = "chat", namespace: str = NS
) -> dict[str, Any]:
    """The ReplicaSet the Deployment controller makes (owner: the Deployment's uid), with the pod
    template's labels."""
    return {
        "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"rs-{namespace}-{name}",
            "labels": {INSTANCE_LABEL: instance},
            "ownerReferences": [{"controller": True, "uid": owner}],
        },
    }


def pod(
    name: str,
    ip: str,
    ready: bool = True,
    owner: str = "chat",
    replicaset: str = "chat-5d8f",
    namespace: str = NS,
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {INSTANCE_LABEL: owner},
            "ownerReferences": [{"controller": True, "uid": f"rs-{namespace}-{replicaset}"}],
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def serving(ips: tuple[str, ...] = POD_IPS[:1], namespace: str = NS, **changes: Any) -> list[dict[str, Any]]:
    """A service with a Deployment of len(ips) replicas whose pods are ready at `ips`."""
    name, uid = changes.get("name", "chat"), changes.get("uid", UID)
    return [
        service(namespace=namespace, **changes),
        deployment(name, replicas=len(ips), namespace=namespace, uid=uid),
        replicaset(f"{name}-5d8f", namespace=namespace, owner=f"dep-{uid}", instance=name),
        *(
            pod(f"{name}-p{i}", ip, owner=name, replicaset=f"{name}-5d8f", namespace=namespace)
            for i, ip in enumerate(ips)
        ),
    ]


# Each kind's key label, as the gateway's watches key them (gateway/main.py).
KEY_LABELS = {watched.kind: watched.key_label for watched in WATCHED}


class Indexes:
    """What the watches would hold, keyed as the gateway's watches key them (the operator's
    process.py keys its own the same way: children by their service's instance label)."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.services: dict[Any, list[Any]] = {}
        self.deployments: dict[Any, list[Any]] = {}
        self.replicasets: dict[Any, list[Any]] = {}
        self.pods: dict[Any, list[Any]] = {}
        self.put(*objects)

    def all(self) -> tuple[Any, Any, Any, Any]:
        """The four indexes in the order the gateway and the autoscaling loop take them."""
        return self.services, self.deployments, self.replicasets, self.pods

    def put(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            index = {
                "InferenceService": self.services,
                "Deployment": self.deployments,
                "ReplicaSet": self.replicasets,
                "Pod": self.pods,
            }[obj["kind"]]
            for key, value in index_entry(obj, KEY_LABELS[obj["kind"]]).items():
                index[key] = [v for v in index.get(key, []) if v["metadata"]["name"] != obj["metadata"]["name"]]
                index[key].append(value)

    def as_json(self) -> dict[str, list[Any]]:
        return {
            kind: [[list(key), values] for key, values in index.items()]
            for kind, index in (
                ("services", self.services),
                ("deployments", self.deployments),
                ("replicasets", self.replicasets),
                ("pods", self.pods),
            )
        }


class Recorder:
    """The cluster adapter's stand-in: records scale writes and Events; `on_scale` plays the cluster."""

    def __init__(self, on_scale: Callable[[int], None]) -> None:
        self.scales: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._on_scale = on_scale

    def write_replicas(
        self, body: dict[str, Any], replicas: int, event: dict[str, Any], resource_version: str | None = None
    ) -> None:
        self.scales.append({"service": body["metadata"]["name"], "spec": {"replicas": replicas}})
        self.events.append(event)
        self._on_scale(replicas)


class Engine:
    """A stand-in engine on ip:names.PORT: streams `chunks` SSE chunks naming itself, `delay`
    seconds apart, and records what it was sent and how many requests it had at once. With a
    `barrier`, each request waits (up to 20 s) until the barrier's parties have all arrived, so a
    peak does not depend on how fast a slow machine sends them. Its first `refusals` requests get
    the engine's 503 for a model not loaded yet, with `retry_after` (None: no Retry-After)."""

    def __init__(
        self,
        name: str,
        chunks: int = 3,
        delay: float = 0.1,
        barrier: asyncio.Barrier | None = None,
        refusals: int = 0,
        retry_after: str | None = "1",
    ) -> None:
        self.name, self.chunks, self.delay, self.barrier = name, chunks, delay, barrier
        self.refusals, self.retry_after = refusals, retry_after
        self.requests: list[dict[str, Any]] = []
        self.now = self.peak = self.cancelled = 0
        self.runner: web.AppRunner | None = None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        if len(self.requests) <= self.refusals:
            error = {"message": "the model is not loaded", "type": "service_unavailable", "param": None, "code": None}
            headers = {"X-Engine": self.name, **({"Retry-After": self.retry_after} if self.retry_after else {})}
            return web.json_response({"error": error}, status=503, headers=headers)
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            if self.barrier is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.barrier.wait(), 20.0)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": self.name})
            await response.prepare(request)
            for i in range(self.chunks):
                chunk = {"engine": self.name, "i": i, "model": body["model"]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.delay)
            await response.write(b"data: [DONE]\n\n")
            return response
        except asyncio.CancelledError:  # the gateway closed the connection: the request is aborted
            self.cancelled += 1
            raise
        finally:
            self.now -= 1

    async def start(self, ip: str) -> Engine:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.completions)]
        )
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, ip, PORT).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


Scenario = Callable[[Indexes, Recorder, str, aiohttp.ClientSession], Awaitable[None]]


def run(
    scenario: Scenario,
    limits: Limits | None = None,
    on_scale: Callable[[Indexes, int], None] | None = None,
    **limit_changes: Any,
) -> Recorder:
    """The gateway on 127.0.0.1 over fresh indexes; `on_scale` plays the cluster's answer to a
    scale write (default: the InferenceService's replicas change, nothing else)."""
    indexes = Indexes()

    def scaled(replicas: int) -> None:
        if on_scale is not None:
            on_scale(indexes, replicas)
            return
        (body,) = indexes.services[(NS, "chat")]
        indexes.put({**body, "kind": "InferenceService", "spec": {**body["spec"], "replicas": replicas}})

    recorder = Recorder(scaled)
    chosen = (limits or Limits(hold_seconds=20.0)).model_copy(update=limit_changes)

    async def main() -> None:
        gateway = gw.Gateway(indexes.services, indexes.deployments, indexes.replicasets, indexes.pods, recorder, chosen)
        port = free_port()
        runner = await gateway.serve("127.0.0.1", port)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                await scenario(indexes, recorder, f"http://127.0.0.1:{port}", http)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return recorder


def url(base: str, namespace: str = NS, path: str = "completions") -> str:
    return f"{base}/namespaces/{namespace}/v1/{path}"


async def complete(
    http: aiohttp.ClientSession, base: str, model: str = "SmolLM2", namespace: str = NS, **headers: str
) -> tuple[int, str, Any]:
    body = {"model": model, "prompt": "hi", "stream": True}
    async with http.post(url(base, namespace), json=body, headers=headers) as r:
        return r.status, r.headers.get("X-Engine", ""), await r.text()
