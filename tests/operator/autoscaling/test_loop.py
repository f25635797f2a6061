"""The autoscaler's loop, its pure parts: which pods are read, what is written where, and how
the status a reconcile writes keeps what the loop wrote (operator/autoscaling/loop.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import generate_latest

from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus, Latency, status_of
from kvpilot.operator.autoscaling.accuracy import SUSTAIN_PERIODS, accuracy_patch
from kvpilot.operator.autoscaling.decisions import AutoscalerState, Decision, PodRead, Policy, Signals
from kvpilot.operator.autoscaling.loop import (
    AutoscalingLoop,
    decide,
    due,
    event_manifest,
    metrics_targets,
    read_metrics,
    saved_state,
    status_patch,
    worth_writing,
)
from kvpilot.operator.autoscaling.metrics import EngineReading, parse
from kvpilot.operator.controller import status
from kvpilot.operator.kube.indexes import children, current_replicas, index_entry
from kvpilot.operator.kube.merge_patch import as_merge_patch, merge_patch
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.operator.autoscaling.test_decisions import Pod
from tests.operator.autoscaling.test_loop_io import with_session
from tests.operator.controller.test_reconcile import apply_merge_patch
from tests.operator.statuses import reconciled

NOW = 1_800_000_000.0


def pod(name: str, ip: str | None = "127.0.0.9", ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "status": {
            **({"podIP": ip} if ip else {}),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def body(spec: dict[str, Any] | None = None, status_: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"model": {"name": "llama-2-7b"}, **(spec or {})},
        "status": status_ or {},
    }


def deployment(replicas: int, ready: int) -> dict[str, Any]:
    return {"metadata": {"name": "chat"}, "spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def test_only_ready_pods_that_stay_are_read() -> None:
    pods = [
        pod("b"),
        pod("a"),
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("leaving", deleting=True),
        pod("v6", ip="::1"),
    ]
    assert metrics_targets(pods) == [
        ("a", "http://127.0.0.9:8000/metrics"),
        ("b", "http://127.0.0.9:8000/metrics"),
        ("v6", "http://[::1]:8000/metrics"),
    ]


def child(
    name: str,
    namespace: str,
    owner: str | None,
    instance: str | None = None,
    uid: str | None = None,
    controller: bool = True,
) -> dict[str, Any]:
    """An object as the indexes hold it, controlled by the object whose uid is `owner`."""
    refs = [{"controller": controller, "uid": owner}] if owner else []
    labels = {"app.kubernetes.io/instance": instance} if instance else {}
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "ownerReferences": refs,
            "labels": labels,
        }
    }


def test_a_service_s_children_from_one_round_s_lists() -> None:
    mine = child("chat", "ml", "u-1", uid="dep-1")
    deployments = [child("chat", "other", "u-9"), child("chat", "ml", "someone-else"), mine]
    replicasets = [child("chat-5d8f", "ml", "dep-1", "chat", uid="rs-1")]
    pods = [
        child("chat-a", "ml", "rs-1", "chat"),
        child("chat-b", "other", "rs-1", "chat"),
        child("summarize-a", "ml", "rs-1", "summarize"),
    ]
    deployment, engine_pods = children(body(), deployments, replicasets, pods)
    assert deployment is mine
    assert [p["metadata"]["name"] for p in engine_pods] == ["chat-a"]
    # A same-named Deployment someone else controls is not scaled on, nor are its pods read.
    assert children(body(), deployments[:2], replicasets, pods) == (None, [])


def test_only_pods_of_the_service_s_own_replicasets_count() -> None:
    """Anyone who can create a pod can give it the two labels the index selects; a pod counts
    (metrics, gateway traffic) only through the ownership chain Kubernetes keeps: its controller
    is a ReplicaSet whose controller is the service's own Deployment, by uid."""
    deployments = [child("chat", "ml", "u-1", uid="dep-1"), child("other", "ml", "u-2", uid="dep-2")]
    replicasets = [
        child("chat-new", "ml", "dep-1", "chat", uid="rs-1"),
        child("chat-old", "ml", "dep-1", "chat", uid="rs-0"),  # mid-rollout: its pods still serve
        child("chat-fake", "ml", "dep-2", "chat", uid="rs-9"),  # another Deployment's
        child("chat-adopted", "ml", "dep-1", "chat", uid="rs-8", controller=False),
        child("chat-orphan", "ml", None, "chat", uid="rs-7"),
    ]
    pods = [
        child("chat-new-1", "ml", "rs-1", "chat"),
        child("chat-old-1", "ml", "rs-0", "chat"),
        child("stray-labels-only", "ml", None, "chat"),
        child("stray-foreign-rs", "ml", "rs-9", "chat"),
        child("stray-not-controlled", "ml", "rs-8", "chat"),
        child("stray-orphan-rs", "ml", "rs-7", "chat"),
        child("stray-no-controller-ref", "ml", "rs-1", "chat", controller=False),
        child("stray-owned-by-the-deployment", "ml", "dep-1", "chat"),
        child("stray-unknown-rs", "ml", "rs-404", "chat"),
    ]
    _, engine_pods = children(body(), deployments, replicasets, pods)
    assert sorted(p["metadata"]["name"] for p in engine_pods) == ["chat-new-1", "chat-old-1"]


