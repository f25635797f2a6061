"""The gateway and LoRA adapters (issue 43): an adapter's name routes to its service, its requests
go only to the pods status.adapters lists as holding it (least load, or the prefix ring, among
them), a request no pod can take yet is held like one at zero replicas, and a name no service
serves stays a 404. Real gateway and stand-in engines on loopback addresses (harness.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from kvpilot.operator.gateway import routing

from .harness import POD_IPS, Engine, Indexes, Recorder, complete, run, service, serving, url


def with_adapters(objects: list[dict[str, Any]], loaded_on: dict[str, list[str]]) -> list[dict[str, Any]]:
    """`objects` (serving()'s) with adapters sql and legal, held where `loaded_on` says."""
    body = objects[0]
    body["spec"]["adapters"] = [{"name": "sql", "source": "/a/sql"}, {"name": "legal", "source": "/a/legal"}]
    body["status"] = {
        "adapters": [{"name": n, "source": f"/a/{n}", "loadedOn": pods, "pods": 2} for n, pods in loaded_on.items()]
    }
    return objects


def test_an_adapter_routes_to_its_service_and_only_to_the_pods_holding_it() -> None:
    svc = with_adapters([service()], {"sql": ["chat-p1"]})[0]
    services = [svc, service("other", "qwen", uid="u2")]
    assert routing.route("team", "sql", services) == "chat"
    assert routing.adapter_of(svc, "sql") == "sql" and routing.adapter_of(svc, "SmolLM2") is None
    assert routing.served_in("team", services) == ["SmolLM2", "legal", "qwen", "sql"]
    urls = [("chat-p0", "http://a"), ("chat-p1", "http://b")]
    assert routing.holding(svc, "sql", urls) == [("chat-p1", "http://b")]
    assert routing.holding(svc, "legal", urls) == []  # no row yet: the operator has not loaded it


def test_prefix_hash_routing_works_among_the_pods_holding_the_adapter() -> None:
    svc = with_adapters([service()], {"sql": ["chat-p1", "chat-p2"]})[0]
    svc["spec"]["routing"] = {"strategy": "PrefixHash"}
    urls = [("chat-p0", "http://a"), ("chat-p1", "http://b"), ("chat-p2", "http://c")]
    candidates = routing.holding(svc, "sql", urls)

    def picked(prefix: str) -> str | None:
        return routing.pick(svc, candidates, routing.Engines(), 0.0, prefix)

    chosen = {prefix: picked(prefix) for prefix in (f"system prompt {i}" for i in range(20))}
    assert set(chosen.values()) == {"http://b", "http://c"}  # spread over both holders, never the other pod
    assert all(picked(prefix) == url for prefix, url in chosen.items())  # a prefix keeps its engine


def test_adapter_requests_go_to_the_pods_that_hold_it_base_requests_to_all() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*with_adapters(serving(POD_IPS[:2]), {"sql": ["chat-p1"], "legal": ["chat-p0", "chat-p1"]}))
        engines = [await Engine(f"e{i}").start(ip) for i, ip in enumerate(POD_IPS[:2])]
        try:
            sql = await asyncio.gather(*(complete(http, base, model="sql") for _ in range(4)))
            legal = await asyncio.gather(*(complete(http, base, model="legal") for _ in range(4)))
            models = await (await http.get(url(base, path="models"))).json()
        finally:
            for e in engines:
                await e.stop()
        assert [(status, engine) for status, engine, _ in sql] == [(200, "e1")] * 4
        assert all('"model": "sql"' in text for _, _, text in sql)
        assert sorted(engine for _, engine, _ in legal) == ["e0", "e0", "e1", "e1"]  # least load among both
        assert [m["id"] for m in models["data"]] == ["SmolLM2", "legal", "sql"]

    run(scenario)


def test_an_adapter_no_pod_holds_yet_is_held_until_one_does() -> None:
    """As while pods start: held, and sent once the operator says a pod holds it."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*with_adapters(serving(POD_IPS[:2]), {"sql": []}))
        engines = [await Engine(f"e{i}").start(ip) for i, ip in enumerate(POD_IPS[:2])]
        try:
            request = asyncio.create_task(complete(http, base, model="sql"))
            await asyncio.sleep(0.6)
            assert not request.done() and all(not e.requests for e in engines)
            ix.put(*with_adapters(serving(POD_IPS[:2]), {"sql": ["chat-p0"]})[:1])
            status, engine, _ = await asyncio.wait_for(request, 10)
        finally:
            for e in engines:
                await e.stop()
        assert (status, engine) == (200, "e0") and not rec.scales

    run(scenario)


def test_an_adapter_still_loading_when_the_hold_ends_is_a_503_saying_so() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*with_adapters(serving(POD_IPS[:1]), {"sql": []}))
        engine = await Engine("e0").start(POD_IPS[0])
        try:
            async with http.post(url(base), json={"model": "sql", "prompt": "hi"}) as r:
                status, body = r.status, await r.json()
        finally:
            await engine.stop()
        assert status == 503 and not engine.requests
        assert "none of its 1 ready replica(s) holds the adapter `sql` yet" in body["error"]["message"]

    run(scenario, hold_seconds=0.5)


def test_a_name_that_is_no_model_nor_adapter_is_a_404() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*with_adapters(serving(POD_IPS[:1]), {"sql": ["chat-p0"]}))
        async with http.post(url(base), json={"model": "no-such-adapter", "prompt": "hi"}) as r:
            status, body = r.status, await r.json()
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "served there: SmolLM2, legal, sql" in body["error"]["message"]

    run(scenario)
