"""What the operator loads and unloads on an engine pod and what status.adapters says
(operator/autoscaling/adapters.py): pure functions, no engine."""

from __future__ import annotations

from kvpilot.operator.api.model_paths import source_path
from kvpilot.operator.api.spec import AdapterSpec
from kvpilot.operator.autoscaling import adapters
from kvpilot.operator.autoscaling.adapters import (
    Failures,
    Step,
    adapter_rows,
    gate_condition,
    gate_written,
    steps,
    wanted,
)


def test_sources_map_to_where_render_puts_them_in_the_pod() -> None:
    assert source_path("hf://org/sql-lora") == "/model-cache/hf/org/sql-lora@main"
    assert source_path("hf://org/sql-lora@refs/pr/1") == "/model-cache/hf/org/sql-lora@refs%2Fpr%2F1"
    assert source_path("pvc://adapters/support/v2") == "/models/adapters/support/v2"
    assert source_path("pvc://adapters") == "/models/adapters"
    assert source_path("/adapters/legal") == "/adapters/legal"


def test_a_pod_is_brought_to_exactly_the_wanted_adapters() -> None:
    want = wanted([AdapterSpec(name="sql", source="/a/sql"), AdapterSpec(name="legal", source="pvc://c/legal")])
    assert want == {"sql": "/a/sql", "legal": "/models/c/legal"}
    # A new pod: everything loaded, by name.
    assert steps(want, {}) == [Step("load", "legal", "/models/c/legal"), Step("load", "sql", "/a/sql")]
    # Holding all of it from the same paths: nothing to do.
    assert steps(want, {"sql": "/a/sql", "legal": "/models/c/legal"}) == []
    # A removed adapter is unloaded first (it frees a slot); a moved source is loaded in place.
    assert steps(want, {"sql": "/a/sql-old", "legal": "/models/c/legal", "gone": "/a/gone"}) == [
        Step("unload", "gone"),
        Step("reload", "sql", "/a/sql"),
    ]
    assert steps({}, {"gone": "/a/gone"}) == [Step("unload", "gone")]


def test_a_failed_load_is_retried_after_a_doubling_backoff() -> None:
    failures = Failures()
    assert failures.due("p0", "bad", 100.0)
    failures.failed("p0", "bad", 100.0, "HTTP 400: malformed")
    assert not failures.due("p0", "bad", 100.0 + adapters.RETRY_SECONDS - 1)
    assert failures.due("p0", "bad", 100.0 + adapters.RETRY_SECONDS)
    assert failures.due("p1", "bad", 100.0)  # another pod, another adapter: unaffected
    assert failures.due("p0", "sql", 100.0)
    failures.failed("p0", "bad", 200.0, "HTTP 400: malformed")
    assert failures.by_key[("p0", "bad")].until == 200.0 + 2 * adapters.RETRY_SECONDS
    for at in range(20):
        failures.failed("p0", "bad", 300.0 + at, "HTTP 400: malformed")
    assert failures.by_key[("p0", "bad")].until == 319.0 + adapters.MAX_RETRY_SECONDS
    assert len(failures.by_key[("p0", "bad")].message) <= adapters.MAX_MESSAGE


def test_an_unreadable_pod_is_said_without_delaying_its_loads() -> None:
    failures = Failures()
    failures.unread("p0", ["sql"], 100.0, "its adapters could not be read: HTTP 503")
    failures.unread("p0", ["sql"], 115.0, "its adapters could not be read: HTTP 503")
    assert failures.by_key[("p0", "sql")].at == 100.0  # since when: the status does not change each period
    assert failures.due("p0", "sql", 115.0)
    failures.failed("p0", "sql", 130.0, "HTTP 400: malformed")
    assert failures.by_key[("p0", "sql")].count == 1


def test_failures_are_forgotten_once_they_no_longer_apply() -> None:
    failures = Failures()
    for pod, name in [("gone", "sql"), ("p0", "removed"), ("p0", "sql"), ("p1", "sql")]:
        failures.failed(pod, name, 100.0, "HTTP 400")
    failures.keep_only({"sql": "/a/sql"}, {"p0": {"sql": "/a/sql"}, "p1": None})
    # p0 holds it now; p1 could not be read (its failure stands); the pod and adapter that went are forgotten.
    assert list(failures.by_key) == [("p1", "sql")]


def test_status_rows_say_where_each_adapter_is_and_its_last_error() -> None:
    specs = [AdapterSpec(name="sql", source="/a/sql"), AdapterSpec(name="bad", source="/a/bad")]
    failures = Failures()
    failures.failed("p0", "bad", 1_700_000_000.0, "load from /a/bad: HTTP 400: no adapter_config.json")
    failures.failed("p1", "bad", 1_700_000_015.0, "load from /a/bad: HTTP 400: rank 64 > 16")
    held = {"p0": {"sql": "/a/sql"}, "p1": {"sql": "/a/sql-old"}, "p2": None}
    assert adapter_rows(specs, held, failures) == [
        {"name": "sql", "source": "/a/sql", "loadedOn": ["p0"], "pods": 3},
        {
            "name": "bad",
            "source": "/a/bad",
            "loadedOn": [],
            "pods": 3,
            "error": {
                "pod": "p1",
                "message": "load from /a/bad: HTTP 400: rank 64 > 16",
                "time": "2023-11-14T22:13:35Z",
            },
        },
    ]


def test_the_readiness_gate_opens_once_every_adapter_was_given_to_the_pod() -> None:
    want = {"sql": "/a/sql", "bad": "/a/bad"}
    failures = Failures()
    assert gate_condition("p0", want, None, failures, 100.0) is None  # not read
    assert gate_condition("p0", want, {"sql": "/a/sql"}, failures, 100.0) is None  # bad not tried yet
    failures.unread("p0", ["bad"], 100.0, "HTTP 503")
    assert gate_condition("p0", want, {"sql": "/a/sql"}, failures, 100.0) is None  # nothing tried
    assert gate_condition("p0", want, {"sql": "/a/old", "bad": "/a/bad"}, failures, 100.0) is None  # moved
    # An engine not ready for it (503) or not answering has not refused it: the pod waits.
    failures.failed("p0", "bad", 100.0, "HTTP 503: the server is not ready to load adapters", refused=False)
    assert gate_condition("p0", want, {"sql": "/a/sql"}, failures, 100.0) is None
    # A refused adapter is an error on it, not a pod kept out of the Service.
    failures.failed("p0", "bad", 101.0, "HTTP 400: malformed")
    condition = gate_condition("p0", want, {"sql": "/a/sql"}, failures, 101.0)
    assert condition is not None
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "kvpilot.dev/adapters-loaded",
        "True",
        "AdaptersLoaded",
    )
    assert condition["message"] == "holds 1 of 2 adapters; refused: bad"
    assert gate_condition("p1", want, {"sql": "/a/sql"}, failures, 101.0) is None  # p1 never tried bad
    full = gate_condition("p1", want, {"sql": "/a/sql", "bad": "/a/bad"}, failures, 101.0)
    assert full is not None and full["message"] == "holds 2 of 2 adapters"
    # Written once: a gate another writer set (kwok sets every gate True) is written over with ours.
    assert gate_written({"status": {"conditions": [condition]}})
    assert not gate_written({"status": {"conditions": [{**condition, "reason": None}]}})
    assert not gate_written({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
