"""The chart's Grafana dashboard (helm/kvpilot/dashboards/kvpilot.json) reads only series that
exist: every metric its queries name is one our engine (with the vLLM-compatible names the operator
turns on), vLLM 0.33 itself (its own exposition code), the operator or the gateway exports, and
every panel the issue asks for is there. Prometheus evaluating the queries is not checked here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator.autoscaling.operator_metrics import OperatorMetrics
from kvpilot.operator.gateway.metrics import GatewayMetrics, Now
from tests.operator.autoscaling.test_vllm_metrics import vllm_exposition

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kvpilot" / "dashboards" / "kvpilot.json"
METRIC = re.compile(r"\b(?:kvpilot|vllm)[a-z0-9_:]*[a-z0-9_]")
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}


def series(exposition: str) -> set[str]:
    """Every series name an exposition can carry (a family with no sample yet counts)."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {family.name, *(family.name + s for s in SUFFIXES.get(family.type, ()))}
        names |= {sample.name for sample in family.samples}
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_query_names_series_we_or_vllm_export(dashboard: dict[str, Any]) -> None:
    ours = (
        series(generate_latest(ServingMetrics("m", vllm_compatible=True).registry).decode())
        | series(OperatorMetrics({}).exposition().decode())
        | series(GatewayMetrics(Now(dict, dict, dict)).exposition().decode())
    )
    named = {name for query in queries(dashboard) for name in METRIC.findall(query)}
    assert named and named <= ours, sorted(named - ours)
    # The engine panels use vLLM's names, so vLLM pods fill them as well as ours.
    vllm = series(vllm_exposition())
    engine = {name for name in named if name.startswith("vllm:")}
    assert engine and engine <= vllm, sorted(engine - vllm)


def test_the_panels_the_issue_names_are_there(dashboard: dict[str, Any]) -> None:
    text = " ".join(queries(dashboard))
    for needed in (
        "kvpilot_operator_slo_ttft_p95_seconds",  # SLO vs observed vs predicted
        "kvpilot_operator_predicted_tpot_p95_seconds",
        "vllm:time_to_first_token_seconds_bucket",
        "kvpilot_operator_desired_replicas",  # replicas and decisions
        "kvpilot_operator_autoscaler_decisions_total",
        "vllm:kv_cache_usage_perc",  # KV usage, queue, prefix hits, draft acceptance
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "kvpilot_operator_assumed_prefix_share",  # beside the hits: the plan's load.prefixShare
        "vllm:spec_decode_num_accepted_tokens_total",
        "kvpilot_gateway_held_requests",  # gateway holds
    ):
        assert needed in text, needed
    # Every query is scoped by the dashboard's namespace and service variables.
    assert all('namespace=~"$namespace"' in q and 'service=~"$service"' in q for q in queries(dashboard))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "service"}
