"""Issue 23, findings 5 and 6, and the gateway's stop: faults before a request byte reaches an
engine are retried on another pod (the failed one backed off), faults after it are an OpenAI 502
and never retried; an engine that goes silent is given up; hop-by-hop headers, credentials meant for
the proxy and a request's Content-Encoding stay behind; X-Forwarded-For is added. A SIGTERM answers
what is held (503 + Retry-After) and cuts a stream visibly.

Before: a connect timeout was an empty 504 with no retry and least-in-flight then favoured the dead
pod; a hung engine pinned a handler forever; errors were plain text; `Content-Encoding: gzip` went
on with a decoded body; headers named in `Connection` and `Proxy-Authorization` went through."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from e2e.procs import LOOPBACK, free_port, start_http
from kvpilot.operator.api.names import PORT
from kvpilot.operator.gateway.limits import RETRY_AFTER_SECONDS, Limits

from .harness import POD_IPS, Engine, Indexes, Recorder, complete, pod, run, serving, url

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def blackhole() -> Iterator[str]:
    """An address whose listener never accepts and whose backlog is full: a connect to it times out."""
    ip = POD_IPS[0]
    listener = socket.create_server((ip, PORT), backlog=0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex((ip, PORT))
        fillers.append(filler)
    time.sleep(0.2)
    try:
        yield ip
    finally:
        for s in [*fillers, listener]:
            s.close()


def test_a_connect_timeout_is_retried_on_a_healthy_pod(blackhole: str) -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving((blackhole, POD_IPS[1])))
        healthy = await Engine("healthy").start(POD_IPS[1])
        try:
            first = await complete(http, base)  # tries the dead pod first (sorted, both idle)
            rest = await asyncio.gather(*(complete(http, base) for _ in range(6)))
        finally:
            await healthy.stop()
        assert [(s, name) for s, name, _ in [first, *rest]] == [(200, "healthy")] * 7

    run(scenario, upstream_connect_seconds=0.5)


def test_a_refused_connection_is_retried_and_the_pod_backed_off() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:2]))  # nothing listens at POD_IPS[0]
        healthy = await Engine("healthy").start(POD_IPS[1])
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(6)))
        finally:
            await healthy.stop()
        assert [(s, name) for s, name, _ in results] == [(200, "healthy")] * 6

    run(scenario)


def test_an_engine_still_loading_is_passed_over_and_tried_again_when_it_asked() -> None:
    """A pod Ready before its engine has loaded the model (a readiness probe's period; kwok marks
    pods Ready at once): the engine's 503 + Retry-After generated nothing, so the gateway holds the
    request and tries again after the time the engine asked, instead of relaying the 503 (measured:
    a CI run where scale-from-zero's first request got "the model is not loaded" after the openai
    client's own two retries)."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        loading = await Engine("loading", refusals=2).start(POD_IPS[0])
        started = time.monotonic()
        try:
            status, name, _ = await complete(http, base)
        finally:
            await loading.stop()
        assert (status, name) == (200, "loading") and len(loading.requests) == 3
        assert time.monotonic() - started >= 2.0  # it waited the Retry-After (1 s) each time

    run(scenario)


def test_a_refusing_engine_sends_its_requests_to_another() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:2]))
        draining = await Engine("draining", refusals=100, retry_after="5").start(POD_IPS[0])
        healthy = await Engine("healthy").start(POD_IPS[1])
        try:
            results = [await complete(http, base) for _ in range(4)]
        finally:
            await draining.stop()
            await healthy.stop()
        assert [(s, name) for s, name, _ in results] == [(200, "healthy")] * 4
        assert len(draining.requests) <= 1  # tried once at most (sorted, both idle), then passed over

    run(scenario)


def test_an_engine_that_refuses_for_the_whole_hold_gets_its_reason_in_the_503() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        loading = await Engine("loading", refusals=100).start(POD_IPS[0])
        try:
            async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi"}) as r:
                status, retry_after, body = r.status, r.headers.get("Retry-After"), await r.json()
        finally:
            await loading.stop()
        assert (status, retry_after) == (503, str(RETRY_AFTER_SECONDS))
        message = body["error"]["message"]
        assert "within 2.5 s" in message and "(the last one tried: the model is not loaded)" in message
        assert 2 <= len(loading.requests) <= 4  # once a second, not a busy loop

    run(scenario, hold_seconds=2.5)


def test_a_503_without_retry_after_is_relayed_never_retried() -> None:
    """Our engine's 503 without Retry-After (it failed mid-request) may follow generation."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:2]))
        failed = await Engine("failed", refusals=100, retry_after=None).start(POD_IPS[0])
        healthy = await Engine("healthy").start(POD_IPS[1])
        try:
            status, name, text = await complete(http, base)
        finally:
            await failed.stop()
            await healthy.stop()
        assert (status, name) == (503, "failed") and "the model is not loaded" in text
        assert len(failed.requests) == 1 and healthy.requests == []

    run(scenario)


async def _crasher(ip: str, seen: list[bytes]) -> asyncio.Server:
    """An engine that reads the request and drops the connection without answering."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(65536))
        writer.transport.abort()

    return await asyncio.start_server(handle, ip, PORT)


