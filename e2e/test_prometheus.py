"""A real Prometheus (built from its Go module, e2e/prometheus.py) scraping the operator, the gateway
and the real engines behind an InferenceService's pods, as the chart's ServiceMonitor and
PodMonitors make a cluster's Prometheus scrape them.

One service, set up so that every series the dashboard reads exists: n-gram speculation over a
repetitive prompt (draft acceptance, prefix cache hits), `autoscaling.mode: external` (the
autoscaler decides every period and reports, never scales), a request sent through the gateway
before the pod's engine runs (the gateway holds it), then a bounded load through the gateway
(requests in flight, TTFT/TPOT, observed vs predicted and PlanAccurate once a window has enough
requests). The service reads its engines through that Prometheus (`autoscaling.prometheusUrl`,
allowed by the chart's `autoscaler.prometheusUrlAllow`), so the operator's observed numbers come
through the real query API too.

- Every query of every panel of helm/kvpilot/dashboards/kvpilot.json, with the dashboard's
  variables set to this service, is evaluated by Prometheus as Grafana asks it (a range query over
  the load) and returns finite data; the failure names the panels that return none.
- The prometheusUrl source (`read_prometheus`) gives, per pod, exactly what the pod's /metrics
  says, and the operator's own reads are in Prometheus' query log.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from e2e import kvis
from e2e.chart import CHART_DIR, Installation
from e2e.cluster import Binaries, Cluster
from e2e.load import Load
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.pod_runner import PodRunner
from e2e.polling import poll
from e2e.prometheus import Job, Prometheus, PrometheusError, finite, target_of
from kvpilot.operator.autoscaling.loop import read_prometheus
from kvpilot.operator.autoscaling.metrics import EngineReading, parse

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "kvpilot" / "dashboards" / "kvpilot.json"
NAME = "prom-dash"
MODEL = "SmolLM2-135M-Instruct"
# Repeated sentences: n-gram drafts are accepted and the prompt's blocks hit the prefix cache.
PROMPT = "Summarise the notes. " + "The team reviewed the release plan, the bugs and the rollout. " * 8
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval) with the
# data source's scrape interval (Grafana's default 15 s): 1m for any view up to a few hours.
RATE_INTERVAL = "1m"
# Load until every panel has data (PlanAccurate needs 8 periods of 2 s over a full window).
DATA_WITHIN_S = 180.0
JOBS = (Job("engines"), Job("kvpilot-operator", honor_labels=True), Job("kvpilot-gateway", honor_labels=True))


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # "<title> [<refId>]"
    expr: str


def grafana_regex_escape(value: str) -> str:
    """A variable's value as Grafana writes it into a Prometheus regex matcher: the regex's
    special characters behind a backslash, itself escaped in the PromQL string (`\\.`); PromQL's
    strings know no `\\-`, so Python's re.escape would not do."""
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))


def panel_queries(dashboard: dict[str, Any], namespace: str, service: str) -> list[PanelQuery]:
    """Every panel's queries with the dashboard's variables set to one service, as Grafana sends
    them once `namespace` and `service` are chosen."""
    values = {
        "$namespace": grafana_regex_escape(namespace),
        "$service": grafana_regex_escape(service),
        "$__rate_interval": RATE_INTERVAL,
    }
    found = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in values.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']} [{target['refId']}]: a variable left in {expr}"
            found.append(PanelQuery(f"{panel['title']} [{target['refId']}]", expr))
    return found


@dataclass
class Scenario:
    cluster: Cluster
    namespace: str
    name: str
    prometheus: Prometheus
    runner: PodRunner
    started: float  # Unix time, when the service was applied
    held: dict[str, Any] = field(default_factory=dict)  # the request the gateway held
    load: Load | None = None


def _upgrade_prometheus_allow(k8s: Cluster, kvpilot: Installation, allowed: list[str]) -> None:
    k8s.helm(
        "upgrade",
        kvpilot.release,
        str(CHART_DIR),
        "--namespace",
        kvpilot.namespace,
        "--reuse-values",
        "--set-json",
        f"autoscaler.prometheusUrlAllow={json.dumps(allowed)}",
        "--wait",
        "--timeout=120s",
        timeout=150,
    )


