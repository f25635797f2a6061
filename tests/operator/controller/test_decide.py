"""`observe` reads only what a decision uses; `decide` is tested on snapshots of what was read,
without a cluster."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import status_of
from kvpilot.operator.controller import render
from kvpilot.operator.controller.reconcile import Observed, decide, last_good, observe, planned_fields
from kvpilot.operator.hub.client import HubError
from kvpilot.operator.hub.safetensors import CheckpointWeights
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.sources import with_model_source
from tests.operator.controller.test_reconcile import OPERATOR_NAMESPACE, SPEC, body

SECRET_NAME = names.api_key_secret("chat")


def snapshot(spec: dict[str, Any], status: dict[str, Any] | None = None, **read: Any) -> Observed:
    """What observe would have read: the nodes, profiles and API-key Secret in `read`."""
    isvc = body(spec, status=status)
    valid: InferenceServiceSpec | ValidationError
    try:
        valid = InferenceServiceSpec.model_validate(spec)
    except ValidationError as error:
        valid = error
    kept = status_of(isvc).last_good_plan
    return Observed(isvc, valid, kept, read.get("nodes", {}), read.get("profiles", {}), read.get("secret"))


def secret(owner_uid: str = "uid-1", key: str = "k3y") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": SECRET_NAME,
            "namespace": "ml",
            "ownerReferences": [
                {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "uid": owner_uid, "controller": True}
            ],
        },
        "data": {names.API_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def kinds(wanted: list[dict[str, Any]]) -> list[str]:
    return sorted(m["kind"] for m in wanted)


def deployment(wanted: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [m for m in wanted if m["kind"] == "Deployment"]
    return found


def test_without_a_gpu_type_the_nodes_read_choose_it() -> None:
    unset = {"model": {"name": "llama-2-7b"}}
    none = decide(snapshot(unset, secret=secret()), render.DEFAULT_ENGINE_IMAGE, OPERATOR_NAMESPACE)
    assert none.result.failure == "NoGPUType" and "Deployment" not in kinds(none.wanted)
    assert none.last_good is None
    l4 = decide(snapshot(unset, nodes={"NVIDIA-L4": 8}, secret=secret()), render.DEFAULT_ENGINE_IMAGE, None)
    assert l4.result.fits and l4.result.gpu == "L4" and "Deployment" in kinds(l4.wanted)
    assert l4.last_good == last_good(
        planned_fields(with_model_source(InferenceServiceSpec.model_validate(unset))), "L4", l4.result.reasons["gpu"]
    )


def test_a_spec_that_stops_planning_keeps_the_last_good_plans_deployment_at_the_specs_replicas() -> None:
    good = decide(snapshot(SPEC, secret=secret()), render.DEFAULT_ENGINE_IMAGE, None)
    too_big = {**SPEC, "model": {"name": "llama-3-70b"}, "replicas": 3}
    assert good.last_good is not None
    status = {"lastGoodPlan": good.last_good.dump()}
    kept = decide(snapshot(too_big, status, secret=secret()), render.DEFAULT_ENGINE_IMAGE, None)
    assert not kept.result.fits and kept.result.failure == "WeightsDoNotFit"
    assert kept.last_good == good.last_good
    # (No API-key Secret was read here, so each decision made a key of its own: the pod specs compare.)
    assert deployment(kept.wanted)["spec"]["template"]["spec"] == deployment(good.wanted)["spec"]["template"]["spec"]
    assert deployment(kept.wanted)["spec"]["replicas"] == 3
    # Without a last good plan, nothing runs it.
    never = decide(snapshot(too_big, secret=secret()), render.DEFAULT_ENGINE_IMAGE, None)
    assert "Deployment" not in kinds(never.wanted)


def test_the_key_comes_from_the_secret_read_or_a_new_secret_and_a_foreign_one_blocks() -> None:
    held = decide(snapshot(SPEC, secret=secret(key="k3y")), render.DEFAULT_ENGINE_IMAGE, None)
    assert held.key.secret is None and held.key.blocked is None and "Secret" not in kinds(held.wanted)
    annotations = deployment(held.wanted)["spec"]["template"]["metadata"]["annotations"]
    assert annotations[render.API_KEY_ANNOTATION] == held.key.sha256
    new = decide(snapshot(SPEC), render.DEFAULT_ENGINE_IMAGE, None)
    assert new.key.secret is not None and "Secret" in kinds(new.wanted) and new.key.sha256 != held.key.sha256
    foreign = decide(snapshot(SPEC, secret=secret(owner_uid="someone-else")), render.DEFAULT_ENGINE_IMAGE, None)
    assert foreign.key.blocked is not None and foreign.key.blocked[0] == "NameConflict"
    assert "Secret" not in kinds(foreign.wanted)


def test_an_invalid_spec_decides_nothing_to_write() -> None:
    invalid = decide(snapshot({"model": {}}), render.DEFAULT_ENGINE_IMAGE, None)
    assert invalid.result.failure == "InvalidSpec" and "model.name" in invalid.result.reason
    assert invalid.wanted == [] and invalid.spec is None


class Reads:
    """A cluster that answers nothing and records what was asked."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.reads.append(f"{kind} {namespace}/{name}")

    def gpu_nodes(self) -> dict[str, int]:
        self.reads.append("nodes")
        return {}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # A GPU type and a runtime of one size: only the key's Secret.
        (SPEC, [f"Secret ml/{SECRET_NAME}"]),
        # The nodes choose the GPU type.
        ({"model": {"name": "llama-2-7b"}}, ["nodes", f"Secret ml/{SECRET_NAME}"]),
        # vLLM's tensor-parallel sizes are bounded by the GPUs a node carries.
        ({**SPEC, "runtime": "vllm"}, ["nodes", f"Secret ml/{SECRET_NAME}"]),
        # The user's own key: no Secret; a CPU profile of the admin's: its ConfigMap.
        (
            {**SPEC, "auth": {"apiKey": False}, "accelerator": {"type": "cpu", "profile": "pool-a"}},
            [f"ConfigMap {OPERATOR_NAMESPACE}/pool-a"],
        ),
        # An invalid spec: nothing.
        ({"model": {}}, []),
    ],
)
def test_observe_reads_only_what_the_decision_uses(spec: dict[str, Any], expected: list[str]) -> None:
    cluster = Reads()
    observe(body(spec), cluster, OPERATOR_NAMESPACE)  # type: ignore[arg-type]
    assert cluster.reads == expected


