"""LoRA adapters loaded on running engines by the autoscaler's loop (operator/autoscaling/
adapter_sync.py), against stand-in engines that serve vLLM's runtime adapter API (and our
engine's, which is the same) on loopback addresses at the engine port, behind the service's API
key. Every address is on 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import random
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvpilot.operator.api.names import PORT
from kvpilot.operator.autoscaling.loop import AutoscalingLoop
from kvpilot.operator.kube.cluster import WriteRefused

from .test_loop_io import service

KEY = "sk-test-key"
BASE = "llama-2-7b"


class Engine:
    """A stand-in engine: /v1/models lists the base model and each adapter (parent: the base
    model, root: its path, as vLLM's), load/unload as vLLM's runtime API, a 400 for an adapter
    whose path says `malformed`; every /v1 route requires the API key. `calls` records what it
    was asked; `starts` stays 1 as long as it was never restarted."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.starts = 0
        self.runner: web.AppRunner | None = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]) -> Any:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    async def models(self, _: web.Request) -> web.Response:
        cards = [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in sorted(self.adapters.items())]
        return web.json_response({"object": "list", "data": [{"id": BASE, "object": "model", "root": BASE}, *cards]})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        self.calls.append(("load" + ("-inplace" if body.get("load_inplace") else ""), name))
        if "malformed" in path:
            message = f"Invalid adapter at {path!r}: adapter_config.json has no r"
            return web.json_response({"error": {"message": message, "code": "invalid_adapter"}}, status=400)
        if name in self.adapters and not body.get("load_inplace"):
            return web.json_response({"error": {"message": f"'{name}' has already been loaded."}}, status=400)
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        if self.adapters.pop(name, None) is None:
            return web.json_response({"error": {"message": f"'{name}' cannot be found."}}, status=404)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.post("/v1/load_lora_adapter", self.load),
                web.post("/v1/unload_lora_adapter", self.unload),
            ]
        )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        for _ in range(50):
            ip = f"127.{random.randrange(1, 255)}.{random.randrange(0, 256)}.{random.randrange(1, 255)}"
            try:
                await web.TCPSite(self.runner, ip, PORT).start()
            except OSError:
                continue
            self.starts += 1
            return ip
        raise RuntimeError("no free loopback address for a stand-in engine")

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class Cluster:
    """The cluster adapter: the API-key Secret, and status merge patches applied to the body."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.writes: list[dict[str, Any]] = []
        self.secret_reads = 0
        self.pod_conditions: list[tuple[str, dict[str, Any]]] = []
        self.refuse_pod_writes = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, namespace, name) == ("Secret", "ml", "chat-api-key")
        self.secret_reads += 1
        return {"data": {"api-key": base64.b64encode(KEY.encode()).decode()}}

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any], rv: str | None = None
    ) -> str:
        self.writes.append(copy.deepcopy(patch))
        status = self.body.setdefault("status", {})
        for key, value in patch.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value
        return "9"

    def set_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> None:
        assert namespace == "ml"
        if self.refuse_pod_writes:
            self.refuse_pod_writes -= 1
            raise WriteRefused(f"Pod {namespace}/{name} status", 403, "pods/status is forbidden")
        self.pod_conditions.append((name, copy.deepcopy(condition)))

    def write_replicas(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("autoscaling mode off: replicas are never written")


def adapters(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "source": source} for name, source in pairs]


def rows(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in body["status"].get("adapters") or []}


def test_adapters_are_loaded_and_unloaded_on_running_engines_without_a_restart() -> None:
    """Two adapters on two running engines; a third added is loaded on both (nothing else is called,
    no engine restarts); a malformed one is an error on it while the others stay loaded; a removed
    one is unloaded; a pod that becomes ready gets the whole list at its first period."""

    async def scenario() -> None:
        engines = [Engine(), Engine(), Engine()]
        ips = [await e.start() for e in engines]
        body, deployment, replicaset, first = service("chat", ips[0])
        body["spec"] = {
            "model": {"name": BASE},
            "replicas": 2,
            "autoscaling": {"mode": "off"},
            "adapters": adapters(("sql", "/adapters/sql"), ("support", "pvc://adapters/support")),
        }
        sha = hashlib.sha256(KEY.encode()).hexdigest()
        body["status"] = {"auth": {"apiKeySha256": sha, "secretName": "chat-api-key"}}
        pods = [first, copy.deepcopy(first), copy.deepcopy(first)]
        for i, (pod, ip) in enumerate(zip(pods, ips, strict=True)):
            pod["metadata"]["name"], pod["status"]["podIP"] = f"chat-{i}", ip
        pods[2]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]  # still starting
        cluster = Cluster(body)
        loop = AutoscalingLoop(cluster, {}, {}, {}, {}, interval=0.1)

        async def period() -> None:
            await loop.adapters_period(body, [deployment], [replicaset], pods)

        try:
            await period()
            assert {n: (r["loadedOn"], r["pods"]) for n, r in rows(body).items()} == {
                "sql": (["chat-0", "chat-1"], 2),
                "support": (["chat-0", "chat-1"], 2),
            }
            assert engines[0].adapters == {"sql": "/adapters/sql", "support": "/models/adapters/support"}
            assert engines[2].calls == []  # not ready: left alone
            writes = len(cluster.writes)
            await period()  # nothing changed: nothing called but the reads, nothing written
            assert len(cluster.writes) == writes and len(engines[0].calls) == 2

            body["spec"]["adapters"] += adapters(("legal", "/adapters/legal"))
            await period()
            for engine in engines[:2]:
                assert engine.calls[2:] == [("load", "legal")] and engine.starts == 1
            assert rows(body)["legal"]["loadedOn"] == ["chat-0", "chat-1"]

            body["spec"]["adapters"] += adapters(("broken", "/adapters/malformed"))
            await period()
            await period()  # within the backoff: not tried again
            broken = rows(body)["broken"]
            assert broken["loadedOn"] == [] and broken["error"]["pod"] in ("chat-0", "chat-1")
            assert "HTTP 400: Invalid adapter at '/adapters/malformed'" in broken["error"]["message"]
            assert [c for c in engines[0].calls if c[1] == "broken"] == [("load", "broken")]
            assert all(rows(body)[n]["loadedOn"] == ["chat-0", "chat-1"] for n in ("sql", "support", "legal"))

            body["spec"]["adapters"] = [a for a in body["spec"]["adapters"] if a["name"] not in ("support", "broken")]
            pods[2]["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
            await period()
            for engine in engines[:2]:
                assert engine.calls[-1] == ("unload", "support")
                assert engine.adapters == {"sql": "/adapters/sql", "legal": "/adapters/legal"}
            assert engines[2].adapters == {"sql": "/adapters/sql", "legal": "/adapters/legal"}
            assert {n: r["loadedOn"] for n, r in rows(body).items()} == {
                "sql": ["chat-0", "chat-1", "chat-2"],
                "legal": ["chat-0", "chat-1", "chat-2"],
            }
            assert all(e.starts == 1 for e in engines) and cluster.secret_reads == 1

            body["spec"]["adapters"] = []
            await period()
            assert "adapters" not in body["status"]
        finally:
            await loop.close()
            for engine in engines:
                await engine.stop()

    asyncio.run(scenario())


def test_a_moved_source_is_loaded_in_place_and_a_refusal_of_the_key_is_an_error() -> None:
    async def scenario() -> None:
        engine = Engine()
        ip = await engine.start()
        body, deployment, replicaset, pod = service("chat", ip)
        body["spec"] = {
            "model": {"name": BASE},
            "autoscaling": {"mode": "off"},
            "adapters": adapters(("sql", "/adapters/sql-v2")),
        }
        engine.adapters["sql"] = "/adapters/sql-v1"
        cluster = Cluster(body)  # no status.auth: the operator holds no key, the engine wants one
        loop = AutoscalingLoop(cluster, {}, {}, {}, {}, interval=0.1)
        try:
            await loop.adapters_period(body, [deployment], [replicaset], [pod])
            error = rows(body)["sql"]["error"]
            assert error["pod"] == "chat-0" and error["message"].startswith("its adapters could not be read: HTTP 401")
            sha = hashlib.sha256(KEY.encode()).hexdigest()
            body["status"]["auth"] = {"apiKeySha256": sha, "secretName": "chat-api-key"}
            await loop.adapters_period(body, [deployment], [replicaset], [pod])
            assert engine.calls == [("load-inplace", "sql")] and engine.adapters == {"sql": "/adapters/sql-v2"}
            assert rows(body)["sql"] == {"name": "sql", "source": "/adapters/sql-v2", "loadedOn": ["chat-0"], "pods": 1}
        finally:
            await loop.close()
            await engine.stop()

    asyncio.run(scenario())


def test_the_loops_rounds_sync_adapters_of_a_service_it_does_not_scale() -> None:
    """`run` starts the adapters' task of every service beside its autoscaler period, whatever
    autoscaling.mode says (here off: nothing is scaled, the adapter is still loaded)."""

    async def scenario() -> None:
        engine = Engine()
        body, deployment, replicaset, pod = service("chat", await engine.start())
        body["spec"] = {
            "model": {"name": BASE},
            "autoscaling": {"mode": "off"},
            "adapters": adapters(("sql", "/a/sql")),
        }
        body["status"] = {
            "auth": {"apiKeySha256": hashlib.sha256(KEY.encode()).hexdigest(), "secretName": "chat-api-key"}
        }
        cluster = Cluster(body)
        indexes = [{("ml", "chat"): [one]} for one in (body, deployment, replicaset, pod)]
        loop = AutoscalingLoop(cluster, *indexes, interval=0.1)
        task = asyncio.create_task(loop.run())
        try:
            for _ in range(100):
                if rows(body).get("sql", {}).get("loadedOn"):
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await engine.stop()
        assert engine.adapters == {"sql": "/a/sql"} and rows(body)["sql"]["loadedOn"] == ["chat-0"]

    asyncio.run(scenario())


def test_a_starting_pod_is_given_the_adapters_before_its_readiness_gate_opens() -> None:
    """A pod whose engine answers but whose readiness gate holds it out of the Service (Ready False,
    ContainersReady True) gets every adapter, then the gate's condition (a refused adapter counts
    as given: an error on it, not a pod kept out); a refused write is tried again the next period,
    a written gate is not written again; a pod whose engine does not answer yet is left alone."""

    async def scenario() -> None:
        engines = [Engine(), Engine()]
        body, deployment, replicaset, first = service("chat", await engines[0].start())
        body["spec"] = {
            "model": {"name": BASE},
            "autoscaling": {"mode": "off"},
            "adapters": adapters(("sql", "/adapters/sql"), ("broken", "/adapters/malformed")),
        }
        body["status"] = {
            "auth": {"apiKeySha256": hashlib.sha256(KEY.encode()).hexdigest(), "secretName": "chat-api-key"}
        }
        gated, starting = copy.deepcopy(first), copy.deepcopy(first)
        gated["metadata"]["name"], gated["status"]["podIP"] = "chat-1", await engines[1].start()
        gated["status"]["conditions"] = [
            {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
            {"type": "ContainersReady", "status": "True"},
        ]
        starting["metadata"]["name"], starting["status"]["podIP"] = "chat-2", "127.0.0.2"
        starting["status"]["conditions"] = [{"type": "ContainersReady", "status": "False"}]
        pods = [first, gated, starting]
        cluster = Cluster(body)
        cluster.refuse_pod_writes = 1
        loop = AutoscalingLoop(cluster, {}, {}, {}, {}, interval=0.1)

        async def period() -> list[str]:
            """The pods whose gate this period set, each brought back on its pod as the watch does."""
            before = len(cluster.pod_conditions)
            await loop.adapters_period(body, [deployment], [replicaset], pods)
            for name, condition in cluster.pod_conditions[before:]:
                next(p for p in pods if p["metadata"]["name"] == name)["status"]["conditions"].append(condition)
            return [name for name, _ in cluster.pod_conditions[before:]]

        try:
            assert await period() == ["chat-1"]  # chat-0's write was refused
            assert all(e.adapters == {"sql": "/adapters/sql"} for e in engines)
            assert await period() == ["chat-0"]
            assert await period() == []
            for _, condition in cluster.pod_conditions:
                assert condition["type"] == "kvpilot.dev/adapters-loaded" and condition["status"] == "True"
                assert condition["message"] == "holds 1 of 2 adapters; refused: broken"
            assert rows(body)["sql"]["loadedOn"] == ["chat-0", "chat-1"]
        finally:
            await loop.close()
            for engine in engines:
                await engine.stop()

    asyncio.run(scenario())