def test_replicas_now_are_the_spec_s_else_the_rendered_plan_s() -> None:
    assert current_replicas(body({"replicas": 3}), deployment(2, 2)) == 3
    assert current_replicas(body(), deployment(2, 2)) == 2  # the plan's count seeded the rollout
    assert current_replicas(body(), None) == 0


def test_state_round_trips_through_the_status_and_bad_state_starts_afresh() -> None:
    reads = (Pod("p0").serve(30, 0.4).read(),)
    outcome = decide(body({"replicas": 1}), deployment(1, 1), reads, NOW)
    assert outcome is not None
    _, state, decision = outcome
    patch = status_patch(state, decision, None)
    stored = json.loads(json.dumps(patch, allow_nan=False))  # what the API server keeps
    assert saved_state(status_of({"status": stored})) == state
    assert saved_state(status_of({})) == AutoscalerState()
    garbage = {"status": {"autoscaler": {"state": {"window": "garbage"}}}}
    assert saved_state(status_of(garbage)) == AutoscalerState()


def test_a_decision_goes_to_the_status_with_its_numbers() -> None:
    pods = [Pod("p0"), Pod("p1")]
    first = decide(body({"replicas": 2}), deployment(2, 2), [p.read() for p in pods], NOW)
    assert first is not None
    for p in pods:
        p.serve(40, 6.0)
    outcome = decide(
        body({"replicas": 2}, status_patch(first[1], first[2], None)),
        deployment(2, 2),
        [p.read() for p in pods] + [PodRead(name="p2", error="timed out")],
        NOW + 15,
    )
    assert outcome is not None
    policy, state, decision = outcome
    assert decision.action == "up" and decision.replicas == 4
    patch = status_patch(state, decision, Latency(ttft_p95_ms=100.0, tpot_p95_ms=20.0, source="predicted"))
    last = patch["autoscaler"]["lastDecision"]
    assert last["action"] == "up" and (last["previous"], last["replicas"]) == (2, 4)
    assert last["time"] == datetime.fromtimestamp(NOW + 15, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert "p95 TTFT" in last["reason"] and "2 -> 4" in last["reason"]
    assert patch["autoscaler"]["unknownPods"] == ["p2"]
    assert patch["latency"]["source"] == "observed" and patch["latency"]["ttftP95Ms"] > 5000


def test_the_status_patch_removes_what_is_gone() -> None:
    """A JSON merge patch keeps keys it does not name: a pod that went away must be named null,
    or its baseline would stay in the status for good."""
    pods = [Pod("p0"), Pod("p1")]
    first = decide(body({"replicas": 2}), deployment(2, 2), [p.read() for p in pods], NOW)
    assert first is not None
    old_status = json.loads(json.dumps(status_patch(first[1], first[2], None)))
    assert set(old_status["autoscaler"]["state"]["baselines"]) == {"p0", "p1"}
    second = decide(body({"replicas": 1}, old_status), deployment(1, 1), [pods[0].read()], NOW + 15)
    assert second is not None
    patch = as_merge_patch(old_status, status_patch(second[1], second[2], None))
    assert patch["autoscaler"]["state"]["baselines"] == {"p1": None}
    assert apply_merge_patch(old_status, patch)["autoscaler"] == status_patch(second[1], second[2], None)["autoscaler"]


def test_an_idle_period_writes_nothing() -> None:
    """The same decision for the same numbers, and no pod counted a request: no write (an idle
    cluster costs no API requests). Anything that moved is written."""
    pods = [Pod("p0")]
    first = decide(body({"replicas": 1}), deployment(1, 1), [pods[0].read()], NOW)
    assert first is not None
    assert worth_writing(status_of({}), first[1], first[2])  # nothing was written yet
    saved = json.loads(json.dumps(status_patch(first[1], first[2], None)))
    second = decide(body({"replicas": 1}, saved), deployment(1, 1), [pods[0].read()], NOW + 15)
    assert second is not None and worth_writing(
        status_of({"status": saved}), second[1], second[2]
    )  # now a rate: 0 req/s
    saved = json.loads(json.dumps(status_patch(second[1], second[2], None)))
    idle = decide(body({"replicas": 1}, saved), deployment(1, 1), [pods[0].read()], NOW + 30)
    assert idle is not None and not worth_writing(status_of({"status": saved}), idle[1], idle[2])
    pods[0].serve(1, 0.2)  # one request: the baseline moved
    busy = decide(body({"replicas": 1}, saved), deployment(1, 1), [pods[0].read()], NOW + 30)
    assert busy is not None and worth_writing(status_of({"status": saved}), busy[1], busy[2])
    gone = decide(body({"replicas": 1}, saved), deployment(1, 1), [PodRead(name="p0", error="refused")], NOW + 30)
    assert gone is not None and worth_writing(status_of({"status": saved}), gone[1], gone[2])  # the reason names it now


def test_index_entries_copy_what_the_loop_reads() -> None:
    engine_pod = {
        "kind": "Pod",
        "metadata": {
            "name": "chat-1",
            "namespace": "ml",
            "labels": {"app.kubernetes.io/instance": "chat"},
            "managedFields": [{}],
        },
        "spec": {"containers": [{}]},
        "status": {"podIP": "127.0.0.9"},
    }
    entry = index_entry(engine_pod, key_label="app.kubernetes.io/instance")
    assert list(entry) == [("ml", "chat")]
    (value,) = entry.values()
    assert "spec" not in value and "managedFields" not in value["metadata"]
    engine_pod["status"]["podIP"] = "127.0.0.10"  # kopf's body changes later: the entry does not
    assert value["status"]["podIP"] == "127.0.0.9"
    assert (
        index_entry(
            {"kind": "Pod", "metadata": {"name": "stray", "namespace": "ml"}}, key_label="app.kubernetes.io/instance"
        )
        == {}
    )
    replicaset = {
        "kind": "ReplicaSet",
        "metadata": {
            "name": "chat-5d8f",
            "namespace": "ml",
            "uid": "rs-1",
            "labels": {"app.kubernetes.io/instance": "chat"},
            "ownerReferences": [{"controller": True, "uid": "dep-1"}],
        },
        "spec": {"template": {"spec": {"containers": [{}]}}},
        "status": {"readyReplicas": 1},
    }
    (value,) = index_entry(replicaset, key_label="app.kubernetes.io/instance").values()
    assert "spec" not in value and value["metadata"] == replicaset["metadata"]  # a pod template is large
    service = body({"replicas": 2})
    assert index_entry(service) == {("ml", "chat"): {k: service[k] for k in ("metadata", "spec", "status")}}


def test_the_loop_s_handlers_add_no_finalizer() -> None:
    """Indexes and startup/cleanup activities, not timers or daemons: `kubectl delete` of an
    InferenceService never waits for the operator."""
    import kopf

    import kvpilot.operator.controller.handlers
    import kvpilot.operator.process  # noqa: F401

    registry = kopf.get_default_registry()
    indexers = {h.id for h in registry._indexing.get_all_handlers()}
    assert indexers == {"autoscaled_services", "engine_deployments", "engine_replicasets", "engine_pods"}
    assert list(registry._spawning.get_all_handlers()) == []
    assert not any(h.requires_finalizer for h in registry._changing.get_all_handlers())
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert {"start_autoscaler", "stop_autoscaler"} <= activities


def test_observed_latency_stays_when_a_window_has_no_requests() -> None:
    outcome = decide(body({"replicas": 1}), deployment(1, 1), [Pod("p0").read()], NOW)
    assert outcome is not None
    _, state, decision = outcome
    assert decision.signals.ttft_p95_seconds is None
    assert "latency" not in status_patch(state, decision, Latency(ttft_p95_ms=900.0, source="observed"))


@pytest.mark.parametrize(
    "spec, deployed",
    [
        ({"autoscaling": {"mode": "off"}}, True),  # off: left alone entirely
        ({"replicas": 1}, False),  # no Deployment of ours yet: nothing to scale
        ({"model": {"name": ""}}, True),  # an invalid spec
    ],
)
def test_services_the_loop_leaves_alone(spec: dict[str, Any], deployed: bool) -> None:
    assert decide(body(spec), deployment(1, 1) if deployed else None, [Pod("p0").read()], NOW) is None


def test_external_mode_decides_hold_and_still_reports() -> None:
    pods = [Pod("p0")]
    first = decide(
        body({"autoscaling": {"mode": "external"}, "replicas": 1}), deployment(1, 1), [p.read() for p in pods], NOW
    )
    assert first is not None
    pods[0].serve(40, 9.0)
    outcome = decide(
        body({"autoscaling": {"mode": "external"}, "replicas": 1}, status_patch(first[1], first[2], None)),
        deployment(1, 1),
        [p.read() for p in pods],
        NOW + 15,
    )
    assert outcome is not None
    policy, _, decision = outcome
    assert policy.mode == "external" and (decision.action, decision.replicas) == ("hold", 1)
    assert decision.signals.ttft_p95_seconds > 5


def test_a_service_decided_on_moments_ago_is_not_due() -> None:
    """Another replica of the operator wrote it: the pace stays one decision per period."""
    outcome = decide(body({"replicas": 1}), deployment(1, 1), [Pod("p0").read()], NOW)
    assert outcome is not None
    state = outcome[1]
    assert not due(state, NOW + 5) and due(state, NOW + 13)
    written = body({"replicas": 1}, status_patch(state, outcome[2], None))
    assert decide(written, deployment(1, 1), [Pod("p0").read()], NOW + 5) is None


def test_event_for_a_change() -> None:
    pods = [Pod("p0")]
    first = decide(body({"replicas": 1}), deployment(1, 1), [p.read() for p in pods], NOW)
    assert first is not None
    pods[0].serve(40, 6.0)
    outcome = decide(
        body({"replicas": 1}, status_patch(first[1], first[2], None)),
        deployment(1, 1),
        [p.read() for p in pods],
        NOW + 15,
    )
    assert outcome is not None
    event = event_manifest(body(), outcome[2], "operator-0")
    assert event["reason"] == "ScaledUp" and event["type"] == "Normal"
    assert event["involvedObject"] == {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "chat",
        "namespace": "ml",
        "uid": "u-1",
    }
    assert event["message"] == outcome[2].reason
    assert event["metadata"] == {"generateName": "chat.", "namespace": "ml"}


def test_a_reconcile_keeps_what_the_loop_wrote() -> None:
    """The reconcile writes the whole status as a merge patch, which removes what it does not list."""
    spec = InferenceServiceSpec.model_validate({"model": {"name": "llama-2-7b"}, "accelerator": {"type": "L4"}})
    result = plan(spec, PlanContext())
    looped = {
        "autoscaler": {"lastDecision": {"action": "hold"}, "state": {"window": []}},
        "latency": {"ttftP95Ms": 812.5, "tpotP95Ms": 31.0, "source": "observed"},
    }
    new = reconciled(spec, result, looped)
    assert new["autoscaler"] == looped["autoscaler"] and new["latency"] == looped["latency"]
    assert merge_patch(looped, new).keys().isdisjoint({"autoscaler", "latency"})
    fresh = reconciled(spec, result)
    assert "autoscaler" not in fresh
    assert fresh["latency"] == {
        "ttftP95Ms": result.predicted_ttft_ms,
        "tpotP95Ms": result.predicted_tpot_ms,
        "source": "predicted",
    }


def test_a_reconcile_keeps_plan_accurate_for_the_plan_it_was_judged_against() -> None:
    """PlanAccurate and status.planAccuracy come from the loop; the reconcile, which writes the
    whole status and the whole conditions list, keeps them for the same predictions (stamped with
    its generation), and starts them again (Unknown) for a plan that predicts other latencies."""
    spec = InferenceServiceSpec.model_validate({"model": {"name": "llama-2-7b"}, "accelerator": {"type": "L4"}})
    result = plan(spec, PlanContext())

    first = reconciled(spec, result)
    assert "PlanAccurate" not in {c["type"] for c in first["conditions"]}  # the loop writes it
    signals = Signals(ttft_p95_seconds=result.predicted_ttft_ms * 4 / 1000, tpot_p95_seconds=None, ttft_observations=40)
    looped = first
    for period in range(SUSTAIN_PERIODS):
        looped = {
            **looped,
            **accuracy_patch(InferenceServiceStatus.model_validate(looped), signals, 60.0, NOW + 15 * period, 1),
        }
    accurate = next(c for c in looped["conditions"] if c["type"] == "PlanAccurate")
    assert (accurate["status"], accurate["reason"]) == ("False", "OutsideBand")

    again = reconciled(spec, result, looped, generation=2)
    assert again["planAccuracy"] == looped["planAccuracy"]
    kept = next(c for c in again["conditions"] if c["type"] == "PlanAccurate")
    assert kept == {**accurate, "observedGeneration": 2}
    assert [c["type"] for c in again["conditions"]] == ["Planned", "Progressing", "Ready", "Degraded", "PlanAccurate"]
    assert "planAccuracy" not in merge_patch(looped, again)

    other = plan(spec.model_copy(update={"accelerator": spec.accelerator.model_copy(update={"type": "A100-80GB"})}))
    assert other.predicted_ttft_ms != result.predicted_ttft_ms
    replanned = reconciled(spec, other, looped, generation=3)
    fresh = next(c for c in replanned["conditions"] if c["type"] == "PlanAccurate")
    assert (fresh["status"], fresh["reason"], fresh["observedGeneration"]) == ("Unknown", "Replanned", 3)
    assert "planAccuracy" not in replanned and merge_patch(looped, replanned)["planAccuracy"] is None


# ---- reading /metrics over HTTP, on 127.0.0.1 only ------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes, float]] = {}

    def do_GET(self) -> None:
        code, payload, delay = self.routes[self.path]
        time.sleep(delay)
        self.send_response(code)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_read_metrics(server: str) -> None:
    exposition = generate_latest(ServingMetrics("m", vllm_compatible=True).registry)
    _Handler.routes = {
        "/metrics": (200, exposition, 0.0),
        "/html": (200, b"<html>hi</html>", 0.0),
        "/broken": (500, b"oops", 0.0),
        "/slow": (200, exposition, 1.0),
    }
    good = with_session(read_metrics, "a", f"{server}/metrics")
    assert good.error is None and good.reading is not None and good.reading.ttft is not None
    for path in ("/html", "/broken"):
        bad = with_session(read_metrics, "b", f"{server}{path}")
        assert bad.reading is None and bad.error
    slow = with_session(read_metrics, "c", f"{server}/slow", 0.3)
    assert slow.reading is None and "within 0.3 s" in slow.error
    closed = with_session(read_metrics, "d", "http://127.0.0.1:9/metrics", 0.5)  # discard port: refused
    assert closed.reading is None and closed.error


def counting_engine(first: str, second: str) -> Callable[[int, int], str]:
    """The /metrics of an engine whose counters `first` and `second` (ServingMetrics' families)
    stand at the values it is called with."""

    def exposition(a: int, b: int) -> str:
        metrics = ServingMetrics("m")
        metrics._family(first).inc(a)
        metrics._family(second).inc(b)
        return generate_latest(metrics.registry).decode()

    return exposition


def test_observed_draft_acceptance_goes_beside_the_plan_s_assumption() -> None:
    """Engines that speculate export draft and accepted token counters; the window's ratio of
    their increases goes to status.latency.draftAcceptance, next to status.plan's assumed one.
    A restarted pod's counters (lower than before) count from zero, as `increase()` does."""
    engine = counting_engine("spec_draft_tokens", "spec_accepted")

    reads = [PodRead(name="a", reading=parse(engine(100, 30))), PodRead(name="b", reading=parse(engine(100, 50)))]
    outcome = decide(body({"replicas": 2}), deployment(2, 2), reads, NOW)
    assert outcome is not None and outcome[2].signals.draft_acceptance is None  # first read: no window yet
    saved = status_patch(outcome[1], outcome[2], None)
    reads = [
        PodRead(name="a", reading=parse(engine(300, 90))),  # +200 proposed, +60 accepted
        PodRead(name="b", reading=parse(engine(40, 30))),
    ]  # restarted: 40 and 30 since
    outcome = decide(body({"replicas": 2}, saved), deployment(2, 2), reads, NOW + 15)
    assert outcome is not None
    assert outcome[2].signals.draft_acceptance == pytest.approx(90 / 240)
    assert status_patch(outcome[1], outcome[2], None)["latency"] == {"draftAcceptance": 0.375, "source": "observed"}

    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"}, "serving": {"speculative": "ngram"}}
    )
    summary = status.plan_summary(plan(spec))
    assert summary["speculative"] == "ngram" and summary["assumedDraftAcceptance"] == 0.29
    off = InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"}, "serving": {"speculative": "off"}}
    )
    assert "assumedDraftAcceptance" not in status.plan_summary(plan(off))


