"""The InferencePool of an InferenceService (Gateway API Inference Extension, `inference.networking.k8s.io/v1`):
it hands the service's engine pods to an endpoint picker (llm-d's or the extension's own), which a
Gateway asks, request by request, which pod to send to.

The pool selects exactly the pods the service's Service selects, on the engine port. The endpoint
picker is a Service the user runs beside it; by default `<service>-epp` on port 9002, the names the
extension's `inferencepool` chart gives its picker when installed under the InferenceService's name.
"""

from __future__ import annotations

from typing import Any, Literal

from kvpilot.operator.api.names import PORT, child_metadata, selector_labels

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
PLURAL = "inferencepools"
# The endpoint picker's ext-proc (gRPC) port in the extension's chart and examples.
ENDPOINT_PICKER_PORT = 9002

FailureMode = Literal["FailOpen", "FailClose"]


def inference_pool(
    name: str,
    namespace: str,
    uid: str,
    *,
    endpoint_picker: str | None = None,
    endpoint_picker_port: int = ENDPOINT_PICKER_PORT,
    failure_mode: FailureMode = "FailClose",
) -> dict[str, Any]:
    """The pool, named and owned like the service's other children. `endpoint_picker` names the
    picker's Service in the same namespace (default `<name>-epp`); `failure_mode` is what the
    Gateway does while the picker does not answer: refuse the request, or route it anyway."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": endpoint_picker or f"{name}-epp",
                "port": {"number": endpoint_picker_port},
                "failureMode": failure_mode,
            },
        },
    }
