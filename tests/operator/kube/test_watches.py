"""A view of the cluster kept by watches (kube/watches.py), as the gateway and the operator's view
of the gateway pods use it: each kind's objects as index entries under the keys the operator's kopf
indexes use, changed by watch events and replaced by a relist."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.names import INSTANCE_LABEL
from kvpilot.operator.kube.watches import Index, Watched


def obj(
    name: str, uid: str, instance: str | None = None, namespace: str = "team", version: str = "1"
) -> dict[str, Any]:
    labels = {INSTANCE_LABEL: instance} if instance else {}
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels, "resourceVersion": version},
        "spec": {"containers": ["large"]},
        "status": {"podIP": "127.0.0.1"},
    }


def test_pods_are_kept_by_their_services_instance_label_and_follow_changes() -> None:
    pods = Index(Watched("v1", "Pod", key_label=INSTANCE_LABEL))
    pods.reset([obj("a-1", "u1", "a"), obj("a-2", "u2", "a"), obj("stray", "u3")])  # no label: not indexed
    assert pods.synced and sorted(pods.entries) == [("team", "a")]
    assert [e["metadata"]["name"] for e in pods.entries[("team", "a")]] == ["a-1", "a-2"]
    assert "spec" not in pods.entries[("team", "a")][0]  # a pod's spec is large and not needed
    pods.put(obj("a-1", "u1", "b", version="2"))  # relabelled: it moves
    assert [e["metadata"]["name"] for e in pods.entries[("team", "a")]] == ["a-2"]
    assert [e["metadata"]["resourceVersion"] for e in pods.entries[("team", "b")]] == ["2"]
    pods.delete(obj("a-2", "u2", "a"))
    assert sorted(pods.entries) == [("team", "b")]
    pods.delete(obj("never-seen", "u9", "a"))  # a delete of what was never listed changes nothing
    pods.reset([])
    assert pods.entries == {}


def test_services_are_kept_by_name() -> None:
    services = Index(Watched("kvpilot.dev/v1alpha1", "InferenceService"))
    services.put(obj("chat", "s1"))
    services.put({**obj("chat", "s1", version="2"), "spec": {"replicas": 0}})
    ((entry,),) = services.entries.values()
    assert entry["spec"] == {"replicas": 0} and entry["metadata"]["resourceVersion"] == "2"
    assert not services.synced  # only a full list makes it ready
