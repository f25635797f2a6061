"""A queue in the gateway scales a service up, and a gateway that cannot be read never lets it
scale down (issue 23: "the autoscaler reads the held queue as a signal"). The decisions from what
the gateways hold (decisions.py), the reading of a gateway's exposition (metrics.py, gateways.py),
and the loop reading real gateways that hold real requests, on 127.0.0.0/8 (loop.py)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator import cli
from kvpilot.operator.api.names import INSTANCE_LABEL, PORT
from kvpilot.operator.autoscaling.decisions import AutoscalerState, Decision, Observation, PodRead, Policy, step
from kvpilot.operator.autoscaling.gateways import (
    GatewayPods,
    GatewayQueues,
    GatewayRead,
    GatewayView,
    gateway_targets,
    gateway_watch,
)
from kvpilot.operator.autoscaling.loop import AutoscalingLoop
from kvpilot.operator.autoscaling.metrics import EngineReading, MetricsError, parse_gateway
from kvpilot.operator.gateway import server as gw
from kvpilot.operator.gateway.limits import Limits
from kvpilot.operator.gateway.metrics import GatewayMetrics, Now
from kvpilot.operator.kube.watches import Index
from tests.operator.gateway.harness import Indexes

PERIOD = 15.0
IDLE = EngineReading(waiting=0.0, running=0.0, kv_usage=0.0)


class Service:
    """step() every PERIOD with engines that report `reading` (idle by default) and the gateway
    read the test sets; replicas follow the decisions."""

    def __init__(self, policy: Policy, replicas: int) -> None:
        self.policy, self.replicas, self.now = policy, replicas, 1_000_000.0
        self.state = AutoscalerState()

    def tick(self, gateway: GatewayRead | None, reading: EngineReading = IDLE, ready: int | None = None) -> Decision:
        self.now += PERIOD
        ready = self.replicas if ready is None else ready
        pods = tuple(PodRead(name=f"p{i}", reading=reading) for i in range(ready))
        obs = Observation(now=self.now, replicas=self.replicas, ready_replicas=ready, pods=pods, gateway=gateway)
        self.state, decision = step(self.policy, self.state, obs)
        self.replicas = decision.replicas
        return decision


def test_a_queue_in_the_gateway_scales_up_what_the_engines_alone_do_not() -> None:
    """Idle-looking engines (nothing waiting: the gateway sends an engine no more than it can
    take) and 20 requests held in the gateway: 20 waiting per replica against 4, up by maxStep."""
    policy = Policy(max_replicas=8, max_step=2)
    alone = Service(policy, replicas=1)
    assert [alone.tick(None).action for _ in range(3)] == ["hold"] * 3
    queued = Service(policy, replicas=1)
    queued.tick(GatewayRead(held=0))
    d = queued.tick(GatewayRead(held=20))
    assert (d.action, d.replicas) == ("up", 3)
    assert d.signals.limiting == "waiting" and d.signals.gateway_held == 10.0  # the window's mean
    assert "held in the gateway" in d.reason and "1 -> 3" in d.reason


def test_a_queue_in_the_gateway_scales_up_while_the_woken_replica_still_loads() -> None:
    """Woken from zero by a burst: 1 replica, loading (no engine reports), 40 requests held."""
    service = Service(Policy(min_replicas=0, max_replicas=8, max_step=3), replicas=1)
    d = service.tick(GatewayRead(held=40), ready=0)
    assert (d.action, d.replicas) == ("up", 4)
    assert d.signals.reporting == 0 and d.signals.waiting_per_replica == 40.0
    # The next holds: the scale-up's pods are not ready yet.
    assert service.tick(GatewayRead(held=40), ready=0).action == "hold"


def test_what_one_gateway_holds_counts_though_another_cannot_be_read() -> None:
    service = Service(Policy(max_replicas=8), replicas=2)
    d = service.tick(GatewayRead(held=30, unknown=("gw-b: HTTP 500",)))
    assert d.action == "up" and "gw-b: HTTP 500" in d.reason


def _idle_until_down(service: Service, gateway: GatewayRead | None) -> list[Decision]:
    return [service.tick(gateway) for _ in range(25)]


@pytest.mark.parametrize("min_replicas, replicas", [(1, 3), (0, 1)])
def test_a_gateway_that_cannot_be_read_never_lets_a_service_scale_down(min_replicas: int, replicas: int) -> None:
    """Idle engines for 6 minutes against a 300 s scale-down window: down when the gateways say
    they hold nothing, never when one of them cannot say, and down again once it can."""
    policy = Policy(min_replicas=min_replicas, scale_down_stabilization_seconds=300)
    known = _idle_until_down(Service(policy, replicas), GatewayRead(held=0))
    assert any(d.action == "down" for d in known)
    service = Service(policy, replicas)
    blind = _idle_until_down(service, GatewayRead(unknown=("gw-a: no complete answer within 3 s",)))
    assert all((d.action, d.replicas) == ("hold", replicas) for d in blind)
    assert "what the gateway holds is unknown" in blind[-1].reason
    assert "gateway pods unknown: 1 (gw-a: no complete answer within 3 s)" in blind[-1].reason
    assert any(d.action == "down" for d in _idle_until_down(service, GatewayRead(held=0)))


def test_requests_held_in_the_gateway_keep_the_last_replica() -> None:
    policy = Policy(min_replicas=0, scale_down_stabilization_seconds=60)
    service = Service(policy, replicas=1)
    assert all(service.tick(GatewayRead(held=1)).replicas == 1 for _ in range(12))
    assert any(service.tick(GatewayRead(held=0)).replicas == 0 for _ in range(12))


def test_a_gateway_s_exposition_gives_what_it_holds_per_service() -> None:
    held = {("team", "chat"): 3, ("team", "code"): 1}
    metrics = GatewayMetrics(Now(lambda: held, lambda: {("team", "chat"): 9}, lambda: {"team": 100}))
    assert parse_gateway(metrics.exposition().decode()) == {("team", "chat"): 3.0, ("team", "code"): 1.0}
    nothing = GatewayMetrics(Now(dict, dict, dict)).exposition().decode()
    assert parse_gateway(nothing) == {}  # the family is there, empty: a gateway that holds nothing
    engine = generate_latest(ServingMetrics("m").registry).decode()
    with pytest.raises(MetricsError, match="not a kvpilot gateway"):
        parse_gateway(engine)  # something else on the port is not "nothing held"
    with pytest.raises(MetricsError, match="below 0"):
        parse_gateway('# TYPE kvpilot_gateway_held_requests gauge\nkvpilot_gateway_held_requests{service="a"} -5\n')


def test_the_gateway_pods_flag_and_which_pods_are_read() -> None:
    where = GatewayPods.parse("kvpilot-system:app.kubernetes.io/name=kvpilot-gateway,app.kubernetes.io/instance=kv")
    assert where.namespace == "kvpilot-system"
    assert where.labels == {"app.kubernetes.io/name": "kvpilot-gateway", "app.kubernetes.io/instance": "kv"}
    for bad in ("kvpilot-system", ":a=b", "ns:a", "ns:=b", "ns:a="):
        with pytest.raises(ValueError, match="NAMESPACE:key=value"):
            GatewayPods.parse(bad)
    pods = [
        gateway_pod("gw-a", "127.0.0.5", port=8080),
        gateway_pod("gw-b", "127.0.0.6", ready=False),
        {**gateway_pod("gw-c", "127.0.0.7"), "metadata": {"name": "gw-c", "deletionTimestamp": "now"}},
        gateway_pod("gw-d", None),
        gateway_pod("gw-e", "::1"),
    ]
    assert gateway_targets(pods) == [
        ("gw-a", "http://127.0.0.5:8080/metrics"),
        ("gw-e", f"http://[::1]:{PORT}/metrics"),
    ]
    queues = GatewayQueues.of_reads([("gw-a", {("t", "s"): 2.0}), ("gw-b", {("t", "s"): 3.0}), ("gw-c", "refused")])
    assert queues.of("t", "s") == GatewayRead(held=5.0, unknown=("gw-c: refused",))


# The loop on real sockets: a real gateway holding real requests, the operator reading it.


def gateway_pod(name: str, ip: str | None, port: int = PORT, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "kvpilot-system", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "gateway", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def engine_objects(ip: str) -> list[dict[str, Any]]:
    """An InferenceService at 1 replica (its own Deployment, ReplicaSet and one ready pod at
    `ip`), as the watches hold them."""
    meta = {"namespace": "team", "resourceVersion": "1"}
    return [
        {
            "kind": "InferenceService",
            "metadata": {"name": "chat", "uid": "uid-chat", **meta},
            "spec": {"model": {"name": "SmolLM2"}, "replicas": 1, "autoscaling": {"maxReplicas": 8}},
            "status": {"plan": {"maxNumSeqs": 2}},
        },
        {
            "kind": "Deployment",
            "metadata": {
                "name": "chat",
                "uid": "dep-chat",
                "labels": {INSTANCE_LABEL: "chat"},
                "ownerReferences": [{"controller": True, "uid": "uid-chat"}],
                **meta,
            },
            "spec": {"replicas": 1},
            "status": {"readyReplicas": 1},
        },
        {
            "kind": "ReplicaSet",
            "metadata": {
                "name": "chat-5d8f",
                "uid": "rs-chat",
                "labels": {INSTANCE_LABEL: "chat"},
                "ownerReferences": [{"controller": True, "uid": "dep-chat"}],
                **meta,
            },
        },
        {
            "kind": "Pod",
            "metadata": {
                "name": "chat-p0",
                "labels": {INSTANCE_LABEL: "chat"},
                "ownerReferences": [{"controller": True, "uid": "rs-chat"}],
                **meta,
            },
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        },
    ]


class Cluster:
    """The operator's cluster adapter: records the replicas the loop writes."""

    def __init__(self) -> None:
        self.replicas: list[int] = []

    def patch_status(self, *args: Any, **kwargs: Any) -> str:
        return "2"

    def set_deletion_costs(self, *args: Any) -> None:
        pass

    def write_replicas(self, body: Any, replicas: int, *args: Any) -> None:
        self.replicas.append(replicas)


