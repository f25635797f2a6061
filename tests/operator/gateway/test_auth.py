"""The gateway's key check (gateway/auth.py): a service whose status carries its API key's digest
takes only requests with that key, checked before the body is read and before any wake."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time

import aiohttp

from kvpilot.operator.gateway.auth import token_digest

from .harness import NS, POD_IPS, Engine, Indexes, Recorder, asleep, complete, deployment, run, serving, url

KEY = "sk-team-0123456789abcdef"
LOCKED = {"auth": {"apiKeySha256": hashlib.sha256(KEY.encode()).hexdigest()}}


def test_only_a_bearer_token_counts() -> None:
    assert token_digest(f"Bearer {KEY}") == token_digest(f"bearer  {KEY} ") == LOCKED["auth"]["apiKeySha256"]
    assert token_digest(None) is None and token_digest(f"Basic {KEY}") is None and token_digest("Bearer ") is None


def _headers_only(port: int) -> tuple[bytes, float]:
    """A request that announces a body and never sends it: the answer, and how long it took."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(
            f"POST /namespaces/{NS}/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n".encode()
        )
        return sock.recv(4096), time.monotonic() - started


def test_a_request_without_the_key_is_refused_before_its_body_is_read() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1], status=LOCKED))
        engine = await Engine("e0").start(POD_IPS[0])
        try:
            answer, took = await asyncio.to_thread(_headers_only, int(base.rsplit(":", 1)[1]))
            assert answer.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in answer and took < 2
            wrong, _, text = await complete(http, base, Authorization="Bearer sk-someone-else")
            right, name, _ = await complete(http, base, Authorization=f"Bearer {KEY}")
        finally:
            await engine.stop()
        assert wrong == 401 and "invalid_api_key" in text
        assert (right, name) == (200, "e0")
        assert [r["headers"]["Authorization"] for r in engine.requests] == [f"Bearer {KEY}"]

    run(scenario, body_read_seconds=10)


def test_a_keyed_service_is_never_woken_without_its_key() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(asleep(status={**asleep()["status"], **LOCKED}), deployment(replicas=0))
        ix.put(*serving(POD_IPS[:1], name="open", model="other", uid="u2"))
        engine = await Engine("open").start(POD_IPS[0])
        try:
            # The namespace has an open service: the body is read, and the keyed one still refuses.
            status, _, _ = await complete(http, base)
            open_status, name, _ = await complete(http, base, model="other")
            anonymous = await (await http.get(url(base, path="models"))).json()
            keyed = await (await http.get(url(base, path="models"), headers={"Authorization": f"Bearer {KEY}"})).json()
        finally:
            await engine.stop()
        assert status == 401 and not rec.scales
        assert (open_status, name) == (200, "open")
        assert [m["id"] for m in anonymous["data"]] == ["other"]  # the keyed model is not shown
        assert [m["id"] for m in keyed["data"]] == ["SmolLM2", "other"]

    run(scenario)