# A model the catalog lacks, known only by its repository: its config.json is read from the Hub.
HUB_SPEC = {
    "model": {"name": "tiny-chat", "source": "hf://acme/tiny-chat@v2", "tokenSecret": {"name": "hub"}},
    "accelerator": {"type": "L4"},
    "env": [{"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9999"}],
}
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


class FakeHub:
    """Answers with `config` (and `weights` bytes), or refuses with `error`; records what it was asked."""

    def __init__(
        self, config: dict[str, Any] | None = None, error: HubError | None = None, weights: int | None = None
    ) -> None:
        self.config_json, self.error, self.stored, self.asked = config, error, weights, []

    def config(self, repo: str, revision: str, token: str | None, endpoint: str | None = None) -> dict[str, Any]:
        self.asked.append((repo, revision, token, endpoint))
        if self.error is not None:
            raise self.error
        return dict(self.config_json or {})

    def weights(
        self, repo: str, revision: str, token: str | None, layers: int, endpoint: str | None = None
    ) -> CheckpointWeights | None:
        return CheckpointWeights(self.stored) if self.stored else None


class Secrets(Reads):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        super().get(api_version, kind, namespace, name)
        token = base64.b64encode(b"hf_token").decode()
        return {"data": {"token": token}} if (kind, name) == ("Secret", "hub") else None


def test_a_model_known_only_by_its_repository_is_planned_from_its_config_json() -> None:
    hub, cluster = FakeHub(LLAMA_3_8B), Secrets()
    observed = observe(body(HUB_SPEC), cluster, OPERATOR_NAMESPACE, hub)  # type: ignore[arg-type]
    # With the service's token, at the service's endpoint, at the source's revision.
    assert hub.asked == [("acme/tiny-chat", "v2", "hf_token", "http://127.0.0.1:9999")]
    assert "Secret ml/hub" in cluster.reads
    decided = decide(observed, render.DEFAULT_ENGINE_IMAGE, None)
    assert decided.result.fits and "Deployment" in kinds(decided.wanted)
    assert decided.result.reasons["model"] == "the checkpoint's config.json of hf://acme/tiny-chat@v2"
    # The same numbers as the catalog's Llama-3-8B, which has this architecture.
    catalog = decide(snapshot({**SPEC, "model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"}}), "i", None)
    assert (decided.result.weight_bytes, decided.result.kv_bytes_per_token) == (
        catalog.result.weight_bytes,
        catalog.result.kv_bytes_per_token,
    )


def test_a_checkpoint_stored_quantized_is_planned_and_served_as_stored() -> None:
    awq = {**LLAMA_3_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    stored = 5_734_000_000  # the checkpoint's safetensors total
    hub = FakeHub(awq, weights=stored)
    observed = observe(body({**HUB_SPEC, "runtime": "vllm"}), Secrets(), None, hub)  # type: ignore[arg-type]
    decided = decide(observed, render.DEFAULT_ENGINE_IMAGE, None)
    assert decided.result.fits and decided.result.quantization == "awq"
    args = deployment(decided.wanted)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--quantization") for a in args)  # vLLM reads the scheme from the checkpoint
    # vLLM holds the checkpoint as stored: its bytes are the weights, and what the download writes.
    assert decided.result.weight_bytes == decided.result.checkpoint_bytes == stored
    # Our engine repacks a W4A16 checkpoint into its own INT4 layout: counted per scheme, the download
    # still the checkpoint's.
    w4a16 = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}},
    }
    hub = FakeHub({**LLAMA_3_8B, "quantization_config": w4a16}, weights=stored)
    ours = decide(observe(body(HUB_SPEC), Secrets(), None, hub), "i", None)  # type: ignore[arg-type]
    assert ours.result.fits and ours.result.quantization == "int4", ours.result.reason
    assert ours.result.checkpoint_bytes == stored and ours.result.weight_bytes != stored


