"""Scenario 8: the SLO autoscaler on real engines behind real pods.

The chart's operator runs with a 2 s autoscaler period (conftest; the window is 4 periods). A
`PodRunner` starts a real `kvpilot serve` for every Running pod of the service's Deployment and
stops it when the pod goes away, so replicas the autoscaler writes become engines that serve and
report /metrics; a bounded open-loop `Load` on loopback sends streamed completions round-robin to
the engines that are up.

The SLO is set where these engines cannot meet it under load (a ~150-token prompt's prefill on one
thread takes longer than the 20 ms TTFT SLO), and are never asked to without load (no request, no
TTFT observation): load over the SLO must add replicas, and its end must take them away, on any
machine speed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.conftest import AUTOSCALE_INTERVAL_S
from e2e.load import Load, p95
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.pod_runner import PodRunner
from e2e.polling import Background, poll
from kvpilot.operator.autoscaling.decisions import WINDOW_PERIODS

MODEL = "SmolLM2-135M-Instruct"
SLO_TTFT_MS = 20
PROMPT = (
    "Summarise the following notes for a colleague who missed the meeting. "
    + "The team reviewed the release plan, the open bugs, the test coverage and the rollout schedule. " * 6
)
WINDOW_S = WINDOW_PERIODS * AUTOSCALE_INTERVAL_S
# A woken engine's injected load time (the wake scenario): longer than its scale-down window.
SLOW_START_S = 40.0
# Where to also write the scale-up/scale-down cycle's timeline (bench/autoscale_plot.py plots it).
TIMELINE_ENV = "KVPILOT_AUTOSCALE_TIMELINE"


def autoscaled_spec(mode: str, min_replicas: int) -> dict[str, Any]:
    spec: dict[str, Any] = kvis.sample("smollm2-135m")["spec"]
    spec["slo"] = {"ttftP95Ms": SLO_TTFT_MS, "tpotP95Ms": 200}
    # n-gram drafts over the load's repetitive prompt: the engines report draft counters too.
    spec["serving"] = {**spec.get("serving", {}), "speculative": "ngram"}
    spec["autoscaling"] = {
        "mode": mode,
        "minReplicas": min_replicas,
        "maxReplicas": 4,
        "maxStep": 1,
        # A service that may reach zero waits longer: kwok's pod is Ready at once while its engine
        # loads (15-20 s on a busy 2-core machine), so a 10 s window counted from readiness could
        # take it to 0 before the test's first request arrives.
        "scaleDownStabilizationSeconds": 30 if min_replicas == 0 else 10,
    }
    return spec


def replicas(k8s: Cluster, namespace: str, name: str) -> int:
    return int(k8s.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"])


class ReplicaSampler(Background):
    """The Deployment's replicas, read once a second for the length of its block."""

    def __init__(self, k8s: Cluster, namespace: str, name: str) -> None:
        super().__init__("replica-sampler")
        self.k8s, self.namespace, self.name = k8s, namespace, name
        self.counts: list[int] = []

    def loop(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                self.counts.append(replicas(self.k8s, self.namespace, self.name))
            except Exception:  # noqa: BLE001 - a slow kubectl read skips one sample
                continue


class Timeline(Background):
    """One sample a second of load, replicas, engines up and p95 TTFT (the clients' over the last
    window, and the operator's from its status), for the failure messages and the bench plot."""

    def __init__(self, k8s: Cluster, namespace: str, name: str, runner: PodRunner, load: Load) -> None:
        super().__init__("timeline")
        self.k8s, self.namespace, self.name, self.runner, self.load = k8s, namespace, name, runner, load
        self.start = time.monotonic()
        self.samples: list[dict[str, Any]] = []

    def loop(self) -> None:
        while not self.stopping.wait(1.0):
            now = time.monotonic()
            try:
                status = kvis.get(self.k8s, self.namespace, self.name).get("status", {})
                wanted = replicas(self.k8s, self.namespace, self.name)
            except Exception:  # noqa: BLE001 - a slow kubectl read skips one sample
                continue
            recent = [r.ttft_s for r in self.load.since(now - WINDOW_S) if r.ttft_s is not None]
            client_p95 = p95(recent)
            self.samples.append(
                {
                    "t": round(now - self.start, 2),
                    "rate": self.load.rate,
                    "replicas": wanted,
                    "engines": len(self.runner.serving()),
                    "clientTtftP95Ms": None if client_p95 is None else round(client_p95 * 1000, 1),
                    "operatorTtftP95Ms": status.get("latency", {}).get("ttftP95Ms"),
                    "decision": status.get("autoscaler", {}).get("lastDecision", {}).get("action"),
                }
            )

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {"intervalSeconds": AUTOSCALE_INTERVAL_S, "windowSeconds": WINDOW_S, "samples": self.samples}, indent=1
            )
        )


