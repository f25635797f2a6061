from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.spec import EndpointPickerSpec, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.controller.inference_pool import API_VERSION, KIND, inference_pool
from kvpilot.operator.planning.plan import plan

PICKER = EndpointPickerSpec()
UID = "0b7c6e1e-0000-4000-8000-000000000002"


def pod_labels(name: str, **overrides: Any) -> dict[str, str]:
    """The engine pods' labels as render.py renders the Deployment of InferenceService `name`."""
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
            "accelerator": {"type": "A10G"},
            **overrides,
        }
    )
    return render.deployment(name, "ml", UID, spec, plan(spec))["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_the_pool_selects_this_services_engine_pods_and_no_other_services() -> None:
    selector = inference_pool("chat", "ml", UID, PICKER)["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels("chat"))
    # User pod labels cannot pull a pod out of the pool or another service's pods into it.
    assert selects(selector, pod_labels("chat", podLabels={"app.kubernetes.io/instance": "other", "team": "a"}))
    assert not selects(selector, pod_labels("chat-2"))
    assert not selects(selector, pod_labels("cha"))


def test_the_pool_selects_what_the_service_and_the_deployment_select() -> None:
    # The Gateway's picker and the Service must see the same pods, whichever route a request takes.
    selector = inference_pool("chat", "ml", UID, PICKER)["spec"]["selector"]["matchLabels"]
    assert selector == render.service("chat", "ml", UID)["spec"]["selector"]
    assert selector == render.pod_disruption_budget("chat", "ml", UID)["spec"]["selector"]["matchLabels"]


def test_the_pool_targets_the_engine_port_the_pods_listen_on() -> None:
    pool = inference_pool("chat", "ml", UID, PICKER)
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert ports == [names.PORT]
    service_port = render.service("chat", "ml", UID)["spec"]["ports"][0]
    assert service_port["port"] == names.PORT and service_port["targetPort"] == names.PORT_NAME


def test_the_pool_is_a_child_owned_by_its_inference_service() -> None:
    pool = inference_pool("chat", "ml", UID, PICKER)
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert (API_VERSION, KIND) == (pool["apiVersion"], pool["kind"])
    meta = pool["metadata"]
    assert (meta["name"], meta["namespace"]) == ("chat", "ml")
    assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in meta["ownerReferences"]] == [
        ("InferenceService", "chat", UID, True)
    ]
    # The operator watches its children by this label, and the Service carries the same metadata.
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvpilot-operator"
    assert meta == render.service("chat", "ml", UID)["metadata"]


def test_the_endpoint_picker_defaults_to_the_extension_charts_name_and_port() -> None:
    ref = inference_pool("chat", "ml", UID, PICKER)["spec"]["endpointPickerRef"]
    assert ref == {"kind": "Service", "name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailClose"}


def test_the_endpoint_picker_is_configurable() -> None:
    picker = EndpointPickerSpec.model_validate({"name": "llm-d-epp", "port": 9003, "failureMode": "FailOpen"})
    ref = inference_pool("chat", "ml", UID, picker)["spec"]["endpointPickerRef"]
    assert ref == {"kind": "Service", "name": "llm-d-epp", "port": {"number": 9003}, "failureMode": "FailOpen"}


def test_engine_type_label_is_the_metric_dialect_the_operator_starts_engines_with() -> None:
    # llm-d's picker reads vLLM's metric names from pods labelled vllm; the engine serves them
    # only with --vllm-compatible-metrics, which render.py always passes.
    assert names.ENGINE_TYPE_LABEL == "llm-d.ai/engine-type"
    assert names.ENGINE_TYPE == "vllm"
    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"}, "accelerator": {"type": "A10G"}}
    )
    args = render.deployment("chat", "ml", UID, spec, plan(spec))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--vllm-compatible-metrics" in args
