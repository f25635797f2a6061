"""Reading the engines through Prometheus (`autoscaling.prometheusUrl`) gives what their /metrics give.

A stand-in Prometheus on 127.0.0.1 answers /api/v1/query as Prometheus does for an instant vector
selector: it holds every sample of real engine expositions (kvpilot's ServingMetrics, vLLM's
names too) under the labels a ServiceMonitor adds, and applies the query's label matchers
(`=` and `=~`, fully anchored as in PromQL).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.autoscaling.decisions import PodRead
from kvpilot.operator.autoscaling.loop import AutoscalingLoop, prometheus_allowed, prometheus_query, read_prometheus
from kvpilot.operator.autoscaling.metrics import parse
from tests.operator.autoscaling.test_loop_io import with_session

NS = "team"


def engine_text(ttfts: list[float], waiting: int = 0, vllm: bool = False, drafted: int = 0, accepted: int = 0) -> str:
    """A real engine's /metrics after these first tokens, with `waiting` requests queued and
    these draft tokens proposed and accepted."""
    metrics = ServingMetrics("chat", vllm_compatible=vllm)
    for ttft in ttfts:
        metrics._family("ttft").observe(ttft)
    metrics._family("waiting").set(waiting)
    metrics._family("spec_draft_tokens").inc(drafted)
    metrics._family("spec_accepted").inc(accepted)
    return generate_latest(metrics.registry).decode()


def stored(text: str, pod: str) -> list[dict[str, Any]]:
    """Every sample of an exposition as Prometheus stores it after scraping the pod."""
    return [
        {
            "metric": {
                "__name__": sample.name,
                **sample.labels,
                "namespace": NS,
                "pod": pod,
                "job": f"{NS}/chat",
                "instance": f"{pod}:8000",
            },
            "value": [1_700_000_000.0, repr(float(sample.value)) if sample.value != float("inf") else "+Inf"],
        }
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


MATCHER = re.compile(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"')


def select(query: str, series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An instant vector selector `{label="v",label=~"re",...}` over the stored series."""
    assert query.startswith("{") and query.endswith("}"), query
    matchers = MATCHER.findall(query[1:-1])
    assert matchers, query

    def matches(labels: dict[str, str]) -> bool:
        for label, op, value in matchers:
            have = labels.get(label, "")
            if (op == "=" and have != value) or (op == "=~" and not re.fullmatch(value, have)):
                return False
        return True

    return [one for one in series if matches(one["metric"])]