@pytest.fixture(scope="module")
def prometheus(
    k8s_binaries: Binaries,
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    gateway: LocalGateway,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1, allowed as a prometheusUrl by the operator (restarted to read the
    chart's new argument, and again at the end without it)."""
    with Prometheus(k8s_binaries, tmp_path_factory.mktemp("prometheus"), JOBS) as prom:
        _upgrade_prometheus_allow(k8s, kvpilot, [prom.url])
        operator.restart()
        try:
            yield prom
        finally:
            _upgrade_prometheus_allow(k8s, kvpilot, [])
            operator.restart()


def _hold_one(url: str, key: str, into: dict[str, Any]) -> threading.Thread:
    """A completion through the gateway in a thread; `into` gets its status and text."""

    def send() -> None:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        try:
            with httpx.Client(trust_env=False, timeout=300) as http:
                answer = http.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            into.update(status=answer.status_code, body=answer.text[:300])
        except httpx.HTTPError as error:
            into.update(status=None, body=repr(error))

    thread = threading.Thread(target=send, name="held-request", daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def scenario(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    gateway: LocalGateway,
    prometheus: Prometheus,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scenario]:
    namespace = kvpilot.watch_namespaces[0]
    spec: dict[str, Any] = kvis.sample("smollm2-135m")["spec"]
    spec["serving"] = {**spec.get("serving", {}), "speculative": "ngram"}
    spec["autoscaling"] = {"mode": "external", "prometheusUrl": prometheus.url}
    started = time.time()
    k8s.apply(kvis.manifest(NAME, namespace, spec))
    try:
        kvis.wait_condition(k8s, namespace, NAME, "Ready", "True", timeout_s=60)
        key = kvis.api_key(k8s, namespace, NAME)
        runner = PodRunner(k8s, namespace, NAME, tmp_path_factory.mktemp("engines"))
        engine_labels = {"namespace": namespace, "service": NAME}
        follower = prometheus.follow(
            {
                # What the ServiceMonitor scrapes: the ready endpoints of the engine Service.
                "engines": lambda: [
                    target_of(url, {**engine_labels, "pod": pod}) for pod, url in runner.serving().items()
                ],
                "kvpilot-operator": lambda: [target_of(operator.metrics_url, {"namespace": kvpilot.namespace})],
                "kvpilot-gateway": lambda: [target_of(gateway.url, {"namespace": kvpilot.namespace})],
            }
        )
        with follower:
            found = Scenario(k8s, namespace, NAME, prometheus, runner, started)
            # No engine behind the Ready pod yet: the gateway holds the request, and says so.
            held = _hold_one(gateway.base_url(namespace), key, found.held)
            poll(
                lambda: (
                    prometheus.query(f'kvpilot_gateway_held_requests{{namespace="{namespace}",service="{NAME}"}} > 0')
                    or None
                ),
                60,
                "the gateway's held request in Prometheus",
                interval_s=1.0,
            )
            with runner:
                poll(lambda: runner.serving() or None, 180, f"an engine for {NAME}'s pod", interval_s=1.0)
                held.join(timeout=120)
                load = Load(
                    lambda: [f"{gateway.url}/namespaces/{namespace}"],
                    MODEL,
                    rate=4.0,
                    prompt=PROMPT,
                    max_tokens=16,
                    api_key=key,
                )
                with load:
                    found.load = load
                    yield found
                assert not runner.errors, runner.snapshot()
        assert not follower.errors, follower.errors
    finally:
        k8s.kubectl("delete", "inferenceservice", NAME, "-n", namespace, "--ignore-not-found", "--wait=false")


def _evaluate(prom: Prometheus, queries: list[PanelQuery], start: float) -> dict[str, int]:
    """Finite samples per panel query over [start, now], at Grafana's step for such a span."""
    counts = {}
    for query in queries:
        try:
            counts[query.panel] = finite(prom.query_range(query.expr, start, time.time(), 2))
        except PrometheusError as error:
            raise AssertionError(f"Prometheus refuses the query of {query.panel}: {query.expr}\n{error}") from None
    return counts


def _table(counts: dict[str, int]) -> str:
    return "\n".join(f"  {'data' if n else 'NONE':4} {n:5d}  {panel}" for panel, n in counts.items())


def test_every_dashboard_panel_has_data_in_a_real_prometheus(scenario: Scenario) -> None:
    prom, namespace = scenario.prometheus, scenario.namespace
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard, namespace, scenario.name)

    # The dashboard's variables offer this namespace and service (Grafana's label_values), once
    # Prometheus has scraped the operator (its file_sd targets reach the scrapes within ~5 s).
    try:
        poll(
            lambda: namespace in prom.label_values("namespace", "kvpilot_operator_desired_replicas") or None,
            30,
            "the operator's series in Prometheus",
            interval_s=1.0,
        )
    except TimeoutError:
        pytest.fail(f"no kvpilot_operator_desired_replicas of {namespace}; targets: {_targets(prom)}")
    assert scenario.name in prom.label_values(
        "service", f'kvpilot_operator_desired_replicas{{namespace=~"{namespace}"}}'
    )

    counts: dict[str, int] = {}

    def all_have_data() -> bool:
        counts.update(_evaluate(prom, queries, scenario.started))
        return all(counts.values())

    try:
        poll(all_have_data, DATA_WITHIN_S, "data for every panel query", interval_s=3.0)
    except TimeoutError:
        status = kvis.get(scenario.cluster, namespace, scenario.name).get("status", {})
        pytest.fail(
            "panel queries without data after the load:\n"
            + "\n".join(f"  {q.panel}: {q.expr}" for q in queries if not counts.get(q.panel))
            + f"\nall:\n{_table(counts)}\ntargets: {_targets(prom)}\nstatus: {json.dumps(status)[:3000]}"
        )
    print(f"dashboard panels in Prometheus ({prom.url}):\n{_table(counts)}")
    # The held request went on once the engine listened; kwok's pod is Ready before the model is
    # loaded (no kubelet runs its readiness probe), so the engine may have answered it with a 503.
    print(f"the request the gateway held: {scenario.held}")
    assert scenario.load is not None
    ok = [r for r in scenario.load.results if r.error is None]
    assert len(ok) >= 20, (len(scenario.load.results), [r.error for r in scenario.load.results if r.error][:5])


def _targets(prom: Prometheus) -> list[tuple[str, str, str, str]]:
    return [
        (t["labels"].get("job", ""), t["scrapeUrl"], t["health"], t.get("lastError", "")) for t in prom.active_targets()
    ]


def _via_prometheus(url: str, namespace: str, pods: list[str]) -> dict[str, EngineReading | str]:
    async def read() -> dict[str, EngineReading | str]:
        async with aiohttp.ClientSession(trust_env=False) as session:
            reads = await read_prometheus(session, url, namespace, pods)
        return {r.name: r.reading if r.reading is not None else str(r.error) for r in reads}

    return asyncio.run(read())


def _direct(urls: dict[str, str]) -> dict[str, EngineReading]:
    with httpx.Client(trust_env=False, timeout=10) as http:
        return {pod: parse(http.get(f"{url}/metrics").text) for pod, url in urls.items()}


def test_the_prometheus_url_source_reads_what_the_engines_report(scenario: Scenario) -> None:
    prom, namespace, name = scenario.prometheus, scenario.namespace, scenario.name
    assert scenario.load is not None
    # The load has run (the panel test waited for it); stop it and let the engines go idle, so
    # that their numbers hold still while Prometheus scrapes them.
    poll(lambda: len([r for r in scenario.load.results if r.error is None]) >= 20 or None, 120, "20 answered requests")
    scenario.load.rate = 0
    urls = scenario.runner.serving()
    assert urls, scenario.runner.snapshot()
    poll(
        lambda: all(r.running == 0 and r.waiting == 0 for r in _direct(urls).values()) or None,
        120,
        "idle engines",
        interval_s=1.0,
    )
    direct: dict[str, EngineReading] = {}
    through: dict[str, EngineReading | str] = {}

    def same() -> bool:
        direct.clear()
        direct.update(_direct(urls))
        through.clear()
        through.update(_via_prometheus(prom.url, namespace, sorted(urls)))
        return through == direct

    try:
        poll(same, 20, "Prometheus' series equal to the engines' /metrics", interval_s=1.0)
    except TimeoutError:
        pytest.fail(f"through Prometheus: {through}\ndirect: {direct}\ntargets: {_targets(prom)}")
    for pod, reading in direct.items():
        # Numbers worth comparing: the load's first tokens, its TPOT and its drafts.
        assert reading.ttft is not None and reading.ttft.count >= 20, (pod, reading)
        assert reading.tpot is not None and reading.tpot.count > 0, (pod, reading)
        assert reading.draft_tokens and reading.accepted_tokens is not None, (pod, reading)

    # The operator read the same series through the same API: its queries are in the query log,
    # and it knew every pod (none unknown) and observed the latencies from them.
    mine = [q for q in prom.logged_queries() if f'namespace="{namespace}"' in q and "__name__=~" in q]
    assert any(all(pod in q for pod in urls) for q in mine), prom.logged_queries()[-5:]
    status = kvis.get(scenario.cluster, namespace, name)["status"]
    assert status["latency"]["source"] == "observed", (status["latency"], status.get("autoscaler"))
    assert status["autoscaler"]["unknownPods"] == [], status["autoscaler"]