def test_what_the_hub_refuses_or_the_planner_cannot_read_is_a_failed_plan_with_the_reason() -> None:
    refused = FakeHub(error=HubError(401, "http://127.0.0.1:9999/acme/tiny-chat/resolve/v2/config.json: 401 gated"))
    no_token = {**HUB_SPEC, "model": {**HUB_SPEC["model"], "tokenSecret": {"name": "absent"}}}
    decided = decide(observe(body(no_token), Secrets(), None, refused), "i", None)  # type: ignore[arg-type]
    assert decided.result.failure == "ModelConfigUnavailable" and "Deployment" not in kinds(decided.wanted)
    assert "401 gated (asked without a token: Secret ml/absent holds no token)" in decided.result.reason
    assert refused.asked[0][2] is None
    mamba = FakeHub({**LLAMA_3_8B, "architectures": ["FalconMambaForCausalLM"]})
    unsupported = decide(observe(body(HUB_SPEC), Secrets(), None, mamba), "i", None)  # type: ignore[arg-type]
    assert unsupported.result.failure == "UnsupportedArchitecture"
    assert "FalconMambaForCausalLM is not an architecture the planner reads" in unsupported.result.reason


def test_the_hub_is_not_asked_when_the_spec_or_the_catalog_give_the_architecture() -> None:
    hub = FakeHub(LLAMA_3_8B)
    catalog = {**HUB_SPEC, "model": {**HUB_SPEC["model"], "name": "llama-3-8b"}}
    observe(body(catalog), Secrets(), None, hub)  # type: ignore[arg-type]
    explicit = {
        **HUB_SPEC,
        "model": {**HUB_SPEC["model"], "architecture": MODELS["llama-3-8b"].model_dump(by_alias=True)},
    }
    observe(body(explicit), Secrets(), None, hub)  # type: ignore[arg-type]
    assert hub.asked == []


def test_a_hub_planned_service_keeps_its_deployment_while_the_hub_is_down() -> None:
    awq = {**LLAMA_3_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    spec = {**HUB_SPEC, "runtime": "vllm"}
    good = decide(observe(body(spec), Secrets(), None, FakeHub(awq)), "i", None)  # type: ignore[arg-type]
    assert good.last_good is not None
    written = good.last_good.dump()
    assert written["checkpoint"]["quantization"] == "awq"
    assert written["checkpoint"]["architecture"]["layers"] == 32
    # The status's types (and so the CRD's schema) take it as written.
    typed = status_of({"status": {"lastGoodPlan": written}}).last_good_plan
    assert typed is not None and typed.model_dump(mode="json", by_alias=True, exclude_none=True) == written
    # The operator restarted (an empty cache) and the Hub does not answer: the config.json the
    # status kept renders the same Deployment, at the spec's replicas of now.
    down = FakeHub(error=HubError(None, "http://127.0.0.1:9999/...: no answer"))
    status = {"lastGoodPlan": written}
    kept = decide(observe(body({**spec, "replicas": 3}, status=status), Secrets(), None, down), "i", None)  # type: ignore[arg-type]
    assert kept.result.failure == "ModelConfigUnavailable" and kept.last_good == good.last_good
    # (No API-key Secret was read here, so each decision made a key of its own: the pod specs compare.)
    assert deployment(kept.wanted)["spec"]["template"]["spec"] == deployment(good.wanted)["spec"]["template"]["spec"]
    assert deployment(kept.wanted)["spec"]["replicas"] == 3


def test_a_checkpoint_stored_quantized_keeps_the_gpu_type_its_last_good_plan_chose() -> None:
    """The kept GPU type is the plan of the spec as written: the scheme its checkpoint adds does not
    make it another spec, so new node types do not roll the service."""
    awq = {**LLAMA_3_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    unset = {**HUB_SPEC, "runtime": "vllm", "accelerator": {}}
    first = decide(observe(body(unset), NodesAndSecrets({"NVIDIA-L4": 8}), None, FakeHub(awq)), "i", None)  # type: ignore[arg-type]
    assert first.result.fits and first.result.gpu == "L4" and first.last_good is not None
    status = {"lastGoodPlan": first.last_good.dump()}
    # Its L4 nodes replaced by H100 ones (the nodes choose a type only for a new plan).
    other = NodesAndSecrets({"NVIDIA-H100-80GB-HBM3": 8})
    again = decide(observe(body({**unset, "replicas": 2}, status=status), other, None, FakeHub(awq)), "i", None)  # type: ignore[arg-type]
    assert again.result.gpu == "L4" and again.result.quantization == "awq"


class NodesAndSecrets(Secrets):
    def __init__(self, nodes: dict[str, int]) -> None:
        super().__init__()
        self.nodes = nodes

    def gpu_nodes(self) -> dict[str, int]:  # type: ignore[override]
        super().gpu_nodes()
        return dict(self.nodes)
