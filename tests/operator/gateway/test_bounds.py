"""Issue 23, findings 1 and 2: what the gateway holds is bounded, and engines get requests as
fast as their plans allow.

Before: one anonymous 16 MiB body raised the process's RSS from 61 to 508 MiB (read and parsed
before routing), 24 held 8 MiB requests reached 489 MiB, nothing bounded held requests, the
body's read or an idle connection; aiohttp's pool let at most 100 requests reach all engines
(300 concurrent 2 s requests over 3 engines took 6.5 s)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from e2e.procs import LOOPBACK, Process, free_port, memory_kib, start_http
from kvpilot.operator.gateway.limits import RETRY_AFTER_SECONDS, Limits, MiB

from .harness import NS, POD_IPS, Engine, Indexes, Recorder, complete, pod, run, serving, url

ROOT = Path(__file__).resolve().parents[3]


def body_of(size: int) -> bytes:
    """A completion request of `size` bytes."""
    head = b'{"model": "SmolLM2", "prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[tuple[Process, str]]:
    """The gateway in its own process (its memory measured alone) in front of a service whose one
    pod never gets ready: every admitted request is held."""
    indexes = Indexes()
    indexes.put(*serving(POD_IPS[:1]))
    indexes.put(pod("chat-p0", POD_IPS[0], ready=False))
    (tmp_path / "indexes.json").write_text(json.dumps(indexes.as_json()))
    (tmp_path / "limits.json").write_text(Limits(hold_seconds=8).model_dump_json())
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    argv = [sys.executable, "-m", "tests.operator.gateway.standalone", str(port)]
    argv += [str(tmp_path / "indexes.json"), str(tmp_path / "limits.json"), "1"]
    process = start_http(argv, tmp_path / "gateway.log", f"{base}/healthz", 30, cwd=ROOT)
    try:
        yield process, base
    finally:
        process.stop()


def _mib(kib: int) -> float:
    return kib / 1024


def test_a_16_mib_body_is_refused_without_being_held(standalone: tuple[Process, str]) -> None:
    process, base = standalone
    before = memory_kib(process.pid)

    async def main() -> list[int]:
        async with aiohttp.ClientSession() as http:
            statuses = []
            async with http.post(url(base), data=body_of(16 * MiB)) as r:  # Content-Length: refused unread
                statuses.append(r.status)

            async def chunked() -> AsyncIterator[bytes]:
                body = body_of(16 * MiB)
                for start in range(0, len(body), MiB):
                    yield body[start : start + MiB]

            try:  # no Content-Length: refused once 8 MiB arrived
                async with http.post(url(base), data=chunked()) as r:
                    statuses.append(r.status)
            except aiohttp.ClientError:  # the gateway closed while the client still sent
                statuses.append(413)
            return statuses

    assert asyncio.run(main()) == [413, 413]
    peak = memory_kib(process.pid)["VmHWM"]
    grown = _mib(peak - before["VmRSS"])
    print(f"16 MiB bodies: RSS {_mib(before['VmRSS']):.0f} MiB before, peak {_mib(peak):.0f} MiB (+{grown:.0f})")
    assert grown < 32, f"the gateway's peak RSS grew {grown:.0f} MiB for a refused 16 MiB body"


def test_fifty_held_8_mib_bodies_are_bounded_by_the_namespace_byte_budget(standalone: tuple[Process, str]) -> None:
    process, base = standalone
    before = memory_kib(process.pid)
    body = body_of(8 * MiB - 1024)

    async def main() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def one() -> tuple[int, str | None]:
                async with http.post(url(base), data=body) as r:
                    return r.status, r.headers.get("Retry-After")

            return await asyncio.gather(*(one() for _ in range(50)))

    results = asyncio.run(main())
    peak = memory_kib(process.pid)["VmHWM"]
    grown = _mib(peak - before["VmRSS"])
    held = Limits().body_bytes_per_namespace // len(body)
    print(f"50 x 8 MiB held: RSS {_mib(before['VmRSS']):.0f} MiB before, peak {_mib(peak):.0f} MiB (+{grown:.0f})")
    # The budget's share were held for the whole hold (the pod never got ready), the rest refused.
    assert sorted(results) == sorted(
        [(429, str(RETRY_AFTER_SECONDS))] * (50 - held) + [(503, str(RETRY_AFTER_SECONDS))] * held
    )
    assert grown < 128, f"the gateway's peak RSS grew {grown:.0f} MiB for 50 held 8 MiB bodies"


def test_three_hundred_requests_over_three_engines_are_all_in_flight_at_once() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS, status={"plan": {"maxNumSeqs": 64}}))  # 128 each at once
        # Each engine holds its requests until all 300 have arrived: a gateway that sent them in
        # waves (before: 100 at a time) leaves them waiting out the barrier's timeout.
        everyone = asyncio.Barrier(300)
        engines = [
            await Engine(f"e{i}", chunks=2, delay=1.0, barrier=everyone).start(ip) for i, ip in enumerate(POD_IPS)
        ]
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(complete(http, base) for _ in range(300)))
            took = time.monotonic() - started
        finally:
            for e in engines:
                await e.stop()
        assert [status for status, _, _ in results] == [200] * 300
        assert sum(e.peak for e in engines) == 300, [e.peak for e in engines]
        print(f"300 requests of 2 s over 3 engines: {took:.1f} s")

    run(scenario)


def test_an_engine_gets_at_most_twice_its_plans_max_num_seqs_and_the_rest_wait() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1], status={"plan": {"maxNumSeqs": 2}}))
        engine = await Engine("e0", chunks=2, delay=0.2).start(POD_IPS[0])
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(12)))
        finally:
            await engine.stop()
        assert [status for status, _, _ in results] == [200] * 12
        assert engine.peak == 4

    run(scenario)


def test_held_requests_are_bounded_per_service_and_in_all() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]), pod("chat-p0", POD_IPS[0], ready=False))
        held = [asyncio.create_task(complete(http, base)) for _ in range(2)]
        await asyncio.sleep(0.5)
        status, _, text = await complete(http, base)
        assert status == 429 and "2 requests to team/chat wait for an engine already" in text
        ix.put(
            *serving(POD_IPS[1:2], namespace="other", uid="u2"),
            pod("chat-p0", POD_IPS[1], ready=False, namespace="other"),
        )
        other = asyncio.create_task(complete(http, base, namespace="other"))
        await asyncio.sleep(0.3)
        status, _, text = await complete(http, base, namespace="other")
        assert status == 503 and "holds 3 requests waiting for engines" in text
        assert [s for s, _, _ in await asyncio.gather(*held, other)] == [503, 503, 503]  # the hold ran out

    run(scenario, held_per_service=2, held_total=3, hold_seconds=1.5)


def _raw(port: int, request: bytes) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port))
    sock.sendall(request)
    return sock


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_an_idle_connection_is_closed() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        port = int(base.rsplit(":", 1)[1])
        head = f"POST /namespaces/{NS}/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        slow = await asyncio.to_thread(_raw, port, head.encode() + b'{"model"')
        started = time.monotonic()
        answer = await asyncio.to_thread(slow.recv, 4096)
        assert answer.startswith(b"HTTP/1.1 408") and 0.8 < time.monotonic() - started < 3
        slow.close()
        idle = await asyncio.to_thread(_raw, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.to_thread(idle.recv, 4096)).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert await asyncio.to_thread(idle.recv, 4096) == b""  # closed by the gateway
        assert 0.8 < time.monotonic() - started < 3
        idle.close()

    run(scenario, body_read_seconds=1.0, keepalive_seconds=1.0)


def test_a_client_that_leaves_cancels_its_held_or_forwarded_request() -> None:
    """Finding 5: requests whose clients left while held were still forwarded and generated."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]), pod("chat-p0", POD_IPS[0], ready=False))
        held = asyncio.create_task(complete(http, base))
        await asyncio.sleep(0.5)
        held.cancel()  # the client goes away while its request is held
        await asyncio.sleep(0.3)
        engine = await Engine("e0", chunks=20, delay=0.1).start(POD_IPS[0])
        ix.put(pod("chat-p0", POD_IPS[0]))
        try:
            await asyncio.sleep(1.0)
            assert engine.requests == []  # the abandoned request never reached it
            async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi", "stream": True}) as r:
                await r.content.readline()  # the first chunk: it is generating
            await asyncio.sleep(0.5)  # the client left mid-stream
            assert len(engine.requests) == 1 and engine.cancelled == 1
        finally:
            await engine.stop()

    run(scenario)
