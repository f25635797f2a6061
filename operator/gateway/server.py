"""The gateway: one OpenAI-compatible endpoint in front of every InferenceService, and the
component that holds a request arriving at zero replicas until a replica serves it.

It runs inside the operator (`kvpilot operator --gateway HOST:PORT`, the chart's `gateway.*`
values), as KubeAI's proxy does, and reads the same kopf indexes as the autoscaler's loop, so
routing costs no API reads. A request's `model` names the InferenceService (its
`model.servedModelName`, else `model.name`); it goes to the ready engine pod with the fewest
requests in flight through this gateway. When none is ready:
- at 0 replicas (scaled to zero by the autoscaler, `autoscaling.minReplicas: 0`), the gateway sets
  1 through the scale subresource, posts an Event, and holds the request;
- while pods start, it holds the request too;
until an engine accepts the connection or `hold_seconds` pass (then 503 with Retry-After). A
connection refused before anything was sent (an engine still loading, or gone) is retried on
another pod or after a short wait, never answered with an error while the hold lasts.

Routing decisions are pure functions in routing.py (tests/operator/gateway/).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpilot.operator.gateway.routing import choose, route, served_model
from kvpilot.operator.kube.cluster import KubeCluster
from kvpilot.operator.kube.events import scaling_event
from kvpilot.operator.kube.indexes import (
    children,
    current_replicas,
    engine_urls,
    indexed_children,
    indexed_service,
    indexed_services,
)

# Knative's activator and KServe hold a request for up to their revision timeout (300 s by
# default); a cold replica here must schedule, pull and load a model, which takes about that.
HOLD_SECONDS = 300.0
RETRY_AFTER_SECONDS = 10
# How long a refused engine is passed over before it is tried again.
REFUSED_BACKOFF_SECONDS = 1.0
MAX_BODY_BYTES = 16 << 20  # the engine's own default limit
# Headers that describe one hop, not the request (RFC 9110 7.6.1), and those aiohttp sets itself.
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}

log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str | None = None, retry_after: int | None = None) -> web.Response:
    """An OpenAI-shaped error, as the engine writes them."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "service_unavailable",
            "param": "model" if status == 404 else None,
            "code": code,
        }
    }
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response(body, status=status, headers=headers)


@dataclass
class _Held:
    """Per InferenceService: requests in flight per engine, and engines that refused lately."""

    in_flight: dict[str, int] = field(default_factory=dict)
    refused_until: dict[str, float] = field(default_factory=dict)
    scaling: asyncio.Lock = field(default_factory=asyncio.Lock)


class Gateway:
    """The HTTP side. `services`, `deployments`, `replicasets` and `pods` are the autoscaler's kopf indexes;
    `cluster` (the operator's one adapter, blocking: used from a thread) writes the scale
    subresource and the Event when a service wakes from zero."""

    def __init__(
        self,
        services: Mapping[Any, Any],
        deployments: Mapping[Any, Any],
        replicasets: Mapping[Any, Any],
        pods: Mapping[Any, Any],
        cluster: KubeCluster,
        hold_seconds: float = HOLD_SECONDS,
    ) -> None:
        self._indexes = services, deployments, replicasets, pods
        self._cluster = cluster
        self.hold_seconds = hold_seconds
        self._held: dict[tuple[str, str], _Held] = {}
        self._instance = socket.gethostname()
        self._session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/v1/models", self._models),
                web.post("/v1/completions", self._forward),
                web.post("/v1/chat/completions", self._forward),
            ]
        )
        self.app.on_cleanup.append(self._close)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _services(self) -> list[Mapping[str, Any]]:
        return indexed_services(self._indexes[0])

    def _service(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        return indexed_service(self._indexes[0], key)

    def _children(self, service: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]]]:
        """Its own Deployment (None: none yet, or someone else's) and its engine pods (its own
        ReplicaSets' pods only, not any that carries their labels)."""
        _, deployments, replicasets, pods = self._indexes
        return children(service, *indexed_children(deployments, replicasets, pods, service))

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        models = sorted({m for s in self._services() if (m := served_model(s))})
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvpilot"} for m in models]}
        )

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large")
        try:
            body = json.loads(raw)
            model = body["model"]
        except (ValueError, KeyError, TypeError):
            return _error(400, "the body must be a JSON object with a `model`")
        services = self._services()
        try:
            key = route(str(model), services)
        except LookupError as error:
            return _error(404, str(error), "model_not_found")
        held = self._held.setdefault(key, _Held())
        deadline = time.monotonic() + self.hold_seconds
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        while time.monotonic() < deadline:
            service = self._service(key)
            if service is None:
                return _error(404, f"the InferenceService {'/'.join(key)} is gone", "model_not_found")
            _, pods = self._children(service)
            url = choose(engine_urls(pods), held.in_flight, held.refused_until, time.monotonic())
            if url is None:
                await self._scale_from_zero(key, held)  # a no-op unless the service is at 0
                await asyncio.sleep(0.25)
                continue
            try:
                return await self._proxy(request, url, raw, headers, held)
            except aiohttp.ClientConnectorError:
                # Nothing was sent: the engine is not listening (yet). Another one, or later.
                held.refused_until[url] = time.monotonic() + REFUSED_BACKOFF_SECONDS
        return _error(
            503,
            f"no replica of {'/'.join(key)} became ready within {self.hold_seconds:g} s",
            retry_after=RETRY_AFTER_SECONDS,
        )

    async def _proxy(
        self, request: web.Request, url: str, raw: bytes, headers: Mapping[str, str], held: _Held
    ) -> web.StreamResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False
            )
        held.in_flight[url] = held.in_flight.get(url, 0) + 1
        try:
            async with self._session.post(f"{url}{request.path}", data=raw, headers=headers) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            held.in_flight[url] -= 1

    def _at_zero(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        """The InferenceService while it has its Deployment and 0 replicas, else None."""
        service = self._service(key)
        if service is None:
            return None
        deployment, _ = self._children(service)
        return service if deployment is not None and current_replicas(service, deployment) == 0 else None

    async def _scale_from_zero(self, key: tuple[str, str], held: _Held) -> None:
        """0 -> 1, once for all the requests held at the time."""
        async with held.scaling:
            service = self._at_zero(key)
            if service is None:
                return
            await asyncio.to_thread(self._write_scale, service)
            # The index catches up through the watch; until then no held request may write again.
            deadline = time.monotonic() + 10.0
            while self._at_zero(key) is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.25)

    def _write_scale(self, service: Mapping[str, Any]) -> None:
        metadata = service["metadata"]
        message = "a request arrived at 0 replicas: 0 -> 1 (the gateway holds it until a replica serves it)"
        self._cluster.write_replicas(
            service, 1, scaling_event(service, "ScaledUp", message, time.time(), self._instance)
        )
        log.info(f"gateway: {metadata['namespace']}/{metadata['name']}: a request arrived at 0 replicas: 0 -> 1")

    async def serve(self, host: str, port: int) -> web.AppRunner:
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner
