"""The gateway (operator/gateway/): routing, balancing, and holding requests at zero replicas.

The HTTP tests run the real aiohttp gateway on 127.0.0.1 in front of a real aiohttp "engine" on
127.0.0.1, with the kopf indexes replaced by dicts the test edits and the Kubernetes client by a
recorder of what the gateway writes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from e2e.procs import free_port
from kvpilot.operator.api.names import INSTANCE_LABEL, PORT
from kvpilot.operator.gateway import server as gw
from kvpilot.operator.kube.indexes import index_entry

NS = "team"
UID = "uid-1"


def service(
    name: str = "chat",
    model: str = "SmolLM2",
    replicas: int | None = 1,
    served: str | None = None,
    namespace: str = NS,
    uid: str = UID,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": model, **({"servedModelName": served} if served else {})}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"},
        "spec": spec,
    }


def deployment(name: str = "chat", replicas: int = 1, uid: str = UID) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"dep-{uid}",
            "ownerReferences": [{"controller": True, "uid": uid}],
        },
        "spec": {"replicas": replicas},
    }


def replicaset(name: str = "chat-5d8f", owner: str = f"dep-{UID}", instance: str = "chat") -> dict[str, Any]:
    """The ReplicaSet the Deployment controller makes (owner: the Deployment's uid), with the pod
    template's labels."""
    return {
        "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"rs-{name}",
            "labels": {INSTANCE_LABEL: instance},
            "ownerReferences": [{"controller": True, "uid": owner}],
        },
    }


def pod(name: str, ip: str, ready: bool = True, owner: str = "chat", replicaset: str = "chat-5d8f") -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {INSTANCE_LABEL: owner},
            "ownerReferences": [{"controller": True, "uid": f"rs-{replicaset}"}],
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_route_by_served_model_name() -> None:
    services = [service("a", "llama"), service("b", "qwen", served="chat-model", uid="u2")]
    assert gw.route("llama", services) == (NS, "a")
    assert gw.route("chat-model", services) == (NS, "b")
    with pytest.raises(LookupError, match="`qwen` does not exist; served here: chat-model, llama"):
        gw.route("qwen", services)
    twice = [*services, service("c", "llama", namespace="other", uid="u3")]
    with pytest.raises(LookupError, match="several InferenceServices .*other/c, team/a"):
        gw.route("llama", twice)


def test_choose_prefers_the_least_busy_engine_not_refused_lately() -> None:
    urls = [("p0", "http://a"), ("p1", "http://b"), ("p2", "http://c")]
    assert gw.choose(urls, {"http://a": 2, "http://b": 1, "http://c": 3}, {}, now=10) == "http://b"
    assert gw.choose(urls, {"http://a": 2, "http://b": 1}, {"http://b": 11, "http://c": 9}, now=10) == "http://c"
    assert gw.choose(urls, {}, {u: 11 for _, u in urls}, now=10) is None
    assert gw.choose([], {}, {}, now=10) is None


# Pods listen on names.PORT; each stand-in engine gets its own loopback address for it.
POD_IPS = ("127.77.0.1", "127.77.0.2")


class Indexes:
    """What kopf's indexes would hold, keyed as handlers.py keys them."""

    def __init__(self) -> None:
        self.services: dict[Any, list[Any]] = {}
        self.deployments: dict[Any, list[Any]] = {}
        self.replicasets: dict[Any, list[Any]] = {}
        self.pods: dict[Any, list[Any]] = {}

    def put(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            index = {
                "InferenceService": self.services,
                "Deployment": self.deployments,
                "ReplicaSet": self.replicasets,
                "Pod": self.pods,
            }[obj["kind"]]
            by_instance = obj["kind"] in ("ReplicaSet", "Pod")
            for key, value in index_entry(obj, INSTANCE_LABEL if by_instance else None).items():
                index[key] = [v for v in index.get(key, []) if v["metadata"]["name"] != obj["metadata"]["name"]]
                index[key].append(value)


class Recorder:
    """The cluster adapter's stand-in: records scale writes and Events; `on_scale` plays the cluster."""

    def __init__(self, on_scale: Callable[[int], None]) -> None:
        self.scales: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._on_scale = on_scale

    def write_replicas(
        self, body: dict[str, Any], replicas: int, event: dict[str, Any], resource_version: str | None = None
    ) -> None:
        self.scales.append({"spec": {"replicas": replicas}})
        self.events.append(event)
        self._on_scale(replicas)


async def start_engine(ip: str, name: str) -> web.AppRunner:
    """A stand-in engine on ip:names.PORT: streams three chunks naming itself, slowly enough that
    concurrent requests overlap."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": name})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {json.dumps({'engine': name, 'i': i, 'model': body['model']})}\n\n".encode())
            await asyncio.sleep(0.1)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, ip, PORT).start()
    return runner


Scenario = Callable[[Indexes, Recorder, str, aiohttp.ClientSession], Awaitable[None]]


def run(
    scenario: Scenario, hold_seconds: float = 20.0, on_scale: Callable[[Indexes, int], None] | None = None
) -> Recorder:
    """The gateway on 127.0.0.1 over fresh indexes; `on_scale` plays the cluster's answer to a
    scale write (default: the InferenceService's replicas change, nothing else)."""
    indexes = Indexes()
    recorder = Recorder(lambda n: (on_scale or (lambda ix, m: ix.put(service(replicas=m))))(indexes, n))

    async def main() -> None:
        gateway = gw.Gateway(
            indexes.services, indexes.deployments, indexes.replicasets, indexes.pods, recorder, hold_seconds
        )
        port = free_port()
        runner = await gateway.serve("127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as http:
                await scenario(indexes, recorder, f"http://127.0.0.1:{port}", http)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return recorder


async def complete(http: aiohttp.ClientSession, base: str, model: str = "SmolLM2") -> tuple[int, str, Any]:
    async with http.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi", "stream": True}) as r:
        return r.status, r.headers.get("X-Engine", ""), await r.text()


def test_requests_stream_through_to_the_least_busy_ready_engine() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(
            service(),
            deployment(replicas=2),
            replicaset(),
            pod("p0", POD_IPS[0]),
            pod("p1", POD_IPS[1]),
            pod("p2", "127.77.0.3", ready=False),
        )
        engines = [await start_engine(ip, f"e{i}") for i, ip in enumerate(POD_IPS)]
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(4)))
        finally:
            for e in engines:
                await e.cleanup()
        assert all(status == 200 for status, _, _ in results)
        assert sorted(name for _, name, _ in results) == ["e0", "e0", "e1", "e1"]  # two at a time each
        text = results[0][2]
        assert text.count("data: {") == 3 and text.endswith("data: [DONE]\n\n") and '"model": "SmolLM2"' in text
        models = await (await http.get(f"{base}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2"]
        assert not rec.scales

    run(scenario)


def test_a_request_at_zero_replicas_scales_to_one_and_is_held_until_an_engine_serves() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(replicas=0), deployment(replicas=0))
        started = time.monotonic()
        held = [asyncio.create_task(complete(http, base)) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in held)  # held, not refused
        assert len(rec.scales) == 1 and rec.scales[0] == {"spec": {"replicas": 1}}  # once for all three
        ix.put(deployment(replicas=1), replicaset(), pod("p0", POD_IPS[0]))  # Ready before its engine listens
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in held)
        engine = await start_engine(POD_IPS[0], "e0")
        try:
            results = await asyncio.gather(*held)
        finally:
            await engine.cleanup()
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert time.monotonic() - started >= 1.5
        assert len(rec.scales) == 1
        (event,) = rec.events
        assert event["reason"] == "ScaledUp" and "0 -> 1" in event["message"]
        assert event["involvedObject"]["uid"] == UID

    run(scenario)


def test_a_hold_that_outlasts_its_limit_is_a_503_with_retry_after() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(replicas=0), deployment(replicas=0))
        async with http.post(f"{base}/v1/completions", json={"model": "SmolLM2", "prompt": "hi"}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == str(gw.RETRY_AFTER_SECONDS)
            assert "no replica of team/chat became ready within 1 s" in (await r.json())["error"]["message"]
        assert len(rec.scales) == 1

    run(scenario, hold_seconds=1.0)


def test_bad_requests_get_openai_errors() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(), deployment())
        status, _, text = await complete(http, base, model="gpt-4")
        assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
        assert "served here: SmolLM2" in json.loads(text)["error"]["message"]
        async with http.post(f"{base}/v1/completions", data=b"not json") as r:
            assert r.status == 400 and "JSON object with a `model`" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/v1/completions", data=b"x" * (gw.MAX_BODY_BYTES + 1)) as r:
            assert r.status == 413
        assert not rec.scales

    run(scenario)


def test_no_deployment_yet_is_not_zero_replicas() -> None:
    """A service the operator has not rolled out yet: held, but never 'scaled from zero'."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(replicas=0))
        status, _, _ = await complete(http, base)
        assert status == 503 and not rec.scales

    run(scenario, hold_seconds=0.5)


def test_a_pod_that_only_carries_the_labels_gets_no_traffic() -> None:
    """Anyone who can create a pod in the namespace can give it the labels the operator selects:
    traffic goes only to pods of the service's own Deployment (pod -> ReplicaSet -> Deployment,
    controller references by uid)."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(
            service(),
            deployment(replicas=1),
            replicaset(),
            replicaset("chat-fake", owner="dep-someone-else"),
            pod("p0", POD_IPS[0]),
            pod("stray", POD_IPS[1], replicaset="chat-fake"),
        )
        engines = [await start_engine(POD_IPS[0], "ours"), await start_engine(POD_IPS[1], "stray")]
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(4)))
        finally:
            for e in engines:
                await e.cleanup()
        assert [(status, name) for status, name, _ in results] == [(200, "ours")] * 4

    run(scenario)
