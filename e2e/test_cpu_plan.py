"""A CPU InferenceService planned from this machine's own device profile, measured at the start of
the module (`kvpilot profile`, one thread, as the pod runner runs every engine), never hard-coded.

The profile goes where an admin puts one: a ConfigMap in the operator's namespace, named by
`accelerator.profile`. Real engines serve the pods with the rendered arguments (the plan's batch
cap, KV pool, device), a bounded load arrives at the rate the spec plans for, and the operator's
autoscaler (`external`: it measures and reports, never scales) puts the engines' p95 TTFT and
TPOT beside the plan's predictions in status.planAccuracy:

- planned from the measured profile, the prediction holds: PlanAccurate True, every ratio inside
  the band; likewise for one prompt shared by every request, its prefix share declared
  (load.prefixShare: the plan's prefill is the part the prefix cache leaves), with the engines'
  observed share beside it;
- planned from a deliberately wrong profile, the same machine's as if it were 4x as fast in every
  figure (bandwidth, matmul rates, the engine's steps), the engines are slower than predicted:
  PlanAccurate False with the numbers, and (`slo` mode, where the operator owns the replicas) the
  plan re-planned with the observed factors: status.correction and more replicas. Bandwidth alone
  x4 would not do here: the embedded model's step on this CPU is mostly the engine's own per-step
  work, so it moves the prediction by less than the band's factor of two.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.load import Load
from e2e.local_engine import kvpilot_executable
from e2e.local_operator import LocalOperator
from e2e.pod_runner import PodRunner
from e2e.polling import poll
from kvpilot.engine.contract.device_profile import DeviceProfile, load_device_profile
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.autoscaling.accuracy import BAND
from kvpilot.operator.planning.cpus import PROFILE_CONFIGMAP_KEY
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.operator.planning.profiles import faster

MODEL = "SmolLM2-135M-Instruct"
MEASURED, WRONG = "e2e-measured", "e2e-four-times-faster"
HEAD = "Summarise the following notes for the weekly report. "
SENTENCE = "The team shipped the release and fixed bugs. "
# One prompt for every request (HEAD + 5 sentences, 57 tokens): the prefix cache serves its 3 full
# 16-token blocks, 48 of 57 tokens, to every request after the first.
SHARED_PROMPT = HEAD + SENTENCE * 5
SHARED_PREFIX = 0.84
OUTPUT = 16
# The measured services' SLO: loose, so that the plan's fit turns on the load (Workload), not on it.
TTFT_SLO_MS, TPOT_SLO_MS = 2000, 500


@dataclass(frozen=True)
class Workload:
    """Requests at `rate` per second, each a prompt of HEAD and `sentences` SENTENCEs that opens with
    its own number ("Request 12. ": `prompt_tokens` in all) and generates OUTPUT tokens. The rate keeps
    a window of >= 20 requests (the autoscaler's minimum to judge a p95) every 8 s."""

    rate: float
    sentences: int
    prompt_tokens: int

    @property
    def prompt(self) -> str:
        return HEAD + SENTENCE * self.sentences


# Heaviest first; the module serves the first that one engine meets by the measured profile's plan.
# A Zen 5 thread (bf16) serves the first; an AVX2-only Zen 3 thread (fp32, 2.3x slower a prefill
# token) would need 1.2x itself for the first's prefills alone, and serves the second. A CI machine
# measured slower still (its plan kept 59 sequences running at 3 req/s where 49 fit) gets the third:
# 2.5 req/s is the least that fills the autoscaler's 20-request window every 8 s.
WORKLOADS = (
    Workload(rate=4.0, sentences=5, prompt_tokens=62),
    Workload(rate=3.0, sentences=0, prompt_tokens=17),
    Workload(rate=2.5, sentences=0, prompt_tokens=17),
)
VERDICT_WITHIN_S = 150.0


def plan_of(spec: dict[str, Any], measured: DeviceProfile) -> Plan:
    """The plan the operator makes of `spec`, with the profiles this module put in ConfigMaps."""
    profiles = {MEASURED: measured, WRONG: faster(measured, WRONG, 4)}
    return plan(InferenceServiceSpec.model_validate(spec), PlanContext(device_profiles=profiles))


def _configmap(name: str, namespace: str, profile: DeviceProfile) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {PROFILE_CONFIGMAP_KEY: profile.to_json()},
    }


@pytest.fixture(scope="module")
def measured(k8s: Cluster, kvpilot: Installation, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceProfile]:
    """This machine's profile, measured now with one thread, and a wrong one, as ConfigMaps."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [kvpilot_executable(), "profile", "--output", str(out), "--name", MEASURED],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    profile = load_device_profile(out)
    assert profile.threads == 1 and profile.engine is not None, profile
    for cm in (profile, faster(profile, WRONG, 4)):
        k8s.apply(_configmap(cm.name, kvpilot.namespace, cm))
    yield profile
    for name in (MEASURED, WRONG):
        k8s.kubectl("delete", "configmap", name, "-n", kvpilot.namespace, "--ignore-not-found")


@pytest.fixture(scope="module")
def workload(measured: DeviceProfile) -> Workload:
    """The heaviest of WORKLOADS that one engine of this machine serves within the SLO, by the plan
    from its measured profile: a fixed load overran the slower CPUs (never a verdict in 150 s)."""
    plans = [(w, plan_of(_spec(MEASURED, TPOT_SLO_MS, 1, w), measured)) for w in WORKLOADS]
    fitting = [w for w, p in plans if p.meets_slo]
    assert fitting, [p.reasons.get("replicas") for _, p in plans]
    return fitting[0]


def _spec(
    profile: str, tpot_slo_ms: float, max_replicas: int, workload: Workload, mode: str = "external"
) -> dict[str, Any]:
    return {
        "model": {"name": MODEL},
        "accelerator": {"type": "cpu", "profile": profile},
        "serving": {"maxContextLength": 2048, "quantization": "none", "speculative": "off"},
        "slo": {"ttftP95Ms": TTFT_SLO_MS, "tpotP95Ms": tpot_slo_ms},
        "load": {
            "requestsPerSecond": workload.rate,
            "meanPromptTokens": workload.prompt_tokens,
            "meanOutputTokens": OUTPUT,
        },
        "autoscaling": {"mode": mode, "minReplicas": 1, "maxReplicas": max_replicas},
    }


def _verdict(
    k8s: Cluster, namespace: str, name: str, want: str, corrected: bool
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    obj = kvis.get(k8s, namespace, name)
    condition = kvis.condition(obj, "PlanAccurate")
    if condition.get("status") != want or corrected != ("correction" in obj["status"]):
        return None
    if not all(signal in obj["status"].get("planAccuracy", {}) for signal in ("ttft", "tpot")):
        return None  # a window that compared only one of them (too few TPOT reports, say)
    return obj["status"], condition


def _serve_until(
    k8s: Cluster,
    kvpilot: Installation,
    name: str,
    spec: dict[str, Any],
    want: str,
    tmp: Path,
    workload: Workload,
    unique_prompts: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply a service of `spec`, serve it with real engines under the planned load until
    PlanAccurate is `want` (False: with the correction re-planned from it); its status and that
    condition. `unique_prompts`: `workload`'s prompts, each opening with its own number (no shared
    prefix), else every request sends SHARED_PROMPT; at `workload`'s rate either way."""
    namespace = kvpilot.watch_namespaces[0]
    profile = spec["accelerator"]["profile"]
    k8s.apply(kvis.manifest(name, namespace, spec))
    try:
        obj = kvis.wait_condition(k8s, namespace, name, "Ready", "True", timeout_s=60)
        plan = obj["status"]["plan"]
        assert (plan["gpu"], plan["deviceProfile"], plan["cpus"]) == ("cpu", profile, 1), plan
        key = kvis.api_key(k8s, namespace, name)
        with PodRunner(k8s, namespace, name, tmp) as runner:
            poll(lambda: runner.serving() or None, 180, f"an engine for {name}'s pod", interval_s=1.0)
            targets = lambda: list(runner.serving().values())  # noqa: E731
            # Without a shared prefix the planner predicts every prompt token's prefill (load.prefixShare
            # 0); one prompt for all without declaring its share, the engines beat the prediction by
            # 2.5x: TTFT p95 130 vs 326 ms.
            load = Load(
                targets,
                MODEL,
                rate=workload.rate,
                prompt=workload.prompt if unique_prompts else SHARED_PROMPT,
                max_tokens=OUTPUT,
                api_key=key,
                unique_prompts=unique_prompts,
            )
            with load:
                try:
                    found = poll(
                        lambda: _verdict(k8s, namespace, name, want, corrected=want == "False"),
                        VERDICT_WITHIN_S,
                        f"PlanAccurate {want}",
                    )
                except TimeoutError as timeout:
                    # The numbers the verdict was waiting on, so that a miss says by how much.
                    status = kvis.get(k8s, namespace, name)["status"]
                    condition = kvis.condition({"status": status}, "PlanAccurate")
                    raise AssertionError(
                        f"{timeout}; PlanAccurate {condition}; planAccuracy {json.dumps(status.get('planAccuracy'))}; "
                        f"correction {json.dumps(status.get('correction'))}"
                    ) from timeout
            # The load goes to the engines directly: under `slo` the re-plan rolls the Deployment out
            # and the autoscaler scales it, and an engine whose pod is going away answers a request
            # that reached it while it drained with a 503 that names itself shutting down (the
            # gateway would retry it elsewhere).
            failed = [r.error for r in load.results if r.error]
            draining = [e for e in failed if "shutting down" in e]
            errors = [e for e in failed if "shutting down" not in e]
            assert not errors, errors[:5]
            assert not runner.errors, runner.snapshot()
        print(f"{name}: planAccuracy {json.dumps(found[0]['planAccuracy'])}; {len(draining)} answered draining")
        return found
    finally:
        k8s.kubectl("delete", "inferenceservice", name, "-n", namespace, "--ignore-not-found", "--wait=false")
        # The next module starts on a namespace without this service's pods and ReplicaSets.
        poll(lambda: kvis.children(k8s, namespace, name) == [], 60, f"{name}'s children garbage-collected")


