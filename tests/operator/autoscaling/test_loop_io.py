"""The autoscaler's loop against engines that answer slowly or not at all, on real sockets: each
read has a total deadline, and one service's slow engines hold up only that service's period
(operator/autoscaling/loop.py). Every address is on 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client import generate_latest

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator.api.names import PORT
from kvpilot.operator.autoscaling import loop as loop_module
from kvpilot.operator.autoscaling.loop import AutoscalingLoop, read_metrics, read_prometheus

EXPOSITION = generate_latest(ServingMetrics("m").registry)
TRICKLE_SECONDS = 10.0
T = TypeVar("T")


def with_session(read: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`read(session, *args)` on an event loop and client session of its own."""

    async def once() -> T:
        async with aiohttp.ClientSession() as session:
            return await read(session, *args)

    return asyncio.run(once())


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a trickling handler must not hold up server_close()

    def __init__(self, address: tuple[str, int], respond: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.respond = respond
        self.stopping = threading.Event()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self.server.respond(self)

    def log_message(self, *args: Any) -> None:
        pass


def trickle(handler: BaseHTTPRequestHandler) -> None:
    """A valid start, then one byte every 0.2 s: every socket read returns well within any
    per-read timeout, and the body never ends."""
    server: _Server = handler.server  # type: ignore[assignment]
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(EXPOSITION)))
    handler.end_headers()
    deadline = time.monotonic() + TRICKLE_SECONDS
    for byte in EXPOSITION:
        if server.stopping.wait(0.2) or time.monotonic() > deadline:
            return
        try:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
        except OSError:
            return


def answer(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(EXPOSITION)))
    handler.end_headers()
    handler.wfile.write(EXPOSITION)


@pytest.fixture
def engines() -> Iterator[Callable[[Callable[[BaseHTTPRequestHandler], None]], str]]:
    """Starts a stand-in engine on the engine port of a loopback address of its own (the loop
    dials pod IPs on that port); returns the address."""
    servers: list[_Server] = []

    def start(respond: Callable[[BaseHTTPRequestHandler], None]) -> str:
        for _ in range(50):
            ip = f"127.{random.randrange(1, 255)}.{random.randrange(0, 256)}.{random.randrange(1, 255)}"
            try:
                server = _Server((ip, PORT), respond)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue
            servers.append(server)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            return ip
        raise RuntimeError("no free loopback address for a stand-in engine")

    yield start
    for server in servers:
        server.stopping.set()
        server.shutdown()
        server.server_close()


class Recorder:
    """The cluster adapter, recording status writes with when they came."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, float, dict[str, Any]]] = []

    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        resource_version: str | None = None,
    ) -> str:
        self.patches.append((name, time.monotonic(), patch))
        return "8"

    def write_replicas(self, *args: Any, **kwargs: Any) -> None:
        pass

    def first(self, name: str) -> tuple[float, dict[str, Any]] | None:
        return next(((at, patch) for who, at, patch in self.patches if who == name), None)


def service(name: str, ip: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """An InferenceService, its Deployment, their ReplicaSet and one ready engine pod at `ip`, as
    the indexes hold them."""
    uid = f"uid-{name}"
    body = {
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "resourceVersion": "7"},
        "spec": {"model": {"name": "llama-2-7b"}, "replicas": 1},
        "status": {},
    }
    deployment = {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"dep-{name}",
            "ownerReferences": [{"controller": True, "uid": uid}],
        },
        "spec": {"replicas": 1},
        "status": {"readyReplicas": 1},
    }
    replicaset = {
        "metadata": {
            "name": f"{name}-5d8f",
            "namespace": "ml",
            "uid": f"rs-{name}",
            "ownerReferences": [{"controller": True, "uid": f"dep-{name}"}],
        }
    }
    pod = {
        "metadata": {
            "name": f"{name}-0",
            "namespace": "ml",
            "labels": {"app.kubernetes.io/instance": name},
            "ownerReferences": [{"controller": True, "uid": f"rs-{name}"}],
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    return body, deployment, replicaset, pod


def test_a_trickling_engine_holds_up_only_its_own_service(
    engines: Callable[[Callable[[BaseHTTPRequestHandler], None]], str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`slow`'s engine sends its /metrics one byte at a time: past the read's total deadline the
    pod is unknown with the reason, and `quick` (listed after it) is decided on at once."""
    deadline = 1.0
    monkeypatch.setattr(loop_module, "SCRAPE_TIMEOUT_SECONDS", deadline)
    slow, quick = service("slow", engines(trickle)), service("quick", engines(answer))
    cluster = Recorder()
    indexes = [{("ml", s[0]["metadata"]["name"]): [s[i]] for s in (slow, quick)} for i in range(4)]
    loop = AutoscalingLoop(cluster, *indexes, interval=0.3)

    async def watch() -> float:
        started = time.monotonic()
        task = asyncio.create_task(loop.run())
        try:
            while not (cluster.first("slow") and cluster.first("quick")) and time.monotonic() - started < 4 * deadline:
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return started

    with caplog.at_level(logging.INFO, logger=loop_module.__name__):
        started = asyncio.run(watch())
    quick_written, slow_written = cluster.first("quick"), cluster.first("slow")
    assert quick_written is not None, "quick was never decided on: it waited behind slow's engine"
    assert quick_written[0] - started < deadline and quick_written[1]["autoscaler"]["unknownPods"] == []
    assert slow_written is not None, "slow's read has no total deadline"
    assert deadline <= slow_written[0] - started < 3 * deadline
    assert slow_written[1]["autoscaler"]["unknownPods"] == ["slow-0"]
    assert any("slow-0" in r.getMessage() and f"within {deadline:g} s" in r.getMessage() for r in caplog.records)


def redirect_to(location: str) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return respond


def test_redirects_are_not_followed(engines: Callable[[Callable[[BaseHTTPRequestHandler], None]], str]) -> None:
    """Whoever writes a spec or runs an engine image chooses what answers; a redirect would make
    the operator request any address it can reach (blind SSRF)."""
    elsewhere = engines(answer)
    redirecting = engines(redirect_to(f"http://{elsewhere}:{PORT}/metrics"))
    read = with_session(read_metrics, "a", f"http://{redirecting}:{PORT}/metrics")
    assert read.reading is None and "redirect" in read.error
    reads = with_session(read_prometheus, f"http://{redirecting}:{PORT}", "ml", ["a"])
    assert [r.reading for r in reads] == [None] and "redirect" in reads[0].error


def test_a_trickling_prometheus_is_cut_at_the_deadline(
    engines: Callable[[Callable[[BaseHTTPRequestHandler], None]], str],
) -> None:
    started = time.monotonic()
    reads = with_session(read_prometheus, f"http://{engines(trickle)}:{PORT}", "ml", ["b", "a"], 1.0)
    assert time.monotonic() - started < 2.0
    assert [r.name for r in reads] == ["a", "b"]
    assert all(r.reading is None and "within 1 s" in r.error for r in reads)