def test_a_failure_after_the_request_reached_an_engine_is_an_openai_502_never_retried() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:2]))
        seen: list[bytes] = []
        crasher = await _crasher(POD_IPS[0], seen)
        healthy = await Engine("healthy").start(POD_IPS[1])
        try:
            async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi"}) as r:
                status, body = r.status, await r.json()
        finally:
            crasher.close()
            await healthy.stop()
        assert status == 502 and body["error"]["type"] == "upstream_error"
        assert "failed before answering" in body["error"]["message"]
        assert len(seen) == 1 and healthy.requests == []  # sent once, never again elsewhere

    run(scenario)


def test_an_engine_that_goes_silent_is_given_up_and_the_stream_is_visibly_cut() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        hung = await Engine("hung", chunks=2, delay=60).start(POD_IPS[0])  # one chunk, then silence
        try:
            started = time.monotonic()
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi", "stream": True}) as r:
                    assert r.status == 200
                    async for chunk in r.content.iter_any():
                        received += chunk
            assert time.monotonic() - started < 5
        finally:
            await hung.stop()
        assert received.count(b'"engine": "hung"') == 1 and b'"type": "upstream_error"' in received

    run(scenario, upstream_idle_seconds=1.0)


def test_hop_by_hop_headers_proxy_credentials_and_content_encoding_stay_behind() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        engine = await Engine("e0").start(POD_IPS[0])
        body = json.dumps({"model": "SmolLM2", "prompt": "hi"}).encode()
        headers = {
            "Content-Encoding": "gzip",
            "Content-Type": "application/json",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "for the gateway only",
            "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0",
            "Authorization": "Bearer for-the-engine",
            "X-Forwarded-For": "203.0.113.7",
        }
        try:
            async with http.post(url(base), data=gzip.compress(body), headers=headers) as r:
                assert r.status == 200, await r.text()
        finally:
            await engine.stop()
        ((sent),) = engine.requests
        got = {k.lower(): v for k, v in sent["headers"].items()}
        assert sent["body"]["model"] == "SmolLM2"  # decoded, and sent without a Content-Encoding
        assert "content-encoding" not in got and "x-hop" not in got and "proxy-authorization" not in got
        assert got["authorization"] == "Bearer for-the-engine"
        assert got["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"

    run(scenario)


def test_a_sigterm_answers_held_requests_503_and_cuts_a_stream_visibly(tmp_path: Path) -> None:
    """The gateway's stop (gateway/main.py): nothing held is dropped silently, and a stream it cuts
    is a failure its client sees, never a short success."""
    indexes = Indexes()
    indexes.put(*serving(POD_IPS[:1]))
    indexes.put(
        *serving(POD_IPS[1:2], namespace="cold", uid="u2"), pod("chat-p0", POD_IPS[1], ready=False, namespace="cold")
    )
    (tmp_path / "indexes.json").write_text(json.dumps(indexes.as_json()))
    (tmp_path / "limits.json").write_text(Limits().model_dump_json())
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    argv = [sys.executable, "-m", "tests.operator.gateway.standalone", str(port)]
    argv += [str(tmp_path / "indexes.json"), str(tmp_path / "limits.json"), "1.5"]
    process = start_http(argv, tmp_path / "gateway.log", f"{base}/readyz", 30, cwd=ROOT)

    async def main() -> None:
        engine = await Engine("e0", chunks=100, delay=0.1).start(POD_IPS[0])
        try:
            async with aiohttp.ClientSession() as http:
                held = asyncio.create_task(complete(http, base, namespace="cold"))
                async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi", "stream": True}) as r:
                    await r.content.readline()
                    await asyncio.sleep(0.5)
                    process.popen.terminate()
                    await asyncio.sleep(0.3)
                    status, _, text = await held
                    assert status == 503 and "restarting" in text
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await r.read()
        finally:
            await engine.stop()

    try:
        asyncio.run(main())
        assert process.popen.wait(10) == 0
    finally:
        process.stop()


def test_the_readiness_probe_waits_for_the_watches() -> None:
    synced = False

    async def main() -> None:
        from kvpilot.operator.gateway.server import Gateway

        gateway = Gateway({}, {}, {}, {}, Recorder(lambda n: None), synced=lambda: synced)
        port = free_port()
        runner = await gateway.serve(LOOPBACK, port)
        nonlocal synced
        try:
            async with aiohttp.ClientSession() as http:
                assert (await http.get(f"http://{LOOPBACK}:{port}/readyz")).status == 503
                synced = True
                assert (await http.get(f"http://{LOOPBACK}:{port}/readyz")).status == 200
                gateway.draining = True
                assert (await http.get(f"http://{LOOPBACK}:{port}/readyz")).status == 503
        finally:
            await runner.cleanup()

    asyncio.run(main())