def test_a_pod_s_untrustworthy_numbers_make_it_unknown_not_the_others_load(server: str) -> None:
    """One pod reporting waiting=-1e6 must not cancel another pod's 20 waiting requests, and one
    reporting NaN must not hide another's full KV cache nor put NaN into the status (invalid JSON)."""

    def exposition(waiting: str, kv: str = "0.5") -> bytes:
        return (
            f"# TYPE kvpilot_num_requests_waiting gauge\nkvpilot_num_requests_waiting {waiting}\n"
            f"# TYPE kvpilot_kv_cache_usage_ratio gauge\nkvpilot_kv_cache_usage_ratio {kv}\n"
        ).encode()

    _Handler.routes = {
        "/negative": (200, exposition("-1e6"), 0.0),
        "/queued": (200, exposition("20"), 0.0),
        "/nan": (200, exposition("NaN"), 0.0),
        "/full": (200, exposition("0", kv="1.0"), 0.0),
        "/inf": (200, exposition("+Inf"), 0.0),
    }

    def period(paths: list[str]) -> Any:
        reads = [with_session(read_metrics, path.strip("/"), f"{server}{path}") for path in paths]
        outcome = decide(body({"replicas": 2}), deployment(2, 2), reads, NOW)
        assert outcome is not None
        json.dumps(status_patch(outcome[1], outcome[2], None), allow_nan=False)  # what the API server accepts
        return outcome[2]

    queued = period(["/negative", "/queued"])
    assert queued.signals.waiting_per_replica == 20 and queued.signals.unknown == ("negative",)
    full = period(["/nan", "/full"])
    assert full.signals.kv_cache_usage == 1.0 and full.signals.unknown == ("nan",)
    overflow = period(["/inf", "/queued"])
    assert overflow.signals.waiting_per_replica == 20 and overflow.signals.unknown == ("inf",)


