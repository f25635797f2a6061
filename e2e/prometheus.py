"""A real Prometheus on 127.0.0.1, scraping what the e2e harness runs, and its HTTP API.

The binary is built from its Go module by build-binaries.sh (e2e/k8s-bins/prometheus), into the
same cache as the control plane's. Every job reads its targets from a file (`file_sd_configs`)
that `Prometheus.follow` keeps in step with the harness: the engines the pod runner starts come
and go, and the operator's /metrics moves to a new port at each restart. The targets carry the
labels the chart's ServiceMonitor and PodMonitors give in a cluster (`namespace`, `service`,
`pod`), and the operator's and gateways' jobs keep their series' own `namespace` and `service`
(`honor_labels`, as the chart's PodMonitors set). Every query the API answers is written to a
query log (`query_log_file`), so a test can tell who asked Prometheus what.

Every address is a loopback one: the harness's pods and processes are on 127.0.0.0/8, and a
target elsewhere is refused before it reaches the config.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from e2e.cluster import Binaries
from e2e.polling import Background
from e2e.procs import LOOPBACK, Process, free_port, start_http

BINARY = "prometheus"
# Scrapes every second: a test's load lasts tens of seconds, and a rate needs two samples.
SCRAPE_INTERVAL_S = 1
# How often the target files are brought up to date (Prometheus also watches them with inotify).
FOLLOW_INTERVAL_S = 0.5


class PrometheusError(RuntimeError):
    """Prometheus refused a query, or did not answer."""


@dataclass(frozen=True)
class Target:
    """One scrape target: a loopback host:port and the labels the monitor in a cluster would give."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        host = urllib.parse.urlsplit(f"//{self.address}").hostname or ""
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"scrape target {self.address} is not on 127.0.0.0/8: nothing here may be dialled there")


def target_of(url: str, labels: Mapping[str, str]) -> Target:
    """The target of a base or /metrics URL (`http://127.1.2.1:8000`, `http://127.0.0.1:4242/metrics`)."""
    parts = urllib.parse.urlsplit(url)
    return Target(parts.netloc, labels)


@dataclass(frozen=True)
class Job:
    name: str
    # Keep the series' own `namespace` and `service` over the target's (the operator's and the
    # gateways' series name the InferenceService, not the pod that serves them).
    honor_labels: bool = False


def config(jobs: Sequence[Job], targets_dir: Path, query_log: Path) -> dict[str, Any]:
    """prometheus.yml: one file_sd job per `jobs`, scraping /metrics every SCRAPE_INTERVAL_S."""
    interval = f"{SCRAPE_INTERVAL_S}s"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "query_log_file": str(query_log)},
        "scrape_configs": [
            {
                "job_name": job.name,
                "honor_labels": job.honor_labels,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_dir / f"{job.name}.json")], "refresh_interval": interval}],
            }
            for job in jobs
        ],
    }


def finite(result: Sequence[Mapping[str, Any]]) -> int:
    """The finite samples in an API result (a vector's `value`, a matrix's `values`): NaN is what
    a ratio of nothing or a quantile of no observations gives, and is no data."""
    count = 0
    for series in result:
        for _, value in series.get("values") or [series["value"]]:
            count += math.isfinite(float(value))
    return count


class Prometheus:
    """Start with `start()` (or as a context manager), stop by PID with `stop()`."""

    def __init__(self, binaries: Binaries, workdir: Path, jobs: Sequence[Job]) -> None:
        self.binary = binaries.path(BINARY)
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(
                f"{self.binary} is missing: e2e/build-binaries.sh builds it (e2e/k8s-bins/prometheus)"
            )
        self.workdir, self.jobs = workdir, tuple(jobs)
        self.targets_dir = workdir / "targets"
        self.query_log = workdir / "queries.log"
        self.url = ""
        self.process: Process | None = None
        self._http = httpx.Client(timeout=30, trust_env=False)

    def start(self, timeout_s: float = 60.0) -> Process:
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        for job in self.jobs:
            self.set_targets(job.name, [])
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config(self.jobs, self.targets_dir, self.query_log)))
        port = free_port()
        self.url = f"http://{LOOPBACK}:{port}"
        argv = [
            str(self.binary),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{port}",
            "--storage.tsdb.retention.time=1d",
        ]
        self.process = start_http(argv, self.workdir / "prometheus.log", f"{self.url}/-/ready", timeout_s)
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self._http.close()

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def set_targets(self, job: str, targets: Sequence[Target]) -> None:
        """Write `job`'s targets (atomically: Prometheus never reads half a file)."""
        body = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        path = self.targets_dir / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        tmp.replace(path)

    def follow(self, targets: Mapping[str, Callable[[], Sequence[Target]]]) -> TargetFollower:
        """A Background that keeps each job's targets equal to what its callable returns."""
        return TargetFollower(self, targets)

    def _get(self, path: str, params: Mapping[str, Any]) -> Any:
        try:
            response = self._http.get(f"{self.url}{path}", params=params)
            body = response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise PrometheusError(f"GET {path} {dict(params)}: {type(error).__name__}: {error}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {dict(params)}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: the `result` (PrometheusError when Prometheus refuses it)."""
        data = self._get("/api/v1/query", {"query": expr})
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """A range query, as a dashboard's time series panel asks it (times in Unix seconds)."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step_s})
        return list(data["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """The values of `label` on the series `match` selects (Grafana's `label_values`)."""
        return list(self._get(f"/api/v1/label/{label}/values", {"match[]": match}))

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", {"state": "active"})["activeTargets"])

    def logged_queries(self) -> list[str]:
        """Every query the API has answered so far (the query log's `params.query`)."""
        if not self.query_log.exists():
            return []
        lines = self.query_log.read_text().splitlines()
        return [json.loads(line)["params"]["query"] for line in lines if line.strip()]


class TargetFollower(Background):
    def __init__(self, prometheus: Prometheus, targets: Mapping[str, Callable[[], Sequence[Target]]]) -> None:
        super().__init__("prometheus-targets")
        self.prometheus, self.targets = prometheus, dict(targets)
        self.errors: list[str] = []
        self._written: dict[str, list[Target]] = {}
        self._lock = threading.Lock()

    def sync(self) -> None:
        """Write every job's targets that changed since the last write."""
        with self._lock:
            for job, read in self.targets.items():
                now = sorted(read(), key=lambda t: t.address)
                if self._written.get(job) != now:
                    self.prometheus.set_targets(job, now)
                    self._written[job] = now

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sync()
            except Exception as error:  # noqa: BLE001 - a target read failed: the next round tries again
                self.errors.append(repr(error))
            self.stopping.wait(FOLLOW_INTERVAL_S)
