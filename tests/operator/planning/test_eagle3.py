"""EAGLE-3 heads (serving.draftModel under `speculative: eagle`) as vLLM 0.33 runs them: read from their
config.json (real heads, tests/operator/planning/eagle3_heads, sources in SOURCES.tsv), sized as vLLM
builds them, rendered as method eagle3, and refused where vLLM would not run them. vLLM's side is its
own code in the contract venv (tests/vllm/eagle3_heads.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.model_config import EAGLE3_TARGETS, FAMILIES, WRAPPERS, ModelConfig, read_config
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import PlanContext, plan
from kvpilot.operator.runtimes.vllm import speculative_config
from tests.vllm import env

HEADS = Path(__file__).parent / "eagle3_heads"
HF_CONFIGS = Path(__file__).parent / "hf_configs"
LLAMA_70B_HEAD = "sgl-project--SpecForge--llama3-70B-ealge3"
QWEN3_32B_HEAD = "sgl-project--SpecForge--qwen3-32b-eagle3"
GPT_OSS_HEAD = "sgl-project--SpecForge--gpt-oss-20B-eagle3"
SPECULATORS_HEAD = "vllm-project--speculators--issue-1065"
# Each head beside the target it was trained for.
PAIRS = {
    LLAMA_70B_HEAD: "meta-llama--Llama-3.3-70B-Instruct",
    QWEN3_32B_HEAD: "Qwen--Qwen3-32B",
    # Beside sliding-window layers: SpecForge's gpt-oss-20b head as vLLM would load it (its class named
    # LlamaForCausalLMEagle3, its model_type llama; its shapes as published).
    f"{GPT_OSS_HEAD}#llama": "openai--gpt-oss-20b",
    # A Speculators-format head with a sliding-window layer beside a full-attention target, with the
    # three aux layers vLLM 0.33 builds its fc for (as published it lists four).
    f"{SPECULATORS_HEAD}#aux3": "Qwen--Qwen3-235B-A22B",
}
# How a variant of a published head differs from it.
VARIANTS = {
    "llama": {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"},
    "aux3": {"eagle_aux_hidden_state_layer_ids": [2, 46, 91]},
}
HEAD_SOURCE = "hf://org/eagle3-head"


def head_config(name: str) -> dict[str, Any]:
    published, _, variant = name.partition("#")
    return {**json.loads((HEADS / f"{published}.json").read_text()), **VARIANTS.get(variant, {})}


def read(folder: Path, name: str, checkpoint_bytes: int | None = None) -> ModelConfig:
    config = head_config(name) if folder == HEADS else json.loads((folder / f"{name}.json").read_text())
    found = read_config(config, f"config.json of {name}")
    assert isinstance(found, ModelConfig), found
    return found._replace(architecture=found.architecture.model_copy(update={"checkpoint_bytes": checkpoint_bytes}))


@pytest.fixture(scope="module")
def vllm_heads() -> dict[str, dict[str, Any]]:
    """What vLLM 0.33 makes of each head beside its target, and which classes give EAGLE-3 its states."""
    cases = [{"id": "support", "supports_eagle3": [*FAMILIES, *WRAPPERS]}]
    pairs = {**PAIRS, SPECULATORS_HEAD: PAIRS[f"{SPECULATORS_HEAD}#aux3"]}
    cases += [
        {"id": head, "config": json.loads((HF_CONFIGS / f"{target}.json").read_text()), "head": head_config(head)}
        for head, target in pairs.items()
    ]
    out = env.run("eagle3_heads", "".join(json.dumps(case) + "\n" for case in cases))
    return {found["id"]: found for found in map(json.loads, out.splitlines())}


@pytest.mark.parametrize("head", PAIRS)
def test_a_head_is_sized_as_vllm_builds_it(head: str, vllm_heads: dict[str, dict[str, Any]]) -> None:
    found = vllm_heads[head]
    assert "error" not in found, found["error"]
    # vLLM runs it as an EAGLE-3 head under method eagle3, and has no class for a native one under method
    # eagle (a Speculators config names its class itself, whatever the method).
    assert (found["method"], found["head_class"]) == ("eagle3", "Eagle3LlamaForCausalLM")
    if not head.startswith(SPECULATORS_HEAD):
        assert "EagleLlamaForCausalLMEagle3" in found["as_eagle"] and "not supported" in found["as_eagle"]
    arch = read(HEADS, head).architecture
    assert arch.hf_architecture in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
    # Its parameters' bytes in the 16-bit dtype vLLM loads it in (the int64 token map at 8 bytes a value).
    assert sizing.weight_bytes(arch, "none") == found["parameter_bytes"]
    [layer] = found["head_layers"]
    assert layer["bytes_per_token"] == sizing.kv_bytes_per_token(arch)
    assert (layer["kind"], layer["sliding_window"]) == (
        ("SlidingWindowSpec", arch.sliding_window) if arch.sliding_window else ("FullAttentionSpec", None)
    )


def test_the_llama_70b_head_by_hand() -> None:
    arch = read(HEADS, LLAMA_70B_HEAD).architecture
    hidden, qkv = 8192, (64 + 2 * 8) * 128
    layer = 2 * hidden * qkv + 64 * 128 * hidden + 3 * hidden * 28672 + 3 * hidden  # qkv over 2 x hidden
    embedding, fc, lm_head, token_map = 128256 * hidden, 3 * hidden * hidden, 32000 * hidden, 4 * 32000
    assert arch.parameters == layer + embedding + fc + hidden + lm_head + token_map
    assert sizing.kv_bytes_per_token(arch) == 2 * 8 * 128 * 2


@pytest.mark.parametrize("head", PAIRS)
def test_vllm_holds_a_heads_kv_beside_the_targets_as_the_planner_sizes_it(
    head: str, vllm_heads: dict[str, dict[str, Any]]
) -> None:
    pool = vllm_heads[head]["pool"]
    target, drafted = read(HF_CONFIGS, PAIRS[head]).architecture, read(HEADS, head).architecture
    layout = sizing.kv_layout(target, draft=sizing.kv_bytes_per_token(drafted), draft_arch=drafted)
    assert pool["available"] // sizing.kv_block_bytes(layout, pool["block_size"]) == pool["num_blocks"]
    assert len(pool["groups"]) == layout.full_groups + layout.sliding_groups + sum(
        g.groups for g in layout.draft_groups
    )
    assert pool["blocks_per_request"] == sizing.sequence_blocks(
        layout, pool["max_model_len"], pool["block_size"], pool["max_in_flight_tokens"]
    )


def test_the_targets_an_eagle3_head_drafts_beside_are_vllms(vllm_heads: dict[str, dict[str, Any]]) -> None:
    found = vllm_heads["support"]["supports_eagle3"]

    def supports(name: str) -> bool:
        given = found[name]
        if isinstance(given, bool):
            return given
        # A wrapper this venv cannot import (its tower needs torchvision): its own declared interfaces.
        assert given[0] == "nn.Module", (name, given)
        return "SupportsEagle3" in given

    assert {name for name in found if supports(name)} == EAGLE3_TARGETS


def spec(target: str | Architecture, **serving: Any) -> InferenceServiceSpec:
    model: dict[str, Any] = {"name": target} if isinstance(target, str) else {"name": "target", "architecture": target}
    return InferenceServiceSpec.model_validate(
        {
            "model": model,
            "accelerator": {"type": "H100-80GB"},
            "runtime": "vllm",
            "serving": {"speculative": "eagle", "draftModel": HEAD_SOURCE, "maxContextLength": 8192, **serving},
        }
    )


def test_a_plan_with_a_head_renders_method_eagle3_and_counts_its_checkpoint_when_smaller() -> None:
    target = read(HF_CONFIGS, "Qwen--Qwen3-32B").architecture
    counted = read(HEADS, QWEN3_32B_HEAD)
    result = plan(spec(target), PlanContext(draft_checkpoint=counted))
    assert result.fits and result.eagle3_head, result.reason
    assert result.draft_weight_bytes == 3_011_020_800  # vLLM's bytes above, the embedding among them
    assert speculative_config(result, "/models/head") == {
        "method": "eagle3",
        "model": "/models/head",
        "num_speculative_tokens": result.num_speculative_tokens,
    }
    assert "EAGLE-3 head (vLLM's method eagle3) hf://org/eagle3-head" in result.reasons["speculative"]
    # A head published without an embedding (vLLM gives it the target's): its safetensors' bytes.
    without_embedding = 3_011_020_800 - 151936 * 5120 * 2
    stored = plan(spec(target), PlanContext(draft_checkpoint=read(HEADS, QWEN3_32B_HEAD, without_embedding)))
    assert stored.draft_weight_bytes == without_embedding and stored.eagle3_head
    # An EAGLE-1 head (a plain Llama layer) stays method eagle.
    eagle = read(HF_CONFIGS, "meta-llama--Llama-3.2-3B")
    plain = plan(spec("llama-3-8b"), PlanContext(draft_checkpoint=eagle))
    assert plain.fits and not plain.eagle3_head and speculative_config(plain, "/h")["method"] == "eagle"  # type: ignore[index]


def test_a_head_given_in_the_spec_with_its_class_plans_the_same() -> None:
    target = read(HF_CONFIGS, "Qwen--Qwen3-32B").architecture
    counted = read(HEADS, QWEN3_32B_HEAD)
    written = counted.architecture.model_dump(by_alias=True, exclude_none=True)
    assert written["hfArchitecture"] == "LlamaForCausalLMEagle3"
    given = plan(spec(target, draftModelArchitecture=written))
    assert given == plan(spec(target), PlanContext(draft_checkpoint=counted))


@pytest.mark.parametrize(
    "target, serving, failure, message",
    [
        (
            "google--gemma-3-1b-it",
            {},
            "UnsupportedByRuntime",
            "vLLM 0.33.0's Gemma3ForCausalLM does not give them",
        ),
        ("Qwen--Qwen3-32B", {"speculative": "draft"}, "UnsupportedByRuntime", "set serving.speculative eagle"),
        ("Qwen--Qwen3-32B", {"speculative": "auto"}, "UnsupportedByRuntime", "set serving.speculative eagle"),
    ],
)
def test_a_head_vllm_would_not_run_is_refused_with_the_reason(
    target: str, serving: dict[str, Any], failure: str, message: str
) -> None:
    head = QWEN3_32B_HEAD if target.startswith("Qwen") else "sgl-project--SpecForge--gemma3-1b-eagle3"
    refused = plan(
        spec(read(HF_CONFIGS, target).architecture, **serving), PlanContext(draft_checkpoint=read(HEADS, head))
    )
    assert (refused.fits, refused.failure) == (False, failure), refused.reason
    assert message in refused.reason and "serving.draftModel 'hf://org/eagle3-head'" in refused.reason


def test_a_target_of_unknown_class_is_refused_until_the_spec_names_it() -> None:
    target = read(HF_CONFIGS, "Qwen--Qwen3-32B").architecture.model_copy(update={"hf_architecture": None})
    head = PlanContext(draft_checkpoint=read(HEADS, QWEN3_32B_HEAD))
    refused = plan(spec(target), head)
    assert refused.failure == "UnsupportedByRuntime" and "set model.architecture.hfArchitecture" in refused.reason
    named = plan(spec(target.model_copy(update={"hf_architecture": "Qwen3ForCausalLM"})), head)
    assert named.fits and named.eagle3_head, named.reason
    # The catalog's models carry their class.
    assert {arch.hf_architecture for arch in MODELS.values()} <= {*FAMILIES}


def test_a_head_vllm_has_no_class_for_is_not_read() -> None:
    refused = read_config(head_config("sgl-project--SpecForge--gpt-oss-20B-eagle3"), "config.json")
    assert isinstance(refused, str) and refused.startswith("GptOssForCausalLMEagle3 is not an architecture")


@pytest.mark.parametrize("head", PAIRS)
def test_the_rendered_pod_is_a_command_line_vllm_configures_with_the_head(head: str) -> None:
    target = PAIRS[head]
    served = InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {
                "name": "target",
                "source": f"/models/{target}",
                "architecture": read(HF_CONFIGS, target).architecture.model_dump(by_alias=True, exclude_none=True),
            },
            "accelerator": {"type": "H100-80GB"},
            "serving": {"speculative": "eagle", "draftModel": f"/heads/{head}", "maxContextLength": 8192},
        }
    )
    result = plan(served, PlanContext(draft_checkpoint=read(HEADS, head)))
    assert result.fits and result.eagle3_head, result.reason
    args = render.deployment("svc", "ns", "uid", served, result)["spec"]["template"]["spec"]["containers"][0]["args"]
    models = {
        f"/models/{target}": json.loads((HF_CONFIGS / f"{target}.json").read_text()),
        f"/heads/{head}": head_config(head),
    }
    [answer] = map(
        json.loads,
        env.run("engine_configs", json.dumps({"id": head, "argv": args, "models": models}) + "\n").splitlines(),
    )
    assert answer["ok"], answer["error"]
    assert (answer["speculative_method"], answer["draft_model"]) == ("eagle3", f"/heads/{head}")
    assert (answer["tensor_parallel_size"], answer["max_model_len"]) == (result.gpu_count, result.max_model_len)


def test_a_head_vllm_builds_for_fewer_aux_layers_than_it_lists_is_refused(
    vllm_heads: dict[str, dict[str, Any]],
) -> None:
    # As published it lists four of the target's layers; vLLM 0.33 builds the same head as for three
    # (its fc over 3 x 4096), which the checkpoint's fc (4 x 4096) would not load into.
    assert vllm_heads[SPECULATORS_HEAD]["parameter_bytes"] == vllm_heads[f"{SPECULATORS_HEAD}#aux3"]["parameter_bytes"]
    refused = read_config(head_config(SPECULATORS_HEAD), "config.json")
    assert isinstance(refused, str), refused
    assert "lists 4 of the target's layers" in refused and "builds its fc for 3" in refused


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"speculators_model_type": "dflash"}, "a Speculators-format dflash head"),
        ({"transformer_layer_config": {"model_type": "qwen3"}}, "over a qwen3 layer"),
    ],
)
def test_a_speculators_head_the_planner_does_not_count_is_refused_with_what_to_give(
    change: dict[str, Any], refusal: str
) -> None:
    refused = read_config({**head_config(SPECULATORS_HEAD), **change}, "config.json")
    assert isinstance(refused, str) and refusal in refused and "serving.draftModelArchitecture" in refused