def test_a_cpu_plan_from_the_measured_profile_predicts_what_real_engines_do(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    measured: DeviceProfile,
    workload: Workload,
    tmp_path: Path,
) -> None:
    spec = _spec(MEASURED, TPOT_SLO_MS, 1, workload)
    status, condition = _serve_until(k8s, kvpilot, "cpu-measured", spec, "True", tmp_path, workload)
    accuracy = status["planAccuracy"]
    expected = plan_of(spec, measured)
    assert (status["plan"]["predictedTtftMs"], status["plan"]["predictedTpotMs"]) == (
        expected.predicted_ttft_ms,
        expected.predicted_tpot_ms,
    )
    for signal in ("ttft", "tpot"):
        entry = accuracy[signal]
        # Predicted and observed side by side, from the plan the pods run and the engines' reports.
        assert entry["predictedMs"] == status["plan"][f"predicted{signal.capitalize()}Ms"], accuracy
        assert BAND[0] <= entry["ratio"] <= BAND[1] and entry["requests"] >= 20, accuracy
    assert condition["reason"] == "WithinBand" and "ttft" in condition["message"].lower(), condition
    # The engines' prefix cache counters reach the status: prompts that share no prefix, as the
    # plan assumed (load.prefixShare 0).
    assert accuracy["prefixShare"]["assumed"] == 0 and accuracy["prefixShare"]["observed"] < 0.25, accuracy


def test_a_declared_prefix_share_predicts_a_shared_prompt_s_ttft(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    measured: DeviceProfile,
    workload: Workload,
    tmp_path: Path,
) -> None:
    # One prompt for every request, its share declared: the plan's prefill is the 9 tokens the
    # prefix cache leaves, and the engines' TTFT is inside the band of that prediction.
    spec = _spec(MEASURED, TPOT_SLO_MS, 1, workload)
    spec["load"].update(meanPromptTokens=57, prefixShare=SHARED_PREFIX)
    status, _ = _serve_until(k8s, kvpilot, "cpu-shared", spec, "True", tmp_path, workload, unique_prompts=False)
    accuracy = status["planAccuracy"]
    assert BAND[0] <= accuracy["ttft"]["ratio"] <= BAND[1], accuracy
    assert accuracy["prefixShare"]["assumed"] == SHARED_PREFIX, accuracy
    # Observed over a window: an engine's first request finds nothing cached (0.80 with it in a
    # window of 22 requests).
    assert abs(accuracy["prefixShare"]["observed"] - SHARED_PREFIX) < 0.08, accuracy
    undeclared = plan_of({**spec, "load": {**spec["load"], "prefixShare": 0}}, measured)
    assert undeclared.predicted_ttft_ms > status["plan"]["predictedTtftMs"], (undeclared.reasons, status["plan"])


def test_a_wrong_profile_shows_plan_accurate_false_with_the_numbers(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    measured: DeviceProfile,
    workload: Workload,
    tmp_path: Path,
) -> None:
    # A TPOT SLO the wrong profile meets with one replica and the engines here do not: 1.5x its
    # one-replica prediction, under the band's factor of two, so once the correction is in the plan
    # asks for more replicas. Derived, not fixed: the profile measured today sets the prediction (a
    # fixed 15 ms took two replicas on a slower run). `slo` mode: the operator owns the replicas, so
    # the plan is re-planned from what it observes.
    one_replica = plan_of(_spec(WRONG, 10_000, 1, workload), measured)
    assert one_replica.replicas == 1 and one_replica.predicted_tpot_ms > 0, one_replica.reasons
    spec = _spec(WRONG, round(one_replica.predicted_tpot_ms * 1.5, 1), 3, workload, mode="slo")
    first = plan_of(spec, measured)
    assert first.replicas == 1 and first.meets_slo, first.reasons
    status, condition = _serve_until(k8s, kvpilot, "cpu-wrong", spec, "False", tmp_path, workload)
    accuracy, corrected = status["planAccuracy"], status["correction"]
    # Predicted for a machine 4x as fast: the engines here are slower than that by more than the band.
    assert any(accuracy[s]["ratio"] > BAND[1] for s in ("ttft", "tpot")), accuracy
    assert condition["reason"] == "OutsideBand", condition
    assert "observed" in condition["message"] and "predicted" in condition["message"], condition
    # Re-planned with the observed factors: more replicas, and the reasons say why.
    assert max(corrected["ttft"], corrected["tpot"]) > BAND[1], corrected
    assert status["plan"]["replicas"] > first.replicas, status["plan"]
    assert "status.correction" in status["plan"]["reasons"]["replicas"], status["plan"]["reasons"]
