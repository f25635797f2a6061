"""Stand-ins for a misbehaving engine's /metrics, served on its pod's address.

A test stops a pod's real engine (`PodRunner.break_engine`: the pod stays Running and Ready, and
no other pod's engine takes its address) and serves one of these on the engine's host and port:

- `hang`: /metrics answers 200 and then one byte of a real exposition a second, for ever: a
  reader whose timeout bounds each socket read, not the whole answer, never gives up on it;
- `nan`: /metrics is a live sibling engine's exposition with its waiting-requests and KV-usage
  gauges set to NaN, as an engine with a broken gauge would report them.

/health and /ready answer 200, as a pod whose process runs. `served` counts /metrics requests.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import urllib.parse
from typing import Literal

import aiohttp
from aiohttp import web

from e2e.aio_server import AioServer

Mode = Literal["hang", "nan"]
# The gauges a NaN goes into: the queue signal and the KV signal.
_NAN_GAUGES = re.compile(r"^((?:kvpilot_num_requests_waiting|kvpilot_kv_cache_usage_ratio)(?:\{[^}]*\})?) \S+$", re.M)


def with_nan_gauges(exposition: str) -> str:
    """`exposition` with the waiting-requests and KV-usage samples' values replaced by NaN."""
    replaced, count = _NAN_GAUGES.subn(r"\1 NaN", exposition)
    if count < 2:
        raise ValueError(f"the exposition has {count} of the gauges to replace, expected both")
    return replaced


class MetricsStandIn(AioServer):
    """Serves `mode`'s /metrics at `url` (the broken engine's base URL); `sibling` is the base URL
    of the engine whose exposition `nan` copies."""

    def __init__(self, url: str, mode: Mode, sibling: str | None = None) -> None:
        if mode == "nan" and sibling is None:
            raise ValueError("a nan stand-in copies a sibling engine's exposition: give its URL")
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/ready", self._ok)
        where = urllib.parse.urlsplit(url)
        assert where.hostname is not None and where.port is not None, url
        super().__init__(f"metrics-{mode}", app, where.hostname, where.port)
        self.mode, self.sibling = mode, sibling
        self.served = 0

    async def _ok(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.served += 1
        if self.mode == "nan":
            async with (
                aiohttp.ClientSession(trust_env=False) as session,
                session.get(f"{self.sibling}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as sibling,
            ):
                text = await sibling.text()
            return web.Response(text=with_nan_gauges(text), content_type="text/plain", charset="utf-8")
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        line = b"# HELP kvpilot_num_requests_waiting Requests waiting to be scheduled.\n"
        for i in itertools.count():
            if self.stopping.is_set():
                break
            await response.write(line[i % len(line) : i % len(line) + 1])
            await asyncio.sleep(1.0)
        # Never a complete answer, not even when the stand-in stops: the connection is dropped.
        if request.transport is not None:
            request.transport.abort()
        return response
