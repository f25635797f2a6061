"""Scenario 3: the API server itself refuses invalid InferenceServices, with a clear message, from
the CRD's structural schema and its CEL rules; nothing reaches the operator."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster

GOOD: dict[str, Any] = {"model": {"name": "llama-2-7b"}, "accelerator": {"type": "A10G"}}


def _with(path: str, value: Any) -> dict[str, Any]:
    """GOOD with `value` at the dotted `path` (a new dict; GOOD is untouched)."""
    spec = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return spec


LLAMA_ARCH = {
    "layers": 32,
    "hiddenSize": 4096,
    "attentionHeads": 32,
    "vocabSize": 32000,
    "parameters": 6_738_415_616,
    "maxContext": 4096,
}

# (id, spec, what the API server must say)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no-model", {"accelerator": {"type": "A10G"}}, "spec.model: Required value"),
    (
        "empty-model-name",
        _with("model.name", ""),
        'spec.model.name: Invalid value: "": spec.model.name in body should be at least 1 chars long',
    ),
    (
        "unknown-quantization",
        _with("serving.quantization", "fp3"),
        'spec.serving.quantization: Unsupported value: "fp3"',
    ),
    ("block-size-not-power-of-two", _with("serving.blockSize", 24), "blockSize must be a power of two up to 1024"),
    (
        "draft-without-draft-model",
        _with("serving.speculative", "draft"),
        "speculative 'draft' or 'eagle' needs draftModel",
    ),
    (
        "min-above-max-replicas",
        _with("autoscaling", {"minReplicas": 5, "maxReplicas": 2}),
        "minReplicas must be <= maxReplicas",
    ),
    ("zero-ttft-slo", _with("slo.ttftP95Ms", 0), "ttftP95Ms must be positive"),
    ("negative-tpot-slo", _with("slo.tpotP95Ms", -5), "tpotP95Ms must be positive"),
    (
        "gpu-memory-utilization-above-1",
        _with("serving.gpuMemoryUtilization", 1.5),
        "spec.serving.gpuMemoryUtilization: Invalid value: 1.5: "
        "spec.serving.gpuMemoryUtilization in body should be less than or equal to 1",
    ),
    (
        "node-selector-without-gpu-type",
        {
            "model": {"name": "llama-2-7b"},
            "accelerator": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}},
        },
        "accelerator.nodeSelector needs accelerator.type",
    ),
    ("zero-gpus", _with("accelerator.count", 0), "spec.accelerator.count in body should be greater than or equal to 1"),
    ("negative-replicas", _with("replicas", -1), "spec.replicas in body should be greater than or equal to 0"),
    ("a-million-replicas", _with("replicas", 1_000_000), "spec.replicas in body should be less than or equal to 1000"),
    (
        "max-replicas-above-1000",
        _with("autoscaling.maxReplicas", 1001),
        "spec.autoscaling.maxReplicas in body should be less than or equal to 1000",
    ),
    (
        "replicas-above-max-in-slo-mode",
        {**GOOD, "replicas": 9, "autoscaling": {"maxReplicas": 4}},
        "replicas must be <= autoscaling.maxReplicas in autoscaling mode slo",
    ),
    (
        "kv-heads-not-dividing-heads",
        _with("model.architecture", {**LLAMA_ARCH, "kvHeads": 5}),
        "attentionHeads must be a multiple of kvHeads",
    ),
    (
        "architecture-missing-fields",
        _with("model.architecture", {"layers": 32}),
        "spec.model.architecture.hiddenSize: Required value",
    ),
    (
        "model-name-not-a-string",
        _with("model.name", 7),
        'spec.model.name: Invalid value: "integer": spec.model.name in body must be of type string',
    ),
    (
        "variants-beside-type",
        _with("accelerator.variants", [{"type": "L4"}, {"type": "H100-80GB"}]),
        "accelerator.variants replaces type, count and nodeSelector",
    ),
    (
        "a-gpu-type-twice",
        {**GOOD, "accelerator": {"variants": [{"type": "L4"}, {"type": "L4", "maxReplicas": 2}]}},
        "accelerator.variants: each (type, capacityClass) once",
    ),
    (
        "a-gpu-type-twice-on-one-capacity-class",
        {**GOOD, "accelerator": {"variants": [{"type": "L4", "capacityClass": "spot"}] * 2}},
        "accelerator.variants: each (type, capacityClass) once",
    ),
    (
        "a-cpu-variant",
        {**GOOD, "accelerator": {"variants": [{"type": "cpu"}]}},
        "accelerator.variants[].type: a GPU type",
    ),
    (
        "bad-toleration-operator",
        _with("tolerations", [{"key": "gpu", "operator": "Maybe"}]),
        'spec.tolerations[0].operator: Unsupported value: "Maybe"',
    ),
]


@pytest.mark.parametrize("spec, message", [(s, m) for _, s, m in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_spec_is_rejected_with_a_clear_message(
    k8s: Cluster, kvpilot: Installation, spec: dict[str, Any], message: str
) -> None:
    ns = kvpilot.watch_namespaces[0]
    obj = kvis.manifest("invalid", ns, spec)
    result = k8s.kubectl("create", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert result.returncode != 0, result.stdout
    assert 'InferenceService "invalid" is invalid' in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert k8s.kubectl("get", "inferenceservice", "invalid", "-n", ns, check=False).returncode != 0


def test_the_valid_base_spec_is_accepted_with_defaults(k8s: Cluster, kvpilot: Installation) -> None:
    # Without this, a typo in GOOD would make every case above pass for the wrong reason.
    ns = kvpilot.watch_namespaces[0]
    out = k8s.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(kvis.manifest("valid", ns, GOOD))
    )
    stored = yaml.safe_load(out.stdout)["spec"]
    assert stored["serving"]["blockSize"] == 16 and stored["autoscaling"]["maxReplicas"] == 4


def test_one_gpu_type_on_several_capacity_classes_is_accepted(k8s: Cluster, kvpilot: Installation) -> None:
    # The uniqueness rule is on (type, capacityClass): spot, on-demand and any node of L4 are three variants.
    ns = kvpilot.watch_namespaces[0]
    variants = [{"type": "L4", "capacityClass": "spot"}, {"type": "L4", "capacityClass": "on-demand"}, {"type": "L4"}]
    spec = {"model": GOOD["model"], "accelerator": {"variants": variants}}
    out = k8s.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(kvis.manifest("classes", ns, spec))
    )
    assert yaml.safe_load(out.stdout)["spec"]["accelerator"]["variants"] == variants


NAME_RULE = (
    "metadata.name must be a DNS-1035 label (at most 63 characters: lower-case letters, digits "
    "and '-', starting with a letter and ending with a letter or digit), because the "
    "InferenceService's Service takes its name"
)


# Names Kubernetes takes for a custom resource (a DNS-1123 subdomain) that no Service could have.
@pytest.mark.parametrize("name", ["7b-chat", "llama.v2", "x" * 64], ids=["digit-first", "dot", "64-chars"])
def test_a_name_no_service_could_have_is_rejected(k8s: Cluster, kvpilot: Installation, name: str) -> None:
    ns = kvpilot.watch_namespaces[0]
    result = k8s.kubectl("create", "-f", "-", input=yaml.safe_dump(kvis.manifest(name, ns, GOOD)), check=False)
    assert result.returncode != 0, result.stdout
    assert f'InferenceService "{name}" is invalid' in result.stderr, result.stderr
    assert NAME_RULE in result.stderr, result.stderr
    assert k8s.kubectl("get", "inferenceservice", name, "-n", ns, check=False).returncode != 0
