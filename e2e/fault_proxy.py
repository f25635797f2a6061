"""A proxy in front of the API server that answers 500 and 429 while a test says so.

The operator's kubeconfig points at it (plain HTTP on loopback; it dials the API server over TLS
with the cluster's CA and passes the operator's bearer token through), everything else talks to
the API server directly. Passing, it streams requests and answers through unchanged, watches
included. After `fail()` it answers every new request, alternately, 500 (a Status "etcdserver:
request timed out", as an overloaded API server gives) and 429 with Retry-After: 1 (API priority
and fairness), and with `cut_streams` it ends the streams it holds too (the operator's watches),
until `recover()`.

Every request is recorded (`requests`): when, method, path, the answer's status, and the body of
writes, so a test can see each status and scale write the operator tried, answered or not.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from e2e.aio_server import AioServer
from e2e.procs import LOOPBACK, free_port
from kvpilot.operator.gateway.headers import HOP_BY_HOP

# Hop-by-hop headers (the gateway's list) and the framing aiohttp sets itself for each leg.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}
_WRITES = {"POST", "PUT", "PATCH", "DELETE"}
_MAX_RECORDED_BODY = 64 * 1024


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic() when it arrived
    method: str
    path: str  # with the query
    status: int  # the answer's status; 0 when the stream was cut or the API server not reached
    faulted: bool  # answered by the proxy's fault, not the API server
    body: Any = None  # the JSON body of a write, when it had one


def _status_body(code: int, reason: str, message: str) -> str:
    return json.dumps(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code}
    )


class ApiFaultProxy(AioServer):
    """`url` for the operator's kubeconfig; `fail()` and `recover()`; `requests`, the record."""

    def __init__(self, upstream: str, ca_data: str) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        super().__init__("api-fault-proxy", app, LOOPBACK, free_port())
        self.upstream = upstream.rstrip("/")
        self._ssl = ssl.create_default_context(cadata=base64.b64decode(ca_data).decode())
        self._faulty = False
        self._turn = itertools.count()
        self._open: set[asyncio.Task[Any]] = set()
        self._lock = threading.Lock()
        self._session: aiohttp.ClientSession | None = None
        self.requests: list[Request] = []
        self.cut = 0  # streams cut when a fault began

    @property
    def faulty(self) -> bool:
        return self._faulty

    def fail(self, cut_streams: bool) -> None:
        """Answer every new request 500 or 429 from now on. `cut_streams`: also end the streams
        (watches) it holds, as when the API server goes away; else they keep flowing, as from an
        API server whose watch cache still serves while etcd times out."""
        self._faulty = True
        if cut_streams:
            self.call(self._cut_streams)

    def recover(self) -> None:
        self._faulty = False

    def _cut_streams(self) -> None:
        for task in list(self._open):
            task.cancel()
            self.cut += 1

    def recorded(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def dump(self, path: Path, since: float = 0.0) -> None:
        """The record as JSON lines (arrival times relative to `since`), for a failing test's reader."""
        path.write_text(
            "".join(json.dumps({**dataclasses.asdict(r), "at": round(r.at - since, 3)}) + "\n" for r in self.recorded())
        )

    def _record(self, request: web.Request, at: float, status: int, faulted: bool, body: bytes) -> None:
        parsed = None
        if request.method in _WRITES and body and len(body) <= _MAX_RECORDED_BODY:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        with self._lock:
            self.requests.append(Request(at, request.method, request.path_qs, status, faulted, parsed))

    def _fault(self) -> web.Response:
        if next(self._turn) % 2:
            return web.Response(
                status=429,
                text=_status_body(429, "TooManyRequests", "the server has received too many requests"),
                content_type="application/json",
                headers={"Retry-After": "1"},
            )
        return web.Response(
            status=500,
            text=_status_body(500, "InternalError", "etcdserver: request timed out"),
            content_type="application/json",
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout: watches stay open for minutes. Bodies pass as they are (gzip too).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
                trust_env=False,
            )
        return self._session

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        at = time.monotonic()
        body = await request.read()
        if self._faulty:
            answer = self._fault()
            self._record(request, at, answer.status, True, body)
            return answer
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        status = 0
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
            async with self._client().request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            ) as upstream:
                status = upstream.status
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            self._open.discard(task)
            self._record(request, at, status if not task.cancelling() else 0, False, body)

    async def _serve(self) -> None:
        try:
            await super()._serve()
        finally:
            if self._session is not None:
                await self._session.close()
