"""Scenario 9: the operator under faults, with load running through real engines.

Three autoscaled InferenceServices, each with real `kvpilot serve` engines behind its kwok pods
(PodRunner) and open-loop streamed load:

- `faults-scaled` (1..3 replicas, a TTFT SLO its engines cannot meet under load): scales up;
- `faults-hang` (2..3): one pod's /metrics answers a byte a second, for ever;
- `faults-nan` (2..3): one pod's /metrics reports NaN for its queue and KV usage.

The operator talks to the API server through a proxy (fault_proxy.py). Once `faults-scaled` has
scaled up, the proxy answers every request 500 or 429 for FAULT_S: for the first half the
operator's watches keep flowing, and someone deletes `faults-hang`'s Service (the operator sees it
and its reconcile fails: only a retry brings the Service back); then the watches are cut too, and
someone loosens `faults-scaled`'s SLO (seen only once the watches are back), which turns its load
into fewer streams, each as long as fits in half the engines' drain at their reported p95s (the
drain covers the plan's TPOT, not a 2-core machine's), that a scale-down meets in flight.

Afterwards: every InferenceService is reconciled to its rendered state (the operator's own
reconcile, run against the live objects, would write nothing), replicas never went outside
[min, max] (sampled, and every scale write the operator sent), no stream was cut by a scale-down
(every request that got a first token was served whole), and the autoscaler kept deciding for
`faults-scaled` every period (its status writes reach the proxy, answered or not) while the other
two services' pods were unknown. With KVPILOT_FAULTS_TIMELINE set, the run's timeline (periods,
decisions, faults) is written there as Markdown (bench/RESULTS.md, "Operator under faults").
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.conftest import AUTOSCALE_INTERVAL_S
from e2e.fault_proxy import ApiFaultProxy
from e2e.load import Load, Result
from e2e.local_engine import grace_period_s
from e2e.local_operator import LocalOperator
from e2e.metrics_stand_in import MetricsStandIn, Mode
from e2e.pod_runner import PodRunner
from e2e.polling import Background, poll
from kvpilot.operator.api.names import label_selector
from kvpilot.operator.controller.reconcile import reconcile
from kvpilot.operator.kube.cluster import gpu_nodes

MODEL = "SmolLM2-135M-Instruct"
PROMPT = (
    "Summarise the following notes for a colleague who missed the meeting. "
    + "The team reviewed the release plan, the open bugs, the test coverage and the rollout schedule. " * 6
)
SCALED, HANG, NAN = "faults-scaled", "faults-hang", "faults-nan"
BOUNDS = {SCALED: (1, 3), HANG: (2, 3), NAN: (2, 3)}
TIGHT_SLO = {"ttftP95Ms": 20, "tpotP95Ms": 200}  # not met under load by one thread's prefill
LOOSE_SLO = {"ttftP95Ms": 600000, "tpotP95Ms": 600000}  # met by anything these engines do
FAULT_S = 24.0
# The most time between two status writes of a service whose engines answer: a period is
# AUTOSCALE_INTERVAL_S, plus at most the 3 s read deadline (the NaN stand-in copies a busy engine's
# /metrics), plus room for a busy 2-core machine (up to 8.1 s measured beside a CPU burner). A
# period that waited on another service's hanging /metrics (a byte a second, never complete) would
# never end.
MAX_PERIOD_GAP_S = 20.0
TIMELINE_ENV = "KVPILOT_FAULTS_TIMELINE"


def spec(name: str) -> dict[str, Any]:
    body: dict[str, Any] = kvis.sample("smollm2-135m")["spec"]
    low, high = BOUNDS[name]
    body["slo"] = TIGHT_SLO if name == SCALED else LOOSE_SLO
    body["serving"] = {**body.get("serving", {}), "speculative": "ngram"}
    body["autoscaling"] = {
        "mode": "slo",
        "minReplicas": low,
        "maxReplicas": high,
        "maxStep": 1,
        "scaleDownStabilizationSeconds": 10,
    }
    return body


class LiveCluster:
    """The reconcile's Cluster over the live API server (as the test's admin), read-only: what the
    reconcile would write is recorded in `writes`, not written."""

    def __init__(self, k8s: Cluster) -> None:
        self.k8s = k8s
        self.writes: list[str] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        group = api_version.rpartition("/")[0]
        resource = f"{kind.lower()}.{group}" if group else kind.lower()
        found = self.k8s.kubectl("get", resource, name, "-n", namespace, "-o", "json", check=False)
        if found.returncode != 0:
            if "NotFound" in found.stderr:
                return None
            raise RuntimeError(found.stderr)
        obj: dict[str, Any] = json.loads(found.stdout)
        return obj

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(f"create {manifest['kind']} {manifest['metadata']['name']}")
        return manifest

    def update(self, manifest: dict[str, Any], resource_version: str) -> dict[str, Any]:
        self.writes.append(f"update {manifest['kind']} {manifest['metadata']['name']}")
        return manifest

    def patch_status(self, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("reconcile() does not write the status")

    def gpu_nodes(self) -> dict[str, int]:
        return gpu_nodes(self.k8s.kubectl_json("get", "nodes")["items"])

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.k8s.kubectl_json(
            "get", "pods", "-n", namespace, "-l", label_selector(labels)
        )["items"]
        return items


class Sampler(Background):
    """Once a second: each service's replicas (InferenceService and Deployment) and last decision,
    read as the test's admin (not through the proxy)."""

    def __init__(self, k8s: Cluster, namespace: str, start: float) -> None:
        super().__init__("fault-sampler")
        self.k8s, self.namespace, self.start = k8s, namespace, start
        self.samples: list[dict[str, Any]] = []

    def loop(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                items = self.k8s.kubectl_json("get", "inferenceservices,deployments", "-n", self.namespace)["items"]
            except Exception:  # noqa: BLE001 - a slow kubectl read skips one sample
                continue
            sample: dict[str, Any] = {"t": round(time.monotonic() - self.start, 1)}
            for obj in items:
                name = obj["metadata"]["name"]
                if name not in BOUNDS:
                    continue
                entry = sample.setdefault(name, {})
                if obj["kind"] == "Deployment":
                    entry["deployment"] = obj["spec"].get("replicas")
                else:
                    entry["replicas"] = obj["spec"].get("replicas")
                    entry["decision"] = obj.get("status", {}).get("autoscaler", {}).get("lastDecision", {})
            self.samples.append(sample)


class Period(NamedTuple):
    """One autoscaler status write as the proxy saw it."""

    at: float
    status: int  # the answer (500/429: the fault, 409: written from a stale view)
    decision: dict[str, Any]  # status.autoscaler.lastDecision
    unknown: list[str]  # status.autoscaler.unknownPods


def autoscaler_writes(proxy: ApiFaultProxy, name: str) -> list[Period]:
    """Every autoscaler status write for `name`. A write is a merge patch that leaves out what did
    not change since the status it was made from, so each is shown over the writes before it that
    the API server took."""
    path = f"/inferenceservices/{name}/status"
    writes: list[Period] = []
    taken: dict[str, Any] = {"lastDecision": {}, "unknownPods": []}
    for r in proxy.recorded():
        if r.method != "PATCH" or not r.path.split("?")[0].endswith(path) or not isinstance(r.body, dict):
            continue
        autoscaler = (r.body.get("status") or {}).get("autoscaler")
        if not isinstance(autoscaler, dict):
            continue
        decision = {**taken["lastDecision"], **(autoscaler.get("lastDecision") or {})}
        unknown = autoscaler.get("unknownPods", taken["unknownPods"])
        writes.append(Period(r.at, r.status, decision, unknown))
        if r.status == 200:
            taken = {"lastDecision": decision, "unknownPods": unknown}
    return writes


def scale_writes(proxy: ApiFaultProxy, name: str) -> list[tuple[float, int, int]]:
    """(arrival, answer status, replicas) of every scale-subresource write for `name`."""
    path = f"/inferenceservices/{name}/scale"
    return [
        (r.at, r.status, int(r.body["spec"]["replicas"]))
        for r in proxy.recorded()
        if r.method == "PATCH" and r.path.split("?")[0].endswith(path) and isinstance(r.body, dict)
    ]


def stream_tokens(drain_s: float, service: Mapping[str, Any]) -> int:
    """Tokens per stream (at most 64) such that a stream takes at most half the engines' drain at
    the p95 TTFT and TPOT they reported so far: a stream in flight when its engine drains can finish
    within the drain. The drain covers the plan's TPOT (an L4's), which the engines here, several
    on two cores, miss by 100x: 64 tokens took 18 s of a 10 s drain in a CI run (one stream cut)."""
    latency = service["status"]["latency"]
    budget_ms = drain_s * 1000 / 2 - latency["ttftP95Ms"]
    return max(1, min(64, int(budget_ms / latency["tpotP95Ms"])))


def cut_streams(results: list[Result]) -> list[Result]:
    """Streams that began (a first token) and were not served whole."""
    return [r for r in results if r.ttft_s is not None and r.finish_reason != "length"]


@pytest.fixture()
def proxied_operator(k8s: Cluster, operator: LocalOperator) -> Iterator[ApiFaultProxy]:
    """The session's operator, restarted to talk to the API server through an ApiFaultProxy;
    restarted back to the API server itself afterwards."""
    admin = k8s.kubectl_json("config", "view", "--raw", "--minify", "--flatten")["clusters"][0]["cluster"]
    with ApiFaultProxy(admin["server"], admin["certificate-authority-data"]) as proxy:
        operator.stop()
        operator.api_server = proxy.url
        operator.start()
        try:
            yield proxy
        finally:
            proxy.recover()
            operator.stop()
            operator.api_server = None
            operator.start()


@pytest.fixture()
def services(
    k8s: Cluster,
    kvpilot: Installation,
    proxied_operator: ApiFaultProxy,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
    tmp_path: Path,
) -> Iterator[dict[str, PodRunner]]:
    namespace = kvpilot.watch_namespaces[0]
    for name in BOUNDS:
        apply_isvc(name, spec(name))
    for name in BOUNDS:
        kvis.wait_condition(k8s, namespace, name, "Ready", "True", timeout_s=90)
    runners = {name: PodRunner(k8s, namespace, name, tmp_path / name) for name in BOUNDS}
    for name, runner in runners.items():
        (tmp_path / name).mkdir()
        runner.__enter__()
    try:
        poll(
            lambda: all(len(runners[n].serving()) == BOUNDS[n][0] for n in BOUNDS) or None,
            240,
            "engines for every service's first pods",
            interval_s=1.0,
        )
        yield runners
    finally:
        for runner in runners.values():
            runner.__exit__()
    for name, runner in runners.items():
        assert not runner.errors, (name, runner.snapshot())


def test_faults_leave_every_service_reconciled_bounded_and_its_streams_whole(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    proxied_operator: ApiFaultProxy,
    services: dict[str, PodRunner],
    tmp_path: Path,
) -> None:
    namespace, proxy, runners = kvpilot.watch_namespaces[0], proxied_operator, services
    start = time.monotonic()
    faults: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        faults.append((time.monotonic(), what))

    # One pod of each faulty service gets a stand-in for its engine, on the engine's own address.
    stand_ins: list[MetricsStandIn] = []
    broken: dict[str, str] = {}
    for name, mode in ((HANG, "hang"), (NAN, "nan")):
        pod = min(runners[name].serving())
        url = runners[name].engines()[pod].url
        runners[name].break_engine(pod)
        sibling = next(iter(runners[name].serving().values()))
        stand_ins.append(
            poll(lambda u=url, m=mode, s=sibling: _serve(u, m, s), 30, f"the {mode} stand-in on {url}")  # type: ignore[misc]
        )
        broken[name] = pod
        mark(f"{name}: pod {pod}'s /metrics {'hangs (a byte a second)' if mode == 'hang' else 'reports NaN'}")

    loads = {
        name: Load(
            lambda n=name: list(runners[n].serving().values()),  # type: ignore[misc]
            MODEL,
            rate=rate,
            prompt=PROMPT,
            max_tokens=16,
            api_key=kvis.api_key(k8s, namespace, name),
        )
        for name, rate in ((SCALED, 2.5), (HANG, 0.5), (NAN, 0.5))
    }
    sampler = Sampler(k8s, namespace, start)
    try:
        with sampler, loads[SCALED], loads[HANG], loads[NAN]:
            mark("load: 2.5 req/s on faults-scaled, 0.5 req/s on each of the others")
            poll(lambda: _replicas(k8s, namespace, SCALED) >= 2 or None, 240, "faults-scaled scaled up", interval_s=1.0)
            mark("faults-scaled scaled up")

            # First the watches keep flowing: the operator sees the deletion at once, and every
            # request of the reconcile it starts fails.
            proxy.fail(cut_streams=False)
            mark("API fault: every new request answered 500 or 429, the operator's watches kept")
            k8s.kubectl("delete", "service", HANG, "-n", namespace)
            mark("faults-hang's Service deleted by hand")
            time.sleep(FAULT_S / 2)
            proxy.fail(cut_streams=True)
            mark("API outage: the operator's watches cut too")
            kvis.patch_spec(k8s, namespace, SCALED, {"slo": LOOSE_SLO})
            mark("faults-scaled's SLO loosened")
            # Fewer streams, each as long as the drain allows: a scale-down now meets some in flight.
            drain_s = grace_period_s(k8s.kubectl_json("get", "deployment", SCALED, "-n", namespace))
            tokens = stream_tokens(drain_s, kvis.get(k8s, namespace, SCALED))
            loads[SCALED].max_tokens, loads[SCALED].rate = tokens, 1.0
            mark(f"load on faults-scaled: 1 req/s of {tokens}-token streams")
            time.sleep(FAULT_S / 2)
            proxy.recover()
            mark("API fault over")

            poll(lambda: _all_reconciled(k8s, namespace) or None, 120, "every service reconciled", interval_s=1.0)
            mark("every service's generation observed, faults-hang's Service back")
            poll(
                lambda: _replicas(k8s, namespace, SCALED) == BOUNDS[SCALED][0] or None,
                240,
                "faults-scaled scaled down to its minimum",
                interval_s=1.0,
            )
            mark("faults-scaled at minReplicas")
            time.sleep(3 * AUTOSCALE_INTERVAL_S)  # periods after the last change, for the record
            # While the faulty pods still misbehave: what the status says of them.
            unknown = {
                n: kvis.get(k8s, namespace, n)["status"].get("autoscaler", {}).get("unknownPods", [])
                for n in (HANG, NAN)
            }
            end = time.monotonic()
            mark("load stopped")
    finally:
        for stand_in in stand_ins:
            stand_in.__exit__()
        timeline = _timeline(proxy, sampler, faults, loads, start, drains(tmp_path))
        (tmp_path / "timeline.md").write_text(timeline)
        proxy.dump(tmp_path / "api-requests.jsonl", since=start)
        if os.environ.get(TIMELINE_ENV):
            Path(os.environ[TIMELINE_ENV]).write_text(timeline)

    # Reconciled to the rendered state: the operator's reconcile over the live objects writes nothing.
    for name in BOUNDS:
        body = kvis.get(k8s, namespace, name)
        assert body["status"]["observedGeneration"] == body["metadata"]["generation"], (name, body["status"])
        live = LiveCluster(k8s)
        # With the operator's namespace, as the chart's downward API gives it (the NetworkPolicy names it).
        reconcile(body, live, datetime.now(UTC), operator_namespace=kvpilot.namespace)
        assert not live.writes, (name, live.writes)

    # Replicas within [min, max], as sampled and in every write the operator sent.
    for name, (low, high) in BOUNDS.items():
        seen = [
            s[name][k]
            for s in sampler.samples
            if name in s
            for k in ("replicas", "deployment")
            if s[name].get(k) is not None
        ]
        written = [replicas for _, _, replicas in scale_writes(proxy, name)]
        assert seen and all(low <= r <= high for r in seen + written), (name, seen, written)
    ups = [r for _, status, r in scale_writes(proxy, SCALED) if status == 200]
    assert max(ups) >= 2 and ups[-1] == BOUNDS[SCALED][0], ups  # up under load, down after the loosening

    # No stream cut: every request that got a first token was served whole, on every service.
    for name, load in loads.items():
        cut = cut_streams(load.results)
        assert not cut, (name, cut[:5])
        assert len([r for r in load.results if r.finish_reason == "length"]) >= 5, (name, len(load.results))

    # The autoscaler decided for the services whose engines answer every period, through all of it
    # (the API fault included), whatever the hanging pod of faults-hang did.
    for name in (SCALED, NAN):
        times = [w.at for w in autoscaler_writes(proxy, name) if start <= w.at <= end]
        gap = max((b - a for a, b in zip(times, times[1:], strict=False)), default=math.inf)
        assert len(times) >= 10 and gap <= MAX_PERIOD_GAP_S, (name, gap, len(times))
    during = [w.status for w in autoscaler_writes(proxy, SCALED) if _in_fault(w.at, faults)]
    assert during and all(s in (500, 429) for s in during), during

    # The faulty pods are unknown, and named so in the status (a real engine too slow to answer
    # within the read deadline on a busy machine may be named beside them).
    assert all(broken[name] in unknown[name] for name in (HANG, NAN)), (unknown, broken)
    log = operator.log()
    # The deletion reached the operator during the fault, its reconcile failed and was retried.
    assert f"reconcile of {namespace}/{HANG} failed, again in" in log, log[-3000:]
    assert re.search(rf"pod {broken[HANG]} is unknown: no complete answer within", log), log[-3000:]
    assert re.search(rf"pod {broken[NAN]} is unknown: .*not finite", log), log[-3000:]
    assert all(s.served >= 3 for s in stand_ins), [s.served for s in stand_ins]


def _serve(url: str, mode: Mode, sibling: str) -> MetricsStandIn | None:
    """A stand-in serving on `url`, or None while the address is still taken (by the stopped engine)."""
    try:
        return MetricsStandIn(url, mode, sibling).__enter__()
    except OSError:
        return None


def _replicas(k8s: Cluster, namespace: str, name: str) -> int:
    return int(k8s.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"])


def _all_reconciled(k8s: Cluster, namespace: str) -> bool:
    for name in BOUNDS:
        body = kvis.get(k8s, namespace, name)
        if body.get("status", {}).get("observedGeneration") != body["metadata"]["generation"]:
            return False
    return bool(k8s.kubectl("get", "service", HANG, "-n", namespace, check=False).returncode == 0)


def _in_fault(at: float, faults: list[tuple[float, str]]) -> bool:
    began = next(t for t, what in faults if what.startswith("API fault:"))
    ended = next(t for t, what in faults if what == "API fault over")
    return began + 0.5 <= at <= ended - 0.5


def drains(log_dir: Path) -> list[str]:
    """`pod: N in flight` for each engine that drained with streams in flight (engine logs)."""
    found = []
    for log in sorted(log_dir.glob("*/engine-*.log")):
        for match in re.finditer(r"event=drain_start in_flight=(\d+)", log.read_text(errors="replace")):
            if int(match[1]):
                found.append(f"{log.stem.removeprefix('engine-')}: {match[1]} in flight")
    return found


def _timeline(
    proxy: ApiFaultProxy,
    sampler: Sampler,
    faults: list[tuple[float, str]],
    loads: dict[str, Load],
    start: float,
    drained: list[str],
) -> str:
    """The run as Markdown: the faults, each service's periods (by phase) and the changes of its
    decisions, the streams."""
    began = next(t for t, what in faults if what.startswith("API fault:"))
    ended = next((t for t, what in faults if what == "API fault over"), math.inf)
    lines = ["| t (s) | event |", "| ---: | --- |"]
    lines += [f"| {at - start:.1f} | {what} |" for at, what in faults]
    lines += [
        "",
        "| service [min, max] | periods before / during / after the API fault | answers | longest gap (s) |",
        "| --- | ---: | --- | ---: |",
    ]
    for name, (low, high) in BOUNDS.items():
        writes = [w for w in autoscaler_writes(proxy, name) if w.at >= start]
        phases = [
            sum(1 for w in writes if w.at < began),
            sum(1 for w in writes if began <= w.at <= ended),
            sum(1 for w in writes if w.at > ended),
        ]
        answers = ", ".join(
            f"{s}: {sum(1 for w in writes if w.status == s)}" for s in sorted({w.status for w in writes})
        )
        gap = max((b.at - a.at for a, b in zip(writes, writes[1:], strict=False)), default=0.0)
        lines.append(f"| `{name}` [{low}, {high}] | {' / '.join(map(str, phases))} | {answers} | {gap:.1f} |")
    for name in BOUNDS:
        lines += ["", f"`{name}`, each change of decision or answer:", ""]
        lines += [
            "| t (s) | answer | decision | replicas | unknown pods | reason |",
            "| ---: | ---: | --- | ---: | --- | --- |",
        ]
        shown = None
        for w in autoscaler_writes(proxy, name):
            if w.at < start:
                continue
            reason = w.decision.get("reason", "")
            key = (w.status, w.decision.get("action"), w.decision.get("replicas"), reason.split(":")[0], w.unknown)
            if key == shown:
                continue  # the same decision as the period before, with other numbers
            shown = key
            action, replicas = w.decision.get("action"), w.decision.get("replicas")
            pods = ", ".join(p.rsplit("-", 1)[-1] for p in w.unknown) or "-"
            lines.append(f"| {w.at - start:.1f} | {w.status} | {action} | {replicas} | {pods} | {reason[:110]} |")
    lines += ["", "| service | requests | served whole | refused | cut |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, load in loads.items():
        whole = sum(1 for r in load.results if r.finish_reason == "length")
        refused = sum(1 for r in load.results if r.ttft_s is None and r.error is not None)
        lines.append(f"| {name} | {len(load.results)} | {whole} | {refused} | {len(cut_streams(load.results))} |")
    lines.append(f"\nEngines that drained with streams in flight (scale-down): {'; '.join(drained) or 'none'}")
    lines.append(f"\nReplicas samples: {len(sampler.samples)}; operator streams cut when the fault began: {proxy.cut}")
    return "\n".join(lines) + "\n"
