"""The gateway's own /metrics: what it holds and forwards per InferenceService now (read from its
counters at scrape time, so a service that is gone leaves no series behind; a service with requests
in the gateway has both gauges, 0 included, so a dashboard shows "none held" rather than no data
between two holds), and each request's
count and latency through the gateway by outcome. The held queue is demand the engines cannot see
yet: a service waking from zero, or engines at their plan's capacity."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpilot.operator.api.names import GATEWAY_HELD_METRIC

# Seconds: a refusal or a 404 in milliseconds, a held request up to the 300 s hold, a long stream.
LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
Key = tuple[str, str]


class Now(Collector):
    """What the gateway holds and forwards at scrape time, read from its counters."""

    def __init__(
        self,
        held: Callable[[], Mapping[Key, int]],
        in_flight: Callable[[], Mapping[Key, int]],
        body_bytes: Callable[[], Mapping[str, int]],
    ) -> None:
        self._held, self._in_flight, self._body_bytes = held, in_flight, body_bytes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held, in_flight = self._held(), self._in_flight()
        active = sorted(set(held) | set(in_flight))
        for name, doc, counts in (
            (GATEWAY_HELD_METRIC, "Requests waiting in the gateway for an engine", held),
            ("kvpilot_gateway_in_flight_requests", "Requests forwarded to engines and not finished", in_flight),
        ):
            family = GaugeMetricFamily(name, doc, labels=["namespace", "service"])
            for namespace, service in active:
                family.add_metric([namespace, service], counts.get((namespace, service), 0))
            yield family
        family = GaugeMetricFamily(
            "kvpilot_gateway_body_bytes", "Bytes of request bodies the gateway holds", labels=["namespace"]
        )
        for namespace, value in sorted(self._body_bytes().items()):
            family.add_metric([namespace], value)
        yield family


class GatewayMetrics:
    """One registry per gateway (tests run several in one process): `now`'s gauges, and the
    requests answered."""

    def __init__(self, now: Now) -> None:
        self.registry = CollectorRegistry()
        labels = ["namespace", "service", "code"]
        self._requests = Counter(
            "kvpilot_gateway_requests", "Requests answered, by HTTP status", labels, registry=self.registry
        )
        self._latency = Histogram(
            "kvpilot_gateway_request_duration_seconds",
            "From arrival to the last byte of the answer (held time included)",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(now)

    def answered(self, key: Key, code: int, seconds: float) -> None:
        """`code` 499: the client left before its answer."""
        labels = (key[0], key[1], str(code))
        self._requests.labels(*labels).inc()
        self._latency.labels(*labels).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