def loopback_ip() -> str:
    return f"127.{random.randrange(1, 255)}.{random.randrange(0, 256)}.{random.randrange(2, 255)}"


@asynccontextmanager
async def serving(app: web.Application, port: int = PORT) -> AsyncIterator[str]:
    """`app` on `port` of a loopback address of its own (pods all listen on their port)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        for _ in range(50):
            ip = loopback_ip()
            try:
                await web.TCPSite(runner, ip, port).start()
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue
            yield ip
            return
        raise RuntimeError("no free loopback address")
    finally:
        await runner.cleanup()


def idle_engine() -> web.Application:
    """An engine whose /metrics says it is idle, and that never answers a completion."""
    exposition = generate_latest(ServingMetrics("m").registry)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=exposition, content_type="text/plain")

    async def never(_: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.post("/v1/completions", never)])
    return app


WHERE = GatewayPods(namespace="kvpilot-system", labels={"app.kubernetes.io/name": "kvpilot-gateway"})


def watched(gateway_pods: list[dict[str, Any]] | str) -> GatewayView:
    """The gateway pods as their watch keeps them: listed, or (a string) why the list failed."""
    pods = Index(gateway_watch(WHERE))
    if isinstance(gateway_pods, str):
        pods.failed(gateway_pods)
    else:
        pods.reset(gateway_pods)
    return GatewayView(WHERE, pods)


async def one_period(cluster: Cluster, indexes: Indexes, gateways: GatewayView) -> Decision | None:
    loop = AutoscalingLoop(cluster, *indexes.all(), interval=PERIOD, gateways=gateways)  # type: ignore[arg-type]
    try:
        (body,) = indexes.services[("team", "chat")]
        lists = (
            indexes.deployments[("team", "chat")],
            indexes.replicasets[("team", "chat")],
            indexes.pods[("team", "chat")],
        )
        return await loop.one(body, *lists, now=2_000_000.0)
    finally:
        await loop.close()


def test_the_loop_scales_up_on_the_requests_a_real_gateway_holds() -> None:
    """A real gateway in front of an engine at its plan's capacity (2 x maxNumSeqs 2 in flight):
    of 14 requests 10 wait in the gateway, none in the engine, which reads as idle. The loop lists
    the gateway pod, reads its /metrics and scales up on the queue."""

    async def main() -> tuple[Decision | None, Cluster]:
        async with serving(idle_engine()) as engine_ip:
            indexes = Indexes(*engine_objects(engine_ip))
            gateway = gw.Gateway(*indexes.all(), scaler=None, limits=Limits(hold_seconds=30))  # type: ignore[arg-type]
            async with serving(gateway.app, port=8080) as gateway_ip:
                base = f"http://{gateway_ip}:8080/namespaces/team/v1/completions"
                async with aiohttp.ClientSession() as http:
                    body = {"model": "SmolLM2", "prompt": "hi"}
                    sent = [asyncio.create_task(http.post(base, json=body)) for _ in range(14)]
                    await until(lambda: sum(gateway.admission.held.values()) == 10)
                    cluster = Cluster()
                    decision = await one_period(cluster, indexes, watched([gateway_pod("gw-a", gateway_ip, port=8080)]))
                    for task in sent:
                        task.cancel()
                    await asyncio.gather(*sent, return_exceptions=True)
        return decision, cluster

    decision, cluster = asyncio.run(main())
    assert decision is not None and decision.signals.gateway_held == 10.0
    assert (decision.action, decision.replicas) == ("up", 3), decision.reason
    assert "10.0 requests held in the gateway" in decision.reason
    assert cluster.replicas == [3]


@pytest.mark.parametrize(
    "gateway_pods, why",
    [
        ([gateway_pod("gw-a", "127.0.0.1", port=1)], "gw-a: ClientConnectorError"),  # nothing listens there
        ("pods is forbidden", "could not be listed: pods is forbidden"),
        ([], None),  # listed: no gateway pod, nothing held, nothing unknown
    ],
    ids=["refused", "not-listed", "none"],
)
def test_a_gateway_the_loop_cannot_read_is_unknown_and_named(gateway_pods: Any, why: str | None) -> None:
    async def main() -> Decision | None:
        async with serving(idle_engine()) as engine_ip:
            return await one_period(Cluster(), Indexes(*engine_objects(engine_ip)), watched(gateway_pods))

    decision = asyncio.run(main())
    if why is None:
        assert decision is not None and decision.signals.gateway_unknown == ()
        assert "gateway pods unknown" not in decision.reason
        return

    assert decision is not None and decision.signals.gateway_held is None
    assert len(decision.signals.gateway_unknown) == 1 and why in decision.signals.gateway_unknown[0]
    assert "gateway pods unknown: 1" in decision.reason


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


def test_kvpilot_operator_takes_the_gateway_pods_flag() -> None:
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    assert top.parse_args(["operator", "-A"]).gateway_pods is None  # no gateway read
    args = top.parse_args(["operator", "-A", "--gateway-pods", "kvpilot-system:app.kubernetes.io/name=kvpilot-gateway"])
    assert args.gateway_pods == GatewayPods(
        namespace="kvpilot-system", labels={"app.kubernetes.io/name": "kvpilot-gateway"}
    )
    with pytest.raises(SystemExit):
        top.parse_args(["operator", "-A", "--gateway-pods", "app.kubernetes.io/name=kvpilot-gateway"])