@pytest.fixture()
def prometheus() -> Iterator[tuple[str, list[dict[str, Any]], list[str]]]:
    series: list[dict[str, Any]] = []
    queries: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            assert url.path == "/prom/api/v1/query"
            query = parse_qs(url.query)["query"][0]
            queries.append(query)
            body = json.dumps(
                {"status": "success", "data": {"resultType": "vector", "result": select(query, series)}}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/prom", series, queries
    finally:
        server.shutdown()
        server.server_close()


def test_a_pod_read_through_prometheus_equals_its_metrics(
    prometheus: tuple[str, list[dict[str, Any]], list[str]],
) -> None:
    url, series, queries = prometheus
    ours = engine_text([0.05, 0.2, 0.2, 1.5], waiting=3, drafted=50, accepted=20)
    theirs = (
        "\n".join(
            line
            for line in engine_text([0.4] * 5, vllm=True, drafted=8, accepted=2).splitlines()
            if line.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:"))
        )
        + "\n"
    )
    series += stored(ours, "chat-a") + stored(theirs, "chat-b") + stored(ours, "elsewhere")
    series += [dict(one, metric={**one["metric"], "namespace": "other"}) for one in stored(ours, "chat-c")]
    reads = {r.name: r for r in with_session(read_prometheus, url, NS, ["chat-b", "chat-a", "chat-c"])}
    assert reads["chat-a"].reading == parse(ours)
    assert reads["chat-a"].reading.ttft.count == 4 and reads["chat-a"].reading.waiting == 3
    assert (reads["chat-a"].reading.draft_tokens, reads["chat-a"].reading.accepted_tokens) == (50, 20)
    assert reads["chat-b"].reading == parse(theirs) and reads["chat-b"].reading.ttft.count == 5
    assert (reads["chat-b"].reading.draft_tokens, reads["chat-b"].reading.accepted_tokens) == (8, 2)
    # chat-c's series are in another namespace: not this service's pod.
    assert reads["chat-c"].reading is None and "no series for this pod" in reads["chat-c"].error
    (query,) = queries
    assert query == prometheus_query(NS, ["chat-a", "chat-b", "chat-c"])
    assert 'namespace="team"' in query and 'pod=~"chat-a|chat-b|chat-c"' in query


def test_prometheus_that_cannot_answer_makes_every_pod_unknown() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed: nothing listens there
    reads = with_session(read_prometheus, f"http://127.0.0.1:{port}", NS, ["b", "a"], 2)
    assert [r.name for r in reads] == ["a", "b"]
    assert all(r.reading is None and f"Prometheus at http://127.0.0.1:{port}" in r.error for r in reads)
    assert with_session(read_prometheus, f"http://127.0.0.1:{port}", NS, []) == []


def test_the_loop_reads_from_prometheus_when_the_spec_names_one(
    prometheus: tuple[str, list[dict[str, Any]], list[str]],
) -> None:
    url, series, queries = prometheus
    text = engine_text([0.3] * 7)
    series += stored(text, "chat-a")
    loop = AutoscalingLoop(cluster=None, services={}, deployments={}, replicasets={}, pods={}, prometheus_allow=(url,))
    body = {
        "metadata": {"namespace": NS, "name": "chat"},
        "spec": {"model": {"name": "m"}, "autoscaling": {"prometheusUrl": url}},
    }
    # The pod's own address is not dialled (nothing listens there): Prometheus is.
    (read,) = read_all(loop, body, [("chat-a", "http://127.0.0.1:9/metrics")])
    assert read.reading == parse(text) and len(queries) == 1
    body["spec"]["autoscaling"] = {}
    (read,) = read_all(loop, body, [("chat-a", "http://127.0.0.1:9/metrics")])
    assert read.reading is None and "Cannot connect" in read.error and len(queries) == 1


def read_all(loop: AutoscalingLoop, body: dict[str, Any], targets: list[tuple[str, str]]) -> list[PodRead]:
    """The loop's reads of one period, on an event loop of their own."""

    async def once() -> list[PodRead]:
        try:
            return await loop.read_all(body, targets)
        finally:
            await loop.close()

    return asyncio.run(once())


@pytest.mark.parametrize("url", ["prometheus:9090", "ftp://p", "http://", "http://p 9090"])
def test_a_prometheus_url_must_be_http(url: str) -> None:
    with pytest.raises(ValidationError, match="prometheus"):
        InferenceServiceSpec.model_validate({"model": {"name": "m"}, "autoscaling": {"prometheusUrl": url}})
    assert InferenceServiceSpec.model_validate(
        {"model": {"name": "m"}, "autoscaling": {"prometheusUrl": "http://prometheus.monitoring:9090/x"}}
    )


def test_a_nan_in_prometheus_makes_that_pod_unknown_not_the_service(
    prometheus: tuple[str, list[dict[str, Any]], list[str]],
) -> None:
    """A NaN in one pod's +Inf bucket (a stale marker, a broken exporter) is that pod's problem."""
    url, series, _ = prometheus
    text = engine_text([0.3] * 7)
    series += stored(text, "chat-a")
    for one in stored(text, "chat-b"):
        if one["metric"]["__name__"].endswith("_bucket") and one["metric"].get("le") == "+Inf":
            one = dict(one, value=[one["value"][0], "NaN"])
        series.append(one)
    reads = {r.name: r for r in with_session(read_prometheus, url, NS, ["chat-a", "chat-b"])}
    assert reads["chat-a"].reading == parse(text)
    assert reads["chat-b"].reading is None and "not finite" in reads["chat-b"].error


@pytest.mark.parametrize(
    "url, allowed",
    [
        ("http://prometheus.monitoring:9090", True),
        ("http://prometheus.monitoring:9090/", True),
        ("http://PROMETHEUS.monitoring:9090/prom/x", True),
        ("https://thanos.monitoring/query", True),
        ("https://thanos.monitoring:443/query/tenant-a", True),
        ("https://thanos.monitoring/query-other", False),  # a prefix of the path, not of its segments
        ("https://thanos.monitoring/query/../admin", False),
        ("https://thanos.monitoring/query/%2e%2e/admin", False),
        ("http://thanos.monitoring/query", False),  # another scheme
        ("http://prometheus.monitoring:90901", False),
        ("http://prometheus.monitoring:9090@evil.example", False),  # the host is evil.example
        ("http://prometheus.monitoring:9090.evil.example", False),
        ("http://prometheus.monitoring", False),  # port 80
        ("http://prometheus.monitoring:9090/?x=1", False),
    ],
)
def test_prometheus_urls_are_allowed_by_parsed_prefix(url: str, allowed: bool) -> None:
    prefixes = ("http://prometheus.monitoring:9090", "https://thanos.monitoring/query")
    assert prometheus_allowed(url, prefixes) is allowed
    assert not prometheus_allowed(url, ())


def test_a_prometheus_the_operator_does_not_allow_is_never_dialled(
    prometheus: tuple[str, list[dict[str, Any]], list[str]],
) -> None:
    url, series, queries = prometheus
    series += stored(engine_text([0.3]), "chat-a")
    body = {
        "metadata": {"namespace": NS, "name": "chat"},
        "spec": {"model": {"name": "m"}, "autoscaling": {"prometheusUrl": url}},
    }
    loop = AutoscalingLoop(
        cluster=None,
        services={},
        deployments={},
        replicasets={},
        pods={},
        prometheus_allow=("http://prometheus.monitoring:9090",),
    )
    (read,) = read_all(loop, body, [("chat-a", "http://127.0.0.1:9/metrics")])
    assert read.reading is None and queries == []
    assert f"prometheusUrl {url} is not allowed" in read.error
    assert "--prometheus-url-allow" in read.error and "http://prometheus.monitoring:9090" in read.error
