"""The gateway (operator/gateway/): routing by namespace and model, balancing, and holding requests
at zero replicas; which zeros it may wake (issue 23, findings 3 and 4).

The HTTP tests run the real aiohttp gateway on 127.0.0.1 in front of real aiohttp stand-in
engines on loopback addresses, with the watches replaced by dicts the test edits and the
Kubernetes client by a recorder of what the gateway writes (harness.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from kvpilot.operator.api.names import VARIANT_LABEL
from kvpilot.operator.gateway import routing
from kvpilot.operator.gateway import server as gw
from kvpilot.operator.gateway.limits import RETRY_AFTER_SECONDS

from .harness import (
    NS,
    POD_IPS,
    UID,
    Engine,
    Indexes,
    Recorder,
    asleep,
    complete,
    deployment,
    pod,
    replicaset,
    run,
    service,
    serving,
    url,
)


def test_route_by_namespace_and_served_model_name() -> None:
    services = [
        service("a", "llama"),
        service("b", "qwen", served="chat-model", uid="u2"),
        service("c", "llama", namespace="other", uid="u3"),
        service("d", "secret-model", namespace="other", uid="u4"),
    ]
    assert routing.route(NS, "llama", services) == "a"
    assert routing.route("other", "llama", services) == "c"
    assert routing.route(NS, "chat-model", services) == "b"
    with pytest.raises(LookupError) as missing:
        routing.route(NS, "secret-model", services)
    # Nothing of another namespace is named: neither its models nor its services.
    assert (
        str(missing.value)
        == "The model `secret-model` does not exist in namespace team; served there: chat-model, llama"
    )
    twice = [*services, service("e", "llama", uid="u5")]
    with pytest.raises(LookupError, match=r"several InferenceServices in namespace team \(a, e\)"):
        routing.route(NS, "llama", twice)


def test_choose_prefers_the_least_busy_engine_not_backed_off_and_not_full() -> None:
    urls = [("p0", "http://a"), ("p1", "http://b"), ("p2", "http://c")]
    engines = routing.Engines(in_flight={"http://a": 2, "http://b": 1, "http://c": 3})
    assert routing.choose(urls, engines, capacity=10, now=10) == "http://b"
    engines.failed("http://b", now=10)
    assert routing.choose(urls, engines, capacity=10, now=10) == "http://a"
    assert routing.choose(urls, engines, capacity=2, now=10) is None  # a: 2 of 2, c: 3 of 2
    assert routing.choose(urls, engines, capacity=10, now=10 + routing.BACKOFF_SECONDS) == "http://b"
    engines.failed("http://b", now=20)  # twice in a row: backed off twice as long
    assert engines.backoff_until["http://b"] == 20 + 2 * routing.BACKOFF_SECONDS
    engines.succeeded("http://b")
    assert routing.choose(urls, engines, capacity=10, now=20) == "http://b"
    assert routing.choose([], routing.Engines(), capacity=10, now=10) is None


def test_engine_capacity_comes_from_the_plan() -> None:
    assert routing.engine_capacity(service(status={"plan": {"maxNumSeqs": 48}})) == 96
    assert routing.engine_capacity(service()) == routing.DEFAULT_ENGINE_CAPACITY


def test_only_a_zero_the_autoscaler_set_may_be_woken() -> None:
    """Finding 4: any request woke any service (mode off or external, a manual scale to zero)."""
    dep = deployment(replicas=0)
    assert routing.wake_refusal(asleep(), dep) is None
    assert "mode is off" in str(routing.wake_refusal(asleep(autoscaling={"mode": "off", "minReplicas": 0}), dep))
    assert "mode is external" in str(
        routing.wake_refusal(asleep(autoscaling={"mode": "external", "minReplicas": 0}), dep)
    )
    assert "by hand" in str(routing.wake_refusal(asleep(autoscaling={"mode": "slo", "minReplicas": 1}), dep))
    assert "by hand" in str(routing.wake_refusal(asleep(status={}), dep))  # no autoscaler marker
    assert "no Deployment" in str(routing.wake_refusal(asleep(), None))
    assert "not at 0" in str(routing.wake_refusal(asleep(replicas=1), dep))


def test_requests_stream_through_to_the_least_busy_ready_engine() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:2]), pod("p2", POD_IPS[2], ready=False))
        engines = [await Engine(f"e{i}").start(ip) for i, ip in enumerate(POD_IPS[:2])]
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(4)))
        finally:
            for e in engines:
                await e.stop()
        assert all(status == 200 for status, _, _ in results)
        assert sorted(name for _, name, _ in results) == ["e0", "e0", "e1", "e1"]  # two at a time each
        text = results[0][2]
        assert text.count("data: {") == 3 and text.endswith("data: [DONE]\n\n") and '"model": "SmolLM2"' in text
        models = await (await http.get(url(base, path="models"))).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2"]
        assert not rec.scales

    run(scenario)


def test_a_same_named_model_in_another_namespace_neither_blocks_nor_receives_traffic() -> None:
    """Finding 3: a second team's InferenceService with the same model name made the first team's
    answer 404 (naming the other team's namespace); while one team held a name, everyone's prompts
    and Authorization headers went to its engine; /v1/models listed every namespace."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        ix.put(*serving(POD_IPS[1:2], namespace="rival", uid="rival-uid", model="SmolLM2"))
        ix.put(service("private", "their-model", namespace="rival", uid="rival-2"))
        ours, theirs = await Engine("ours").start(POD_IPS[0]), await Engine("theirs").start(POD_IPS[1])
        try:
            results = await asyncio.gather(*(complete(http, base, Authorization="Bearer team-key") for _ in range(4)))
            status, _, text = await complete(http, base, model="their-model", Authorization="Bearer team-key")
            old = await http.post(f"{base}/v1/completions", json={"model": "SmolLM2", "prompt": "hi"})
            listed = await (await http.get(url(base, path="models"))).json()
        finally:
            await ours.stop()
            await theirs.stop()
        assert [(s, name) for s, name, _ in results] == [(200, "ours")] * 4
        assert not theirs.requests  # neither the prompts nor the key
        assert {r["headers"]["Authorization"] for r in ours.requests} == {"Bearer team-key"}
        assert status == 404 and "rival" not in text and "does not exist in namespace team" in text
        assert old.status == 404 and "/namespaces/<namespace>/v1/" in (await old.json())["error"]["message"]
        assert [m["id"] for m in listed["data"]] == ["SmolLM2"]

    run(scenario)


def test_a_request_at_a_zero_the_autoscaler_set_scales_to_one_and_is_held_until_an_engine_serves() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(asleep(), deployment(replicas=0))
        started = time.monotonic()
        held = [asyncio.create_task(complete(http, base)) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in held)  # held, not refused
        assert rec.scales == [{"service": "chat", "spec": {"replicas": 1}}]  # once for all three
        ix.put(deployment(replicas=1), replicaset(), pod("p0", POD_IPS[0]))  # Ready before its engine listens
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in held)
        engine = await Engine("e0").start(POD_IPS[0])
        try:
            results = await asyncio.gather(*held)
        finally:
            await engine.stop()
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert time.monotonic() - started >= 1.5
        assert len(rec.scales) == 1
        (event,) = rec.events
        assert event["reason"] == "ScaledUp" and "0 -> 1" in event["message"]
        assert event["involvedObject"]["uid"] == UID

    run(scenario)


