"""The names every room of the operator shares: the API group and kind, the labels of the children
and engine pods, the engine's port and container, the GPU resource and node-label keys. Pure constants
and the functions that build labels and references from them; depends on nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

PORT = 8000
PORT_NAME = "http"
CONTAINER = "engine"

# The node label NVIDIA GPU feature discovery sets from the device name (spaces become dashes).
NVIDIA_PRODUCT_LABEL = "nvidia.com/gpu.product"
NVIDIA_GPU_RESOURCE = "nvidia.com/gpu"
# AMD's device plugin and node labeller use their own resource and label keys.
AMD_PRODUCT_LABEL = "amd.com/gpu.product-name"
AMD_GPU_RESOURCE = "amd.com/gpu"
# What a node labels its GPU count with (NVIDIA's GPU feature discovery); else its allocatable GPUs.
NVIDIA_GPU_COUNT_LABEL = "nvidia.com/gpu.count"

# Every child carries this label: the operator watches the objects that have it.
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvpilot-operator"}
# The label that names a child's (and an engine pod's) InferenceService.
INSTANCE_LABEL = "app.kubernetes.io/instance"


def labels(name: str) -> dict[str, str]:
    return {
        APP_NAME_LABEL: "kvpilot-engine",
        INSTANCE_LABEL: name,
        **MANAGED_BY,
    }


def selector_labels(name: str) -> dict[str, str]:
    return {key: labels(name)[key] for key in (APP_NAME_LABEL, INSTANCE_LABEL)}


# A mixed pool's Deployments, one per GPU type (and capacity class): `<service>-<gpu type, lower
# case>[-<class>]`, their pods labelled with the same suffix (the Service and the gateway select the
# service's pods across them).
VARIANT_LABEL = f"{GROUP}/gpu-variant"
# How a variant of a capacity class is written where one word names it (prices, messages): L4@spot.
CLASS_SEPARATOR = "@"


def variant(gpu: str, capacity_class: str | None = None) -> str:
    """A variant's label value and name suffix: its GPU type, lower case, and its capacity class
    (H100-80GB -> h100-80gb, L4 on spot nodes -> l4-spot). Without a class, what it always was:
    a pool made before capacity classes keeps its Deployments' names and selectors."""
    return f"{gpu.lower()}-{capacity_class}" if capacity_class else gpu.lower()


def variant_deployment(name: str, gpu: str, capacity_class: str | None = None) -> str:
    return f"{name}-{variant(gpu, capacity_class)}"


def variant_key(gpu: str, capacity_class: str | None = None) -> str:
    """A variant as people and the price list name it: the GPU type, with its capacity class
    (L4, L4@spot)."""
    return f"{gpu}{CLASS_SEPARATOR}{capacity_class}" if capacity_class else gpu


def label_selector(labels: Mapping[str, str]) -> str:
    """`labels` as a label selector string (`key=value,...`, sorted)."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def selector(name: str) -> str:
    """The label selector as the scale subresource's `status.selector` string."""
    return label_selector(selector_labels(name))


def service_url(name: str, namespace: str) -> str:
    """The OpenAI base URL of the engines behind the Service, as seen inside the cluster."""
    return f"http://{name}.{namespace}.svc.cluster.local:{PORT}/v1"


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


# In status.autoscaler: when the SLO autoscaler set the present 0 replicas (kept while they stay 0).
# The gateway wakes only such a zero, never a `kubectl scale --replicas=0` or one in mode off/external.
SCALED_TO_ZERO_AT = "scaledToZeroAt"

# In status.auth: the SHA-256 (hex) of the service's API key. The gateway checks a request's bearer
# token against it before reading its body and before any wake, without reading the Secret.
API_KEY_SHA256 = "apiKeySha256"
# The Secret the operator creates with a service's API key (spec.auth.apiKey), and its key.
API_KEY_SECRET_KEY = "api-key"
# On the engine pods: the digest of the key they were started with, so a new key rolls them.
API_KEY_ANNOTATION = f"{GROUP}/api-key-sha256"


def api_key_secret(name: str) -> str:
    return f"{name}-api-key"


# The readiness gate of a service with LoRA adapters: the adapter sync sets this pod condition once
# the pod holds the adapters, so Kubernetes keeps a new pod out of the Service until then.
ADAPTERS_LOADED_CONDITION = f"{GROUP}/adapters-loaded"


# The chart's operator and gateway pods (helm/kvpilot/templates: app.kubernetes.io/name): the
# peers an engine's NetworkPolicy lets in.
APP_NAME_LABEL = "app.kubernetes.io/name"
OPERATOR_APP = "kvpilot-operator"
GATEWAY_APP = "kvpilot-gateway"
# The operator's own namespace (the chart sets it from the pod's): where the gateway runs too.
OPERATOR_NAMESPACE_ENV = "KVPILOT_NAMESPACE"

# The engine pods' label that llm-d's endpoint picker reads to choose which metric names it scrapes
# (vllm, sglang, trtllm-serve, ...; unset means vllm). Both runtimes serve vLLM's names: vLLM itself,
# and our engine, which the operator always starts with --vllm-compatible-metrics.
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE = "vllm"


def child_metadata(name: str, namespace: str, uid: str) -> dict[str, Any]:
    """The metadata of every child of an InferenceService: its labels and controller reference."""
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(name),
        "ownerReferences": [owner_reference(name, uid)],
    }


# The gateway's gauge of the requests it holds for a service (labels namespace, service): waiting
# for a wake or for an engine with room. The autoscaler reads it from every gateway pod.
GATEWAY_HELD_METRIC = "kvpilot_gateway_held_requests"