@pytest.mark.parametrize("action, replicas", [("down", 1), ("up", 4)])
def test_a_scale_down_marks_the_pods_with_the_least_work_to_go_first(action: str, replicas: int) -> None:
    """Issue 24, item 10: the ReplicaSet removed any pod, cutting streams on busy ones while idle
    ones stayed; before a scale-down each pod now carries a deletion cost of its work."""
    calls: list[Any] = []

    class Cluster:
        def patch_status(self, *args: Any, **kwargs: Any) -> str:
            calls.append("status")
            return "8"

        def set_deletion_costs(self, namespace: str, costs: dict[str, int]) -> None:
            calls.append(("costs", namespace, dict(costs)))

        def write_replicas(self, body: Any, replicas: int, event: Any, resource_version: str | None = None) -> None:
            calls.append(("replicas", replicas, resource_version))

    reads = [
        PodRead(name="busy", reading=EngineReading(running=5, waiting=2.5)),
        PodRead(name="idle", reading=EngineReading(running=0, waiting=0)),
        PodRead(name="broken", error="connection refused"),
    ]
    loop = AutoscalingLoop(Cluster(), {}, {}, {}, {})  # type: ignore[arg-type]
    decision = Decision(at=NOW, action=action, replicas=replicas, previous=3, reason="r", signals=Signals())
    loop._write(body(), reads, None, Policy(), AutoscalerState(), decision)
    costs = [("costs", "ml", {"busy": 8, "idle": 0, "broken": -1})] if action == "down" else []
    assert calls == ["status", *costs, ("replicas", replicas, "8")]


