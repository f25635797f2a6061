"""The gateway: one OpenAI-compatible endpoint in front of every InferenceService, and the
component that holds a request arriving at zero replicas until a replica serves it.

It is its own process (`kvpilot gateway`, the chart's gateway Deployment) and reads what its
watches hold (kube/watches.py): the InferenceServices, their Deployments, ReplicaSets and pods,
so routing costs no API reads. A client addresses a namespace in the path and a model in the body:
`POST /namespaces/<namespace>/v1/chat/completions` with `"model": "<servedModelName or model.name>"`
(routing.py), or a LoRA adapter's name (spec.adapters), whose requests go only to the pods that
hold it (status.adapters[].loadedOn, which the operator writes as it loads adapters). The request
goes to the ready engine pod with the fewest requests in flight through this gateway, up to twice
its plan's max_num_seqs. When none can take it, it is held:
- at 0 replicas that the SLO autoscaler set (routing.wake_refusal), the gateway sets 1 through the
  scale subresource and posts an Event; any other zero is a 503 at once;
- while pods start, no pod holds the adapter yet, or every engine is full or refuses it, it waits;
until an engine takes it or the hold ends (503 with Retry-After). An engine refuses with a 503 and
Retry-After before generating anything (its model still loading behind a pod the cluster already
calls Ready, the engine draining): the gateway passes it over for that long and tries another. What it holds is bounded
(limits.py): bodies by size, bytes and count per namespace or service and in all, each read within
a deadline and parsed one at a time.

Faults: a failure to connect (nothing sent) is retried on another pod, the failed one backed off
(doubling); any failure after that is an OpenAI-shaped 502, never retried (the engine may have
generated already). A client that leaves cancels its request, held or forwarded (the engine sees
the connection close and aborts it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvpilot.operator.gateway.auth import admits, namespace_admits, token_digest
from kvpilot.operator.gateway.body import BadBody, read_body
from kvpilot.operator.gateway.headers import client_response_headers, upstream_request_headers
from kvpilot.operator.gateway.limits import RETRY_AFTER_SECONDS, Admission, Limits, Refusal
from kvpilot.operator.gateway.metrics import GatewayMetrics, Now
from kvpilot.operator.gateway.routing import (
    Engines,
    adapter_of,
    holding,
    pick,
    route,
    served_in,
    shares,
    wake_refusal,
)
from kvpilot.operator.kube.events import scaling_event
from kvpilot.operator.kube.indexes import (
    children,
    current_replicas,
    engine_urls,
    indexed_children,
    indexed_service,
    indexed_services,
)

# How often a held request looks again for an engine.
POLL_SECONDS = 0.25
# Pooled connections to engines are closed after this idle time, shorter than the engine's own
# keep-alive (uvicorn: 5 s), so a request is never written onto a connection the engine is closing.
UPSTREAM_KEEPALIVE_SECONDS = 3.0
# How long after a scale write the gateway waits for its watch to see it before writing again.
SCALE_SETTLE_SECONDS = 10.0
# After a failed scale write, before the next try.
WAKE_RETRY_SECONDS = 2.0
PREFIX = "/namespaces/{namespace}/v1"
# An engine's refusal is small JSON; more is not read.
REFUSAL_BODY_BYTES = 4096
# How often per-service state (in-flight counts, backoffs, wake locks) of deleted services is dropped.
PRUNE_SECONDS = 60.0

log = logging.getLogger(__name__)


class Scaler(Protocol):
    def write_replicas(
        self, body: Mapping[str, Any], replicas: int, event: dict[str, Any], resource_version: str | None = None
    ) -> None: ...


def error(status: int, message: str, code: str | None = None, retry_after: int | None = None) -> web.Response:
    """An OpenAI-shaped error, as the engine writes them."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 else "upstream_error"
    body = {"error": {"message": message, "type": kind, "param": "model" if status == 404 else None, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response(body, status=status, headers=headers)


def _unauthorized() -> web.Response:
    response = error(401, "a valid API key is required: Authorization: Bearer <key>", "invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    response.force_close()  # the body may be unread
    return response


class _Answer(Exception):
    """Stop here and answer this."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def _refused(refusal: Refusal | None) -> None:
    if refusal is not None:
        raise _Answer(error(refusal.status, refusal.message, "overloaded", RETRY_AFTER_SECONDS))


@dataclass(frozen=True)
class EngineRefusal:
    message: str
    retry_after: float


async def _refusal(upstream: aiohttp.ClientResponse) -> EngineRefusal | None:
    """An engine's 503 with Retry-After in seconds: it refused the request before generating
    anything (its model still loading, the engine draining), so another replica, or this one
    later, may take it. A 503 without one (an engine that failed mid-request) is relayed."""
    retry_after = upstream.headers.get("Retry-After", "")
    if upstream.status != 503 or not retry_after.isdigit():
        return None
    body = await upstream.content.read(REFUSAL_BODY_BYTES)
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        message = "503 from the engine"
    return EngineRefusal(message, float(retry_after))


class _Taken:
    """Body bytes a request has taken from the admission counters (given back when it ends), and
    the service it was routed to (for its metrics)."""

    def __init__(self, namespace: str) -> None:
        self.namespace, self.count, self.service = namespace, 0, ""
        self.known = False  # a namespace with InferenceServices: its name may label metrics


class Gateway:
    """The HTTP side. `services`, `deployments`, `replicasets` and `pods` are what the watches hold
    (key -> list of index entries, kube/indexes.py); `scaler` (blocking: used from a thread) writes
    the scale subresource and the Event when a service wakes from zero; `synced` says whether the
    watches have listed everything once (the readiness probe)."""

    def __init__(
        self,
        services: Mapping[Any, Any],
        deployments: Mapping[Any, Any],
        replicasets: Mapping[Any, Any],
        pods: Mapping[Any, Any],
        scaler: Scaler,
        limits: Limits | None = None,
        synced: Callable[[], bool] = lambda: True,
    ) -> None:
        self._indexes = services, deployments, replicasets, pods
        self._scaler = scaler
        self.limits = limits or Limits()
        self.admission = Admission(self.limits)
        self._synced = synced
        self.draining = False
        self._engines: dict[tuple[str, str], Engines] = {}
        self._waking: dict[tuple[str, str], asyncio.Lock] = {}
        self._parsing = asyncio.Lock()
        self._pruned_at = time.monotonic()
        self._instance = socket.gethostname()
        self._session: aiohttp.ClientSession | None = None
        self.metrics = GatewayMetrics(
            Now(lambda: dict(self.admission.held), self._in_flight, lambda: dict(self.admission.body_bytes))
        )
        self.app = web.Application(client_max_size=self.limits.max_body_bytes)
        self.app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/metrics", self._metrics),
                web.get(f"{PREFIX}/models", self._models),
                web.post(f"{PREFIX}/completions", self._forward),
                web.post(f"{PREFIX}/chat/completions", self._forward),
                web.route("*", "/v1/{tail:.*}", self._unaddressed),
            ]
        )
        self.app.on_cleanup.append(self._close)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            limits = self.limits
            self._session = aiohttp.ClientSession(
                # No pool limit of aiohttp's (100 by default): how many requests an engine gets at
                # once is its plan's (routing.engine_capacity).
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=limits.upstream_connect_seconds, sock_read=limits.upstream_idle_seconds
                ),
                auto_decompress=False,
            )
        return self._session

    def _in_flight(self) -> dict[tuple[str, str], int]:
        counts = {key: sum(engines.in_flight.values()) for key, engines in self._engines.items()}
        return {key: count for key, count in counts.items() if count}

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    def busy(self) -> bool:
        """Whether any request is held or forwarded."""
        return bool(self.admission.held) or any(not engines.idle() for engines in self._engines.values())

    def _service(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        return indexed_service(self._indexes[0], key)

    def _children(self, service: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]]]:
        """Its own Deployment (None: none yet, or someone else's) and its engine pods (its own
        ReplicaSets' pods only, not any that carries their labels)."""
        _, deployments, replicasets, pods = self._indexes
        return children(service, *indexed_children(deployments, replicasets, pods, service))

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self._synced():
            return web.json_response({"status": "the watches have not listed everything yet"}, status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        digest = token_digest(request.headers.get("Authorization"))
        # Only the models the caller's key opens (all of them where no service asks for one).
        services = [s for s in indexed_services(self._indexes[0]) if admits(s, digest)]
        models = served_in(namespace, services)
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": namespace} for m in models]}
        )

    async def _unaddressed(self, _: web.Request) -> web.Response:
        return error(404, "address a namespace: /namespaces/<namespace>/v1/... (docs/gateway.md)", "not_found")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        taken = _Taken(request.match_info["namespace"])
        code = 499  # unless an answer is given: the client left
        try:
            response = await self._answer(request, taken)
            code = response.status
            return response
        finally:
            self.admission.give_bytes(taken.namespace, taken.count)
            # Any path names a namespace: only real ones become series, or a scan would grow them unbounded.
            key = (taken.namespace, taken.service) if taken.known else ("", "")
            self.metrics.answered(key, code, time.monotonic() - started)

    async def _answer(self, request: web.Request, taken: _Taken) -> web.StreamResponse:
        digest = token_digest(request.headers.get("Authorization"))
        services = indexed_services(self._indexes[0])
        taken.known = any(s["metadata"]["namespace"] == taken.namespace for s in services)
        try:
            if not taken.known:  # nothing to read a body for
                return error(404, f"no model is served in namespace {taken.namespace}", "model_not_found")
            if not namespace_admits(taken.namespace, services, digest):
                return _unauthorized()  # before a byte of the body is read
            raw = await self._read(request, taken)
            async with self._parsing:  # one parse at a time: its transient copy is bounded too
                routed = await asyncio.to_thread(read_body, raw)
            taken.service = route(taken.namespace, routed.model, indexed_services(self._indexes[0]))
            service = self._service((taken.namespace, taken.service))
            if service is None or not admits(service, digest):
                return _unauthorized()  # before any wake
            adapter = adapter_of(service, routed.model)
            return await self._dispatch(request, (taken.namespace, taken.service), raw, routed.prefix, adapter)
        except BadBody as bad:
            return error(400, str(bad))
        except LookupError as missing:
            return error(404, str(missing), "model_not_found")
        except _Answer as answer:
            return answer.response

    async def _read(self, request: web.Request, taken: _Taken) -> bytearray:
        """The body, decoded, within the size limit, the byte budgets and the read deadline."""
        limits = self.limits
        declared = request.content_length
        too_large = error(413, f"the request body is larger than {limits.max_body_bytes} bytes", "request_too_large")
        if declared is not None and declared > limits.max_body_bytes:
            too_large.force_close()
            raise _Answer(too_large)
        _refused(self.admission.take_bytes(taken.namespace, declared or 0))
        taken.count = declared or 0
        # One buffer, the declared size when known: no list of chunks joined into a second copy.
        body = bytearray(declared or 0)
        size = 0
        try:
            async with asyncio.timeout(limits.body_read_seconds):
                while chunk := await request.content.readany():
                    end = size + len(chunk)
                    if end > limits.max_body_bytes:
                        too_large.force_close()
                        raise _Answer(too_large)
                    if end > taken.count:  # chunked, or decoded larger than sent
                        _refused(self.admission.take_bytes(taken.namespace, end - taken.count))
                        taken.count = end
                    body[size:end] = chunk
                    size = end
        except TimeoutError:
            late = error(408, f"the request body did not arrive within {limits.body_read_seconds:g} s", "timeout")
            late.force_close()
            raise _Answer(late) from None
        del body[size:]  # a body shorter than declared
        return body

    async def _dispatch(
        self, request: web.Request, key: tuple[str, str], raw: bytearray, prefix: str, adapter: str | None = None
    ) -> web.StreamResponse:
        """Forward to an engine of `key` (`adapter`: one holding that LoRA adapter), holding the
        request while none can take it."""
        engines = self._engines.setdefault(key, Engines())
        headers = upstream_request_headers(request.headers.items(), request.remote)
        deadline = time.monotonic() + self.limits.hold_seconds
        held = False
        not_taken: str | None = None  # why the last engine tried did not take it
        try:
            while True:
                service = self._service(key)
                if service is None:
                    raise _Answer(error(404, f"the InferenceService {'/'.join(key)} is gone", "model_not_found"))
                deployment, pods = self._children(service)
                urls = engine_urls(pods)
                engines.forget_except([url for _, url in urls])
                candidates = urls if adapter is None else holding(service, adapter, urls)
                if urls and not candidates:
                    # Its pods are loading it (autoscaling/adapter_sync.py): held, as while pods start.
                    not_taken = f"none of its {len(urls)} ready replica(s) holds the adapter `{adapter}` yet"
                url = pick(service, candidates, engines, time.monotonic(), prefix, shares(service, pods))
                if url is not None:
                    if held:
                        self.admission.release(key)
                        held = False
                    answered = await self._proxy(request, url, raw, headers, engines)
                    if not isinstance(answered, str):
                        return answered
                    not_taken = answered
                    continue
                if not held:
                    _refused(self.admission.hold(key))
                    held = True
                await self._wait(key, service, deployment, deadline, not_taken)
        finally:
            if held:
                self.admission.release(key)
            self._prune()

    def _prune(self) -> None:
        """Forget, now and then, what was kept for services that are gone (and hold nothing)."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_SECONDS:
            return
        self._pruned_at = now
        for key in [k for k, engines in self._engines.items() if engines.idle() and self._service(k) is None]:
            del self._engines[key]
        for key in [k for k, lock in self._waking.items() if not lock.locked() and self._service(k) is None]:
            del self._waking[key]

    async def _wait(
        self,
        key: tuple[str, str],
        service: Mapping[str, Any],
        deployment: Mapping[str, Any] | None,
        deadline: float,
        not_taken: str | None,
    ) -> None:
        """One round of holding a request for which no engine is free: wake the service when it
        is at a zero the autoscaler set; answer when it may not be woken, the hold is over (saying
        why the last engine tried did not take it), or the gateway is stopping."""
        where = "/".join(key)
        if self.draining:
            raise _Answer(error(503, "the gateway is restarting: send it again", "restarting", RETRY_AFTER_SECONDS))
        if deployment is not None and current_replicas(service, deployment) == 0:
            why = wake_refusal(service, deployment)
            if why is not None:
                raise _Answer(error(503, f"{where} is at 0 replicas and the gateway does not wake it: {why}"))
            await self._scale_from_zero(key)
        if time.monotonic() >= deadline:
            raise _Answer(
                error(
                    503,
                    f"no replica of {where} could take the request within {self.limits.hold_seconds:g} s"
                    + (f" (the last one tried: {not_taken})" if not_taken else ""),
                    "no_replica",
                    RETRY_AFTER_SECONDS,
                )
            )
        await asyncio.sleep(POLL_SECONDS)

    async def _proxy(
        self, request: web.Request, url: str, raw: bytearray, headers: list[tuple[str, str]], engines: Engines
    ) -> web.StreamResponse | str:
        """The engine's answer relayed, or why it did not take the request when it surely generated
        nothing (try another engine, or this one later)."""
        engines.in_flight[url] = engines.in_flight.get(url, 0) + 1
        try:
            try:
                upstream = await self._client().post(
                    url + request.path.removeprefix(f"/namespaces/{request.match_info['namespace']}"),
                    data=raw,
                    headers=headers,
                    allow_redirects=False,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as failure:
                engines.failed(url, time.monotonic())
                return f"could not connect ({type(failure).__name__})"
            except (aiohttp.ClientError, TimeoutError) as failure:
                # Bytes may have reached the engine, which may be generating: never sent twice.
                return error(502, f"the engine failed before answering ({type(failure).__name__})", "upstream_error")
            engines.succeeded(url)
            async with upstream:
                refusal = await _refusal(upstream)
                if refusal is not None:
                    engines.refused(url, time.monotonic(), refusal.retry_after)
                    return refusal.message
                return await self._relay(request, upstream)
        finally:
            engines.in_flight[url] -= 1

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(
            status=upstream.status, headers=CIMultiDict(client_response_headers(upstream.headers.items()))
        )
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as failure:
            # The engine stopped mid-answer: the client must see a failure, not a short success.
            log.info(f"gateway: {request.path}: the engine failed mid-answer: {type(failure).__name__}")
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                message = f"the engine failed mid-answer ({type(failure).__name__})"
                event = {"error": {"message": message, "type": "upstream_error", "code": "upstream_error"}}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if request.transport is not None:
                request.transport.close()  # no last chunk: the client sees the answer cut
            return response
        await response.write_eof()
        return response

    async def _scale_from_zero(self, key: tuple[str, str]) -> None:
        """0 -> 1, once for all the requests held at the time."""
        async with self._waking.setdefault(key, asyncio.Lock()):
            if self._waking_refused(key):
                return
            service = self._service(key)
            assert service is not None
            try:
                await asyncio.to_thread(self._write_scale, service)
            # Whatever refused the write (the API server away, a conflict, a 403): not woken yet;
            # the requests stay held and a later round writes again.
            except Exception as failure:  # noqa: BLE001
                log.warning(f"gateway: {'/'.join(key)}: the scale to 1 failed: {type(failure).__name__}: {failure}")
                await asyncio.sleep(WAKE_RETRY_SECONDS)
                return
            # The watch catches up; until then no held request may write again.
            deadline = time.monotonic() + SCALE_SETTLE_SECONDS
            while not self._waking_refused(key) and time.monotonic() < deadline:
                await asyncio.sleep(POLL_SECONDS)

    def _waking_refused(self, key: tuple[str, str]) -> bool:
        service = self._service(key)
        return service is None or wake_refusal(service, self._children(service)[0]) is not None

    def _write_scale(self, service: Mapping[str, Any]) -> None:
        metadata = service["metadata"]
        message = "a request arrived at 0 replicas: 0 -> 1 (the gateway holds it until a replica serves it)"
        self._scaler.write_replicas(
            service, 1, scaling_event(service, "ScaledUp", message, time.time(), self._instance)
        )
        log.info(f"gateway: {metadata['namespace']}/{metadata['name']}: a request arrived at 0 replicas: 0 -> 1")

    async def serve(self, host: str, port: int) -> web.AppRunner:
        runner = web.AppRunner(
            self.app,
            access_log=None,
            # A client that leaves cancels its handler: a held request is never forwarded, a
            # forwarded one's connection to the engine closes (the engine aborts it).
            handler_cancellation=True,
            keepalive_timeout=self.limits.keepalive_seconds,
            # A stopping gateway has drained already (main.py): what still runs is cut at once.
            shutdown_timeout=0.5,
        )
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner
