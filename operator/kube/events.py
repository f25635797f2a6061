"""Events the operator posts on an InferenceService (core/v1 Event manifests)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvpilot.operator.api.names import API_VERSION, KIND

EVENT_COMPONENT = "kvpilot-operator"


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds_of(timestamp: str) -> float:
    """`iso`'s inverse, for any RFC 3339 time the API server writes."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def scaling_event(body: Mapping[str, Any], reason: str, message: str, at: float, instance: str) -> dict[str, Any]:
    """A core/v1 Event on the InferenceService for a change of replicas (the autoscaler's, or the
    gateway's scale from zero)."""
    metadata = body["metadata"]
    when = iso(at)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata["uid"],
        },
        "type": "Normal",
        "reason": reason,
        "message": message[:1024],  # the API server refuses longer messages
        "source": {"component": EVENT_COMPONENT},
        "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }
