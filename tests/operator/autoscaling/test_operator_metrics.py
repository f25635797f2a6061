"""The operator's own /metrics (operator/autoscaling/operator_metrics.py), served over HTTP on
127.0.0.1 after periods of the autoscaler's loop against an engine-like /metrics server: the
plan's predictions, the SLO and the observed p95s per InferenceService, replicas, the decisions by
action and cause; a service that is gone leaves no series."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import aiohttp
import kopf
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator import process
from kvpilot.operator.autoscaling.decisions import Decision, Signals
from kvpilot.operator.autoscaling.loop import AutoscalingLoop
from kvpilot.operator.autoscaling.operator_metrics import OperatorMetrics
from kvpilot.operator.kube.indexes import indexed_children
from tests.operator.autoscaling.test_loop_io import engines, service  # noqa: F401  (a fixture)
from tests.operator.controller.test_reconcile import apply_merge_patch

NOW = 1_800_000_000.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Applying:
    """The cluster adapter: a status write lands in the indexed InferenceService, as the watch
    would bring it back."""

    def __init__(self, services: dict[Any, list[dict[str, Any]]]) -> None:
        self.services = services

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, patch: Any, rv: Any = None) -> str:
        (body,) = self.services[(namespace, name)]
        body["status"] = apply_merge_patch(body.get("status") or {}, patch)
        body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        return body["metadata"]["resourceVersion"]

    def write_replicas(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_deletion_costs(self, *args: Any) -> None:
        pass


def samples(text: str) -> Samples:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def of_chat(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted({"namespace": "ml", "service": "chat", **labels}.items()))))


def serving(engine: ServingMetrics) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        payload = generate_latest(engine.registry)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    return respond


def test_metrics_after_loop_periods_against_an_engine(
    engines: Callable[[Callable[[BaseHTTPRequestHandler], None]], str],  # noqa: F811
) -> None:
    engine = ServingMetrics("m")
    body, deployment, replicaset, pod = service("chat", engines(serving(engine)))
    body["metadata"]["generation"] = 2
    body["spec"]["slo"] = {"ttftP95Ms": 2000, "tpotP95Ms": 100}
    body["status"] = {
        "plan": {
            "predictedTtftMs": 100.0,
            "predictedTpotMs": 20.0,
            "assumedDraftAcceptance": 0.7,
            "assumedPrefixShare": 0.5,
        },
        "desiredReplicas": 1,
        "replicas": 1,
        "readyReplicas": 1,
    }
    services, *children = [{("ml", "chat"): [one]} for one in (body, deployment, replicaset, pod)]
    loop = AutoscalingLoop(Applying(services), services, *children)

    async def scrape(url: str) -> str:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200 and response.content_type == "text/plain"
            return await response.text()

    async def run() -> tuple[list[Any], str, str]:
        runner = await loop.metrics.serve("127.0.0.1", 0)
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
        try:
            decisions = [await loop.one(body, *indexed_children(*children, body), now=NOW)]
            for _ in range(40):
                engine._family("ttft").observe(0.09)
                engine._family("tpot").observe(0.021)
            engine._family("spec_draft_tokens").inc(100)
            engine._family("spec_accepted").inc(40)
            engine._family("prefix_queries").inc(400)
            engine._family("prefix_hits").inc(100)
            decisions.append(await loop.one(body, *indexed_children(*children, body), now=NOW + 15))
            during = await scrape(url)
            del services[("ml", "chat")]  # the InferenceService is deleted
            return decisions, during, await scrape(url)
        finally:
            await runner.cleanup()
            await loop.close()

    decisions, during, after = asyncio.run(run())
    assert all(d is not None for d in decisions)
    found = samples(during)
    written = body["status"]
    assert of_chat(found, "kvpilot_operator_predicted_ttft_p95_seconds") == 0.1
    assert of_chat(found, "kvpilot_operator_predicted_tpot_p95_seconds") == 0.02
    assert of_chat(found, "kvpilot_operator_slo_ttft_p95_seconds") == 2.0
    assert of_chat(found, "kvpilot_operator_slo_tpot_p95_seconds") == 0.1
    observed_ttft = of_chat(found, "kvpilot_operator_observed_ttft_p95_seconds")
    assert observed_ttft == pytest.approx(written["latency"]["ttftP95Ms"] / 1000)
    assert observed_ttft == pytest.approx(decisions[1].signals.ttft_p95_seconds, abs=1e-4)
    assert of_chat(found, "kvpilot_operator_observed_tpot_p95_seconds") == pytest.approx(
        decisions[1].signals.tpot_p95_seconds, abs=1e-4
    )
    assert of_chat(found, "kvpilot_operator_ttft_observed_over_predicted") == written["planAccuracy"]["ttft"]["ratio"]
    assert of_chat(found, "kvpilot_operator_observed_draft_acceptance") == 0.4
    assert of_chat(found, "kvpilot_operator_assumed_draft_acceptance") == 0.7
    assert of_chat(found, "kvpilot_operator_observed_prefix_share") == 0.25
    assert of_chat(found, "kvpilot_operator_assumed_prefix_share") == 0.5
    assert of_chat(found, "kvpilot_operator_plan_accurate") == 1.0  # within the band: True
    assert {c["type"]: c["status"] for c in written["conditions"]}["PlanAccurate"] == "True"
    assert of_chat(found, "kvpilot_operator_desired_replicas") == 1.0
    assert of_chat(found, "kvpilot_operator_ready_replicas") == 1.0
    counted = {
        (labels["action"], labels["cause"]): value
        for (name, key), value in found.items()
        if name == "kvpilot_operator_autoscaler_decisions_total"
        for labels in [dict(key)]
    }
    assert counted == Counter((d.action, d.cause) for d in decisions) and all(d.cause for d in decisions)
    assert not any(dict(key).get("service") == "chat" for _, key in samples(after))


def test_decisions_are_counted_per_service_and_forgotten_with_it() -> None:
    metrics = OperatorMetrics({("ml", "chat"): [{"metadata": {"namespace": "ml", "name": "chat"}}]})
    decision = Decision(at=NOW, action="hold", replicas=1, previous=1, reason="r", cause="in_band", signals=Signals())
    metrics.decided("ml", "chat", decision)
    metrics.decided("ml", "chat", decision)
    metrics.decided("ml", "gone", decision)
    found = samples(metrics.exposition().decode())
    assert of_chat(found, "kvpilot_operator_autoscaler_decisions_total", action="hold", cause="in_band") == 2.0
    assert not any(dict(key).get("service") == "gone" for _, key in found)


def test_an_address_the_operator_cannot_listen_on_is_logged_and_it_runs_on(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> tuple[Any, Any]:
        taken = await OperatorMetrics({}).serve("127.0.0.1", 0)
        port = taken.addresses[0][1]
        memo = kopf.Memo(metrics_address=("127.0.0.1", port))
        try:
            await process.serve_metrics(memo, OperatorMetrics({}))
        finally:
            await taken.cleanup()
        return memo.get("metrics_server"), port

    with caplog.at_level(logging.ERROR, logger=process.__name__):
        server, port = asyncio.run(run())
    assert server is None
    assert any(f"cannot serve /metrics on 127.0.0.1:{port}" in r.getMessage() for r in caplog.records)


def test_a_mixed_pool_s_types_and_the_time_to_ready_are_gauges() -> None:
    status = {
        "plan": {"predictedReadySeconds": 25.0},
        "planAccuracy": {
            "readySeconds": {"predicted": 25.0, "observed": 31.5, "ratio": 1.26, "pod": "chat-l4-1"},
            "variants": [
                {
                    "gpu": "L4",
                    "variant": "l4",
                    "tpot": {"predictedMs": 40.0, "observedMs": 80.0, "ratio": 2.0, "requests": 40},
                    "plannedShare": 0.22,
                    "observedShare": 0.4,
                    "requests": 40,
                },
                {"gpu": "H100-80GB", "variant": "h100-80gb", "plannedShare": 0.78},
            ],
        },
        "variants": [
            {"gpu": "L4", "replicas": 2, "readyReplicas": 1, "costPerHour": 0.9, "capacityRps": 5.2},
            {"gpu": "H100-80GB", "replicas": 1, "readyReplicas": 1, "costPerHour": 6.88, "capacityRps": 37.2},
            {"gpu": "L4", "capacityClass": "spot", "replicas": 3, "costPerHour": 0.6, "capacityRps": 5.2},
        ],
    }
    body = {"metadata": {"namespace": "ml", "name": "chat"}, "status": status}
    found = samples(OperatorMetrics({("ml", "chat"): [body]}).exposition().decode())
    assert of_chat(found, "kvpilot_operator_predicted_ready_seconds") == 25.0
    assert of_chat(found, "kvpilot_operator_observed_ready_seconds") == 31.5
    assert of_chat(found, "kvpilot_operator_variant_replicas", gpu="L4", capacity_class="") == 2
    assert of_chat(found, "kvpilot_operator_variant_ready_replicas", gpu="L4", capacity_class="") == 1
    assert of_chat(found, "kvpilot_operator_variant_cost_dollars_per_hour", gpu="H100-80GB", capacity_class="") == 6.88
    assert of_chat(found, "kvpilot_operator_variant_capacity_rps", gpu="H100-80GB", capacity_class="") == 37.2
    # Each type's own p95 against its own plan, and its share of the traffic beside the planned one.
    assert of_chat(found, "kvpilot_operator_variant_observed_tpot_p95_seconds", gpu="L4", capacity_class="") == 0.08
    assert of_chat(found, "kvpilot_operator_variant_tpot_observed_over_predicted", gpu="L4", capacity_class="") == 2.0
    assert of_chat(found, "kvpilot_operator_variant_observed_traffic_share", gpu="L4", capacity_class="") == 0.4
    assert of_chat(found, "kvpilot_operator_variant_planned_traffic_share", gpu="H100-80GB", capacity_class="") == 0.78
    # Nothing observed of the H100s yet: no sample (not a zero).
    assert of_chat(found, "kvpilot_operator_variant_observed_traffic_share", gpu="H100-80GB", capacity_class="") is None
    # Spot and on-demand L4s are two series, told apart by their class (none: empty, as before classes).
    assert of_chat(found, "kvpilot_operator_variant_replicas", gpu="L4", capacity_class="spot") == 3