def test_observed_prefix_share_is_the_window_s_hits_over_lookups() -> None:
    """The engines' prefix cache counters (prompt tokens looked up, found): the window's ratio of
    their increases goes to status.latency.prefixShare, beside status.plan's assumed one."""
    engine = counting_engine("prefix_queries", "prefix_hits")

    reads = [PodRead(name="a", reading=parse(engine(500, 100))), PodRead(name="b", reading=parse(engine(0, 0)))]
    outcome = decide(body({"replicas": 2}), deployment(2, 2), reads, NOW)
    assert outcome is not None and outcome[2].signals.prefix_share is None  # first read: no window yet
    saved = status_patch(outcome[1], outcome[2], None)
    reads = [PodRead(name="a", reading=parse(engine(900, 400))), PodRead(name="b", reading=parse(engine(600, 480)))]
    outcome = decide(body({"replicas": 2}, saved), deployment(2, 2), reads, NOW + 15)
    assert outcome is not None
    assert outcome[2].signals.prefix_share == pytest.approx((300 + 480) / (400 + 600))
    assert status_patch(outcome[1], outcome[2], None)["latency"] == {"prefixShare": 0.78, "source": "observed"}
    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"}, "load": {"prefixShare": 0.6}}
    )
    assert status.plan_summary(plan(spec))["assumedPrefixShare"] == 0.6
