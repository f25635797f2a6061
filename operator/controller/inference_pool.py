"""The InferencePool of an InferenceService (Gateway API Inference Extension, `inference.networking.k8s.io/v1`):
it hands the service's engine pods to an endpoint picker (llm-d's or the extension's own), which a
Gateway asks, request by request, which pod to send to.

The pool selects exactly the pods the service's Service selects, on the engine port. The endpoint
picker is a Service the user runs beside it; by default `<service>-epp` on port 9002, the names the
extension's `inferencepool` chart gives its picker when installed under the InferenceService's name.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.names import PORT, child_metadata, selector_labels
from kvpilot.operator.api.spec import EndpointPickerSpec

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
PLURAL = "inferencepools"


def inference_pool(name: str, namespace: str, uid: str, picker: EndpointPickerSpec) -> dict[str, Any]:
    """The pool, named and owned like the service's other children, handing its pods to `picker`
    (spec.inferencePool.endpointPicker: a Service in the same namespace, `<name>-epp` unset)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.name or f"{name}-epp",
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