@pytest.mark.parametrize(
    "zero",
    [
        asleep(autoscaling={"mode": "off", "minReplicas": 0}),
        asleep(autoscaling={"mode": "external", "minReplicas": 0}),
        asleep(status={}),  # kubectl scale --replicas=0: no autoscaler marker
        asleep(autoscaling={"mode": "slo", "minReplicas": 1}),
    ],
    ids=["off", "external", "manual", "min-1"],
)
def test_no_wake_in_off_external_or_a_manual_zero(zero: dict[str, object]) -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(zero, deployment(replicas=0))
        started = time.monotonic()
        status, _, text = await complete(http, base)
        assert status == 503 and "the gateway does not wake it" in json.loads(text)["error"]["message"]
        assert time.monotonic() - started < 2  # answered, not held for the hold time
        assert not rec.scales and not rec.events

    run(scenario)


def test_a_hold_that_outlasts_its_limit_is_a_503_with_retry_after() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(asleep(), deployment(replicas=0))
        async with http.post(url(base), json={"model": "SmolLM2", "prompt": "hi"}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
            assert "no replica of team/chat could take the request within 1 s" in (await r.json())["error"]["message"]
        assert len(rec.scales) == 1

    run(scenario, hold_seconds=1.0)


def test_bad_requests_get_openai_errors() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(), deployment())
        status, _, text = await complete(http, base, model="gpt-4")
        assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
        assert "served there: SmolLM2" in json.loads(text)["error"]["message"]
        for bad in (b"not json", b"[1, 2]", b'{"model": 3}'):
            async with http.post(url(base), data=bad) as r:
                assert r.status == 400 and "JSON object with a `model`" in (await r.json())["error"]["message"]
        assert not rec.scales

    run(scenario)


def test_no_deployment_yet_is_not_zero_replicas() -> None:
    """A service the operator has not rolled out yet: held, but never 'scaled from zero'."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(asleep())
        status, _, _ = await complete(http, base)
        assert status == 503 and not rec.scales

    run(scenario, hold_seconds=0.5)


def test_a_pod_that_only_carries_the_labels_gets_no_traffic() -> None:
    """Anyone who can create a pod in the namespace can give it the labels the operator selects:
    traffic goes only to pods of the service's own Deployment (pod -> ReplicaSet -> Deployment,
    controller references by uid)."""

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(
            *serving(POD_IPS[:1]),
            replicaset("chat-fake", owner="dep-someone-else"),
            pod("stray", POD_IPS[1], replicaset="chat-fake"),
        )
        engines = [await Engine("ours").start(POD_IPS[0]), await Engine("stray").start(POD_IPS[1])]
        try:
            results = await asyncio.gather(*(complete(http, base) for _ in range(4)))
        finally:
            for e in engines:
                await e.stop()
        assert [(status, name) for status, name, _ in results] == [(200, "ours")] * 4

    run(scenario)


def test_the_autoscaler_marks_its_own_zero_and_keeps_the_mark_only_while_replicas_stay_zero() -> None:
    """The marker wake_refusal reads (status.autoscaler.scaledToZeroAt), as the autoscaler's
    status patch writes it: set by its scale to 0, kept by its holds at 0, gone at any other count;
    a zero it finds (a manual scale) never gets one."""
    from kvpilot.operator.api.names import SCALED_TO_ZERO_AT
    from kvpilot.operator.autoscaling.decisions import AutoscalerState, Decision, Signals
    from kvpilot.operator.autoscaling.loop import status_patch

    def mark(action: str, replicas: int, previous: int, zeroed_at: str | None) -> str | None:
        decision = Decision(
            at=100.0, action=action, replicas=replicas, previous=previous, reason="r", signals=Signals()
        )
        return status_patch(AutoscalerState(), decision, None, zeroed_at)["autoscaler"].get(SCALED_TO_ZERO_AT)

    zeroed = mark("down", 0, 1, None)
    assert zeroed == "1970-01-01T00:01:40Z"
    assert mark("hold", 0, 0, zeroed) == zeroed
    assert mark("hold", 1, 1, zeroed) is None  # woken: the mark goes
    assert mark("hold", 0, 0, None) is None  # a zero someone else set


def test_the_gateway_exports_what_it_holds_and_forwards_and_each_requests_latency() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]), pod("chat-p0", POD_IPS[0], ready=False))
        held = [asyncio.create_task(complete(http, base)) for _ in range(3)]
        await asyncio.sleep(0.5)
        text = await (await http.get(f"{base}/metrics")).text()
        assert 'kvpilot_gateway_held_requests{namespace="team",service="chat"} 3.0' in text
        assert 'kvpilot_gateway_in_flight_requests{namespace="team",service="chat"} 0.0' in text
        engine = await Engine("e0", chunks=5, delay=0.2).start(POD_IPS[0])
        ix.put(pod("chat-p0", POD_IPS[0]))
        try:
            await asyncio.sleep(0.6)
            text = await (await http.get(f"{base}/metrics")).text()
            assert 'kvpilot_gateway_in_flight_requests{namespace="team",service="chat"} 3.0' in text
            # Still a series while the service has requests here: "none held", not "no data".
            assert 'kvpilot_gateway_held_requests{namespace="team",service="chat"} 0.0' in text
            await asyncio.gather(*held)
            await complete(http, base, model="nope")
        finally:
            await engine.stop()
        text = await (await http.get(f"{base}/metrics")).text()
        assert 'kvpilot_gateway_requests_total{code="200",namespace="team",service="chat"} 3.0' in text
        assert 'kvpilot_gateway_requests_total{code="404",namespace="team",service=""} 1.0' in text
        # Held for half a second, then a second of streaming: each at least 1.5 s, the wait included.
        # Only lower bounds: a loaded machine makes every request slower, never faster.
        series = '{code="200",namespace="team",service="chat"}'
        bucket = 'kvpilot_gateway_request_duration_seconds_bucket{code="200",le="%s",namespace="team",service="chat"}'
        assert f"{bucket % '1.0'} 0.0" in text and f"{bucket % '+Inf'} 3.0" in text
        total = float(text.split(f"kvpilot_gateway_request_duration_seconds_sum{series} ")[1].split()[0])
        assert total >= 3 * 1.4, total
        assert "kvpilot_gateway_in_flight_requests{" not in text
        assert "kvpilot_gateway_held_requests{" not in text

    run(scenario)


def test_what_is_kept_for_a_deleted_service_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 7: per-service state was never pruned."""
    monkeypatch.setattr(gw, "PRUNE_SECONDS", 0.0)
    gateways: list[gw.Gateway] = []
    original = gw.Gateway.__init__

    def remember(self: gw.Gateway, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        gateways.append(self)

    monkeypatch.setattr(gw.Gateway, "__init__", remember)

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS[:1]))
        ix.put(*serving(POD_IPS[1:2], namespace="gone", uid="u2"))
        engines = [await Engine("e0").start(POD_IPS[0]), await Engine("e1").start(POD_IPS[1])]
        try:
            assert (await complete(http, base, namespace="gone"))[0] == 200
            (gateway,) = gateways
            assert ("gone", "chat") in gateway._engines
            del ix.services[("gone", "chat")]
            assert (await complete(http, base))[0] == 200
        finally:
            for e in engines:
                await e.stop()
        assert list(gateway._engines) == [(NS, "chat")]

    run(scenario)