@pytest.fixture()
def service(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: Callable[[str, dict[str, Any]], dict[str, Any]],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> Iterator[tuple[str, str, PodRunner]]:
    name, mode, min_replicas = request.param
    namespace = kvpilot.watch_namespaces[0]
    apply_isvc(name, autoscaled_spec(mode, min_replicas))
    kvis.wait_condition(k8s, namespace, name, "Ready", "True", timeout_s=60)
    with PodRunner(k8s, namespace, name, tmp_path) as runner:
        poll(
            lambda: len(runner.serving()) == max(min_replicas, 1) or None,
            180,
            f"engines for {name}'s first pods",
            interval_s=1.0,
        )
        yield namespace, name, runner
        assert not runner.errors, runner.snapshot()


@pytest.mark.parametrize("service", [("scaled-slo", "slo", 2)], indirect=True)
def test_load_over_the_slo_adds_engines_and_its_end_removes_them(
    k8s: Cluster, service: tuple[str, str, PodRunner], tmp_path: Path
) -> None:
    namespace, name, runner = service
    # One pod's engine stops answering before the load (its pod stays Running and Ready): it is
    # unknown to the autoscaler, which must scale on what the other pods report.
    broken = min(runner.serving())
    runner.break_engine(broken)
    key = kvis.api_key(k8s, namespace, name)
    load = Load(lambda: list(runner.serving().values()), MODEL, rate=4.0, prompt=PROMPT, max_tokens=16, api_key=key)
    with load, Timeline(k8s, namespace, name, runner, load) as timeline:
        try:
            # Over the SLO: 2 -> 3 -> 4, one step at a time; each new pod gets a real engine that
            # takes a share of the load.
            poll(lambda: replicas(k8s, namespace, name) == 4 or None, 240, "a scale-up to 4", interval_s=1.0)
            poll(lambda: len(runner.serving()) == 3 or None, 180, "engines for the new pods", interval_s=1.0)
            poll(
                lambda: len({r.target for r in load.since(0) if r.error is None}) == 3 or None,
                60,
                "requests answered by three engines",
            )
            time.sleep(WINDOW_S)  # a window at four replicas, for the record

            # No load: after the stabilization window, back to minReplicas one step at a time, and
            # the engines of the removed pods are stopped.
            load.rate = 0
            poll(lambda: replicas(k8s, namespace, name) == 2 or None, 180, "the scale-down to 2", interval_s=1.0)
            poll(lambda: len(kvis.running_pods(k8s, namespace, name)) == 2 or None, 60, "two pods left")
            time.sleep(3 * runner.poll_s)
        finally:
            timeline.dump(tmp_path / "timeline.json")
            if os.environ.get(TIMELINE_ENV):
                timeline.dump(Path(os.environ[TIMELINE_ENV]))
    messages: dict[str, list[str]] = {}
    for e in kvis.events(k8s, namespace, name):
        messages.setdefault(e["reason"], []).append(e["message"])
    ups, downs = messages.get("ScaledUp", []), messages.get("ScaledDown", [])
    # Joined, not repr'd: pytest cuts a long repr in its middle, where the telling part is.
    assert [m for m in ups if "2 -> 3" in m] and [m for m in ups if "3 -> 4" in m], "\n".join(ups)
    assert all("unknown: " in m and broken in m for m in ups), f"{broken} not in:\n" + "\n".join(ups)
    assert [m for m in downs if "4 -> 3" in m] and [m for m in downs if "3 -> 2" in m], "\n".join(downs)
    left = {p["metadata"]["name"] for p in kvis.running_pods(k8s, namespace, name)}
    status = kvis.get(k8s, namespace, name)["status"]
    assert status["autoscaler"]["unknownPods"] == sorted(left & {broken})  # unless its pod was removed
    assert status["latency"]["source"] == "observed" and status["latency"]["ttftP95Ms"] > SLO_TTFT_MS

    assert runner.stopped >= 2  # the broken one and at least one removed pod's (the other may be the broken pod)
    assert set(runner.engines()) == left - {broken}, runner.snapshot()
    # No oscillation: the replicas the timeline sampled rise to 4 and fall back to 2, never turning
    # back (the events above show each step; a sample may fall between two quick ones).
    sequence = [s["replicas"] for s in timeline.samples]
    changes = [n for i, n in enumerate(sequence) if i == 0 or n != sequence[i - 1]]
    peak = changes.index(4) if 4 in changes else len(changes)
    rising, falling = changes[: peak + 1], changes[peak:]
    assert changes[0] == 2 and changes[-1] == 2 and max(changes) == 4, sequence
    assert rising == sorted(set(rising)) and falling == sorted(set(falling), reverse=True), sequence
    ok = [r for r in load.results if r.error is None]
    assert len(ok) >= 40, (len(load.results), load.shed, [r.error for r in load.results if r.error][:5])


@pytest.mark.parametrize("service", [("scaled-external", "external", 1)], indirect=True)
def test_external_mode_reports_the_signals_and_never_writes_replicas(
    k8s: Cluster, service: tuple[str, str, PodRunner]
) -> None:
    namespace, name, runner = service
    key = kvis.api_key(k8s, namespace, name)
    with Load(lambda: list(runner.serving().values()), MODEL, rate=4.0, prompt=PROMPT, max_tokens=16, api_key=key):
        poll(
            lambda: (
                kvis.get(k8s, namespace, name).get("status", {}).get("latency", {}).get("source") == "observed" or None
            ),
            120,
            "observed latency in the status",
            interval_s=1.0,
        )
        time.sleep(3 * WINDOW_S)  # over the SLO for several windows
    status = kvis.get(k8s, namespace, name)["status"]
    assert status["latency"]["ttftP95Ms"] > SLO_TTFT_MS, status["latency"]
    # The engines' measured draft acceptance, beside the plan's assumed one.
    assert 0 <= status["latency"]["draftAcceptance"] <= 1 and status["plan"]["assumedDraftAcceptance"] == 0.29
    decision = status["autoscaler"]["lastDecision"]
    assert decision["action"] == "hold" and "autoscaling.mode is external" in decision["reason"], decision
    assert replicas(k8s, namespace, name) == 1
    assert not [e for e in kvis.events(k8s, namespace, name) if e["reason"] in ("ScaledUp", "ScaledDown")]


@pytest.mark.parametrize("service", [("scaled-zero", "slo", 0)], indirect=True)
def test_an_idle_service_scales_to_zero_and_the_gateway_holds_the_next_request(
    k8s: Cluster, operator: LocalOperator, gateway: LocalGateway, service: tuple[str, str, PodRunner]
) -> None:
    namespace, name, runner = service
    # The operator made the service's API key: the engines require it and the gateway checks it.
    client = openai.OpenAI(
        base_url=gateway.base_url(namespace),
        api_key=kvis.api_key(k8s, namespace, name),
        timeout=300,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )
    anonymous = client.with_options(api_key="not-the-key")
    assert MODEL in [m.id for m in client.models.list()]
    first = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert first.choices[0].text

    # Idle for the stabilization window: 1 -> 0, and the pod and its engine go.
    poll(lambda: replicas(k8s, namespace, name) == 0 or None, 120, "the scale-down to 0", interval_s=1.0)
    poll(
        lambda: not kvis.running_pods(k8s, namespace, name) and not runner.engines() or None,
        60,
        "no pod and no engine left",
        interval_s=1.0,
    )

    # A request without the key is refused at once and wakes nothing.
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    time.sleep(2)
    assert replicas(k8s, namespace, name) == 0

    # The next request is held by the gateway, which scales to 1; it is answered once the new
    # pod's engine has loaded the model. That engine loads slowly (it starts SLOW_START_S after
    # its pod runs, longer than the 30 s scale-down window): it is not scaled back to zero while
    # the request waits, and its startup probe's budget covers the delay.
    pod_spec = k8s.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["template"]["spec"]
    probe = pod_spec["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > SLOW_START_S + 20, probe
    runner.start_delay_s = SLOW_START_S
    started = time.monotonic()
    with ReplicaSampler(k8s, namespace, name) as sampled:
        woken = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
    held_s = time.monotonic() - started
    assert woken.choices[0].message.content
    assert held_s > SLOW_START_S, held_s
    # Once woken, never back to 0 while the request waited.
    woken_at = sampled.counts.index(1) if 1 in sampled.counts else len(sampled.counts)
    assert sampled.counts[woken_at:] and 0 not in sampled.counts[woken_at:], sampled.counts
    # The gateway probes the new pod's /ready itself and may forward before the runner's next poll
    # marks that engine ready: count the engines started, not the ones seen ready.
    assert replicas(k8s, namespace, name) == 1 and len(runner.engines()) == 1, runner.snapshot()
    reasons = [(e["reason"], e["message"]) for e in kvis.events(k8s, namespace, name)]
    assert any(r == "ScaledDown" and "1 -> 0" in m for r, m in reasons), reasons
    assert any(r == "ScaledUp" and "a request arrived at 0 replicas: 0 -> 1" in m for r, m in reasons), reasons
