"""The kopf wiring's settings that decide how the operator lives through API outages."""

from __future__ import annotations

import collections.abc
import itertools
import json
from typing import Any

import kopf

from kvpilot.operator.controller import handlers


def test_the_operator_retries_api_errors_for_ever_instead_of_exiting() -> None:
    settings = kopf.OperatorSettings()
    memo = kopf.Memo(cluster=object())
    handlers.configure(settings=settings, memo=memo)
    delays = settings.networking.error_backoffs
    # kopf counts the retries of a sized sequence and stops after them (its default stops at 8).
    assert not isinstance(delays, collections.abc.Sized)
    assert isinstance(delays, collections.abc.Iterable)
    first = list(itertools.islice(iter(delays), 1000))
    assert len(first) == 1000 and first[:3] == [1, 1, 2] and max(first) == first[-1] == 21
    # Every request starts its delays afresh.
    assert list(itertools.islice(iter(delays), 3)) == [1, 1, 2]


def _handled(settings: kopf.OperatorSettings, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the annotations kopf writes once its handlers succeeded (the essence stored)."""
    storage = settings.persistence.diffbase_storage
    body = kopf.Body(raw)
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body))
    annotations = {**raw["metadata"].get("annotations", {}), **patch["metadata"]["annotations"]}
    return {**raw, "metadata": {**raw["metadata"], "annotations": annotations}}


def _changed(settings: kopf.OperatorSettings, raw: dict[str, Any]) -> bool | None:
    """Whether kopf sees a change (its diff between the stored essence and the object's is not
    empty); None for an object never handled (kopf's create)."""
    storage = settings.persistence.diffbase_storage
    body = kopf.Body(raw)
    old = storage.fetch(body=body)
    return None if old is None else dict(old) != dict(storage.build(body=body))


def test_kopf_remembers_the_last_handled_spec_by_its_digest_not_a_copy() -> None:
    """kopf's own annotation storage copies the whole spec into an annotation: a spec with a long env
    list (here ~60 KiB) is then stored twice, against the 256 KiB annotation limit."""
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings, memo=kopf.Memo(cluster=object()))
    env = [{"name": f"VAR_{i}", "value": "x" * 100} for i in range(500)]
    raw = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "labels": {"team": "a"}},
        "spec": {"model": {"name": "llama-3-8b"}, "env": env},
    }
    assert _changed(settings, raw) is None  # never handled: kopf's create
    handled = _handled(settings, raw)
    added = {k: v for k, v in handled["metadata"]["annotations"].items() if k.startswith(handlers.ANNOTATION_PREFIX)}
    assert len(json.dumps(added)) < 300 < len(json.dumps(raw["spec"])) // 100
    assert _changed(settings, handled) is False  # handled and unchanged: nothing to do
    # Any change of the spec, labels or user annotations is a change; key order is not.
    changes = [
        {**handled, "spec": {**handled["spec"], "replicas": 2}},
        {**handled, "metadata": {**handled["metadata"], "labels": {"team": "b"}}},
    ]
    assert all(_changed(settings, changed) is True for changed in changes)
    reordered = {**handled, "spec": dict(reversed(list(handled["spec"].items())))}
    assert _changed(settings, reordered) is False


def test_a_full_essence_written_by_an_older_operator_is_one_change_then_a_digest() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings, memo=kopf.Memo(cluster=object()))
    raw = {"metadata": {"name": "chat", "namespace": "ml"}, "spec": {"model": {"name": "llama-3-8b"}}}
    older = kopf.OperatorSettings()
    older.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=handlers.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    written = _handled(older, raw)
    assert _changed(older, written) is False
    assert _changed(settings, written) is True  # reconciled once more (harmless: the same function)
    assert _changed(settings, _handled(settings, written)) is False