def test_a_namespace_without_models_is_a_404_before_the_body_and_adds_no_series() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(service(), deployment())
        for i in range(5):  # a scan of namespace names
            async with http.post(url(base, namespace=f"guess-{i}"), data=b"x" * 1024) as r:
                assert r.status == 404 and "no model is served in namespace" in (await r.json())["error"]["message"]
        text = await (await http.get(f"{base}/metrics")).text()
        assert "guess-" not in text
        assert 'kvpilot_gateway_requests_total{code="404",namespace="",service=""} 5.0' in text

    run(scenario)


def test_a_scale_write_that_fails_is_tried_again_while_the_request_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gw, "WAKE_RETRY_SECONDS", 0.2)
    failures = [RuntimeError("the API server is away")] * 2

    def flaky(ix: Indexes, replicas: int) -> None:
        if failures:
            raise failures.pop()
        (body,) = ix.services[(NS, "chat")]
        ix.put({**body, "kind": "InferenceService", "spec": {**body["spec"], "replicas": replicas}})

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(asleep(), deployment(replicas=0))
        held = asyncio.create_task(complete(http, base))
        await asyncio.sleep(1.5)
        assert len(rec.scales) == 3 and not held.done()  # two refused writes, then one that took
        ix.put(deployment(replicas=1), replicaset(), pod("p0", POD_IPS[0]))
        engine = await Engine("e0").start(POD_IPS[0])
        try:
            assert (await held)[0] == 200
        finally:
            await engine.stop()

    run(scenario, on_scale=flaky)


def test_a_mixed_pool_s_engines_are_sent_requests_by_their_gpu_type_s_capacity() -> None:
    """Issue 41: an H100 pod serves three times an L4 pod's requests per second within the SLO
    (status.variants), so least-load sends it three in four; each engine is filled to its own
    plan's batch limit, not the pool's first type's."""
    rows = [
        {"gpu": "H100-80GB", "capacityRps": 30.0, "maxNumSeqs": 200},
        {"gpu": "L4", "capacityRps": 10.0, "maxNumSeqs": 4},
    ]
    pool = service(status={"plan": {"maxNumSeqs": 200}, "variants": rows})
    pods = [pod("chat-h100-80gb-1", "127.77.3.1"), pod("chat-l4-1", "127.77.3.2")]
    pods[0]["metadata"]["labels"][VARIANT_LABEL] = "h100-80gb"
    pods[1]["metadata"]["labels"][VARIANT_LABEL] = "l4"
    weights = routing.shares(pool, pods)
    h100, l4 = "http://127.77.3.1:8000", "http://127.77.3.2:8000"
    assert weights == {h100: routing.Share(400, 30.0), l4: routing.Share(8, 10.0)}
    urls = [(p["metadata"]["name"], f"http://{p['status']['podIP']}:8000") for p in pods]
    for strategy, prefixes in (("LeastLoad", ["same"] * 16), ("PrefixHash", [f"user-{i}" for i in range(16)])):
        engines = routing.Engines()
        pool["spec"]["routing"] = {"strategy": strategy}
        for prefix in prefixes:  # requests that stay in flight
            chosen = routing.pick(pool, urls, engines, 0.0, prefix, weights)
            assert chosen is not None
            engines.in_flight[chosen] = engines.in_flight.get(chosen, 0) + 1
        assert engines.in_flight[h100] >= 11 and 3 <= engines.in_flight[l4] <= 5, (strategy, engines.in_flight)
    # The L4 engine takes no more than twice its own batch limit at once: the rest go to the H100.
    busy = routing.Engines(in_flight={l4: 8, h100: 100})
    assert routing.pick(pool, urls, busy, 0.0, "x", weights) == h100
    # A service of one type: no shares, its engines alike.
    assert routing.shares(service(status={"plan": {"maxNumSeqs": 200}}), pods) == {}
    # The L4s decode twice as slowly as their plan says, the H100s as planned (the autoscaler's
    # planAccuracy.variants): the L4 weight halves. A ratio past the bounds moves it by 4x at most.
    observed = [
        {"variant": "l4", "tpot": {"predictedMs": 40.0, "observedMs": 80.0, "ratio": 2.0}},
        {"variant": "h100-80gb", "tpot": {"predictedMs": 10.0, "observedMs": 10.0, "ratio": 1.0}},
    ]
    pool["status"]["planAccuracy"] = {"variants": observed}
    assert routing.shares(pool, pods) == {h100: routing.Share(400, 30.0), l4: routing.Share(8, 5.0)}
    # Once the L4 is re-planned with its own correction (status.correction.byGpu), its capacity holds
    # that factor already: the weight is the capacity, not halved again.
    observed[0]["gpu"] = "L4"
    pool["status"]["correction"] = {"byGpu": [{"gpu": "L4", "ttft": 2.0, "tpot": 2.0}]}
    assert routing.shares(pool, pods)[l4] == routing.Share(8, 10.0)
    del pool["status"]["correction"]
    observed[0]["tpot"]["ratio"] = 100.0
    assert routing.shares(pool, pods)[l4] == routing.Share(8, 10.0 * routing.SPEED_BOUNDS[0])
    # The L4s on spot nodes are a variant of their own (label l4-spot), with their own row.
    pool["status"]["variants"] = [*rows, {"gpu": "L4", "capacityClass": "spot", "capacityRps": 2.0, "maxNumSeqs": 2}]
    pods[1]["metadata"]["labels"][VARIANT_LABEL] = "l4-spot"
    assert routing.shares(pool, pods)[l4] == routing.Share(4, 2.0)


def _mixed_pool() -> list[dict[str, Any]]:
    """A mixed pool as the operator makes it: a Deployment per GPU type named after it, each with
    its ReplicaSet and one ready pod labelled with its type; an H100 pod weighs three L4 pods."""
    rows = [
        {"gpu": "H100-80GB", "capacityRps": 30.0, "maxNumSeqs": 200},
        {"gpu": "L4", "capacityRps": 10.0, "maxNumSeqs": 200},
    ]
    objects = [service(replicas=2, status={"plan": {"maxNumSeqs": 200}, "variants": rows})]
    for ip, gpu in zip(POD_IPS, ("h100-80gb", "l4"), strict=False):
        name = f"chat-{gpu}"
        objects.append(deployment(name, instance="chat"))
        objects.append(replicaset(f"{name}-5d8f", owner=f"dep-{UID}-{name}"))
        engine_pod = pod(f"{name}-p0", ip, replicaset=f"{name}-5d8f")
        engine_pod["metadata"]["labels"][VARIANT_LABEL] = gpu
        objects.append(engine_pod)
    return objects


def test_a_mixed_pool_is_routed_through_its_deployments_named_after_their_gpu_types() -> None:
    """Issue 41 end to end in the gateway: its watches key a mixed pool's Deployments (named
    <service>-<type>) by their service, so its pods are found and weighed by their type's capacity.
    Four requests held in flight at once: three to the H100 pod, one to the L4 pod (an even split
    would be two and two; Deployments keyed by name left the service none, and every request held)."""
    barrier = asyncio.Barrier(4)

    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*_mixed_pool())
        engines = [await Engine(gpu, barrier=barrier).start(ip) for ip, gpu in zip(POD_IPS, ("h100", "l4"))]
        try:
            answers = await asyncio.gather(*(complete(http, base) for _ in range(4)))
        finally:
            for engine in engines:
                await engine.stop()
        assert [status for status, _, _ in answers] == [200] * 4, answers
        assert sorted(engine for _, engine, _ in answers) == ["h100", "h100", "h100", "l4"]

    run(scenario, hold_seconds=3.0)
