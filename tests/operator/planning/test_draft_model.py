"""A draft model (serving.draftModel): sized by the planner beside the target, delivered into the pod
like the target's own files, passed to the engine as --draft-model; and the specs that cannot run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.engine.cli import build_parser, engine_config_from_args
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.controller.checkpoint import draft_to_read
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.model_config import ModelConfig, read_config
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import PlanContext, plan

UID = "0b7c6e1e-0000-4000-8000-000000000003"
TINYLLAMA = "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"
LLAMA_3_2_1B = "hf://meta-llama/Llama-3.2-1B-Instruct"


def spec(
    model: str = "llama-2-7b", gpu: str = "A10G", model_fields: dict[str, Any] | None = None, **overrides: Any
) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {"model": {"name": model, **(model_fields or {})}, "accelerator": {"type": gpu}, **overrides}
    )


def drafting(draft: str = TINYLLAMA, **serving: Any) -> dict[str, Any]:
    return {"speculative": "draft", "draftModel": draft, **serving}


def pod(s: InferenceServiceSpec) -> dict[str, Any]:
    p = plan(s)
    assert p.fits, p.reason
    return render.deployment("chat", "ml", UID, s, p, default_image="reg/kvpilot:1")["spec"]["template"]["spec"]


def engine_flags(pod_spec: dict[str, Any]) -> Any:
    """The engine container's arguments as `kvpilot serve` parses them."""
    args = build_parser("serve").parse_args(["serve", *pod_spec["containers"][0]["args"]])
    return engine_config_from_args(args)


# The planner's memory arithmetic, by hand.


def test_the_draft_takes_its_weights_and_its_kv_slots_out_of_the_target_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing reserved beside weights and KV, so every byte below is accounted for.
    monkeypatch.setattr(sizing, "RUNTIME_OVERHEAD_BYTES", 0)
    monkeypatch.setattr(sizing, "ACTIVATION_BYTES_PER_HIDDEN", 0)
    serving = {"maxContextLength": 4096, "gpuMemoryUtilization": 1.0, "quantization": "none"}
    alone = plan(spec("llama-3-8b", serving={**serving, "speculative": "off"}))
    result = plan(spec("llama-3-8b", serving=drafting(LLAMA_3_2_1B, **serving)))
    assert result.fits and result.speculative == "draft" and result.draft_model == LLAMA_3_2_1B

    usable = 22589 * 2**20  # the A10G's reported memory, all of it
    target = 8_030_261_248 * 2  # Llama-3-8B at 16 bits
    draft = 1_235_814_400 * 2  # Llama-3.2-1B at 16 bits: the engine never quantizes a draft
    assert (result.weight_bytes, result.draft_weight_bytes) == (target + draft, draft)
    # Every KV slot holds the target's K and V (32 layers x 8 heads x 128) and the draft's (16 x 8 x 64).
    target_kv, draft_kv = 2 * 32 * 8 * 128 * 2, 2 * 16 * 8 * 64 * 2
    assert (result.kv_bytes_per_token, result.draft_kv_bytes_per_token) == (target_kv + draft_kv, draft_kv)
    pool = usable - target - draft
    assert result.kv_pool_bytes == pool == 5_154_131_968
    assert result.kv_blocks == pool // ((target_kv + draft_kv) * 16) == 1966
    # A sequence at the mean context (512 + 256 / 2 = 640 tokens) also holds 4 lookahead slots for
    # the tokens the draft writes ahead: 41 blocks of 16, not 40.
    assert result.max_num_seqs == 1966 // 41 == 47
    # The target alone: all of its pool is the target's.
    assert alone.kv_pool_bytes == usable - target and alone.kv_blocks == (usable - target) // (target_kv * 16) == 3636
    assert alone.max_num_seqs == 3636 // 40 == 90
    assert "0.125 target + 0.0312 draft" in result.reasons["kvCache"]
    assert "- draft model weights 2.3 GiB" in result.reasons["kvCache"]
    assert "0.44 of drafts accepted, assumed (not measured)" in result.reasons["speculative"]


def test_the_pod_requests_host_memory_for_the_draft_weights_too() -> None:
    serving = {"maxContextLength": 4096, "quantization": "none"}
    alone = pod(spec("llama-3-8b", serving={**serving, "speculative": "off"}))
    both = pod(spec("llama-3-8b", serving=drafting(LLAMA_3_2_1B, **serving)))
    # ceil((14.96 + 2) GiB) and ceil((14.96 + 2.30 + 2) GiB): weights, draft weights, margin.
    assert alone["containers"][0]["resources"]["requests"]["memory"] == "17Gi"
    assert both["containers"][0]["resources"]["requests"]["memory"] == "20Gi"


def test_a_draft_that_does_not_fit_is_a_clear_no_when_pinned_and_left_out_when_auto() -> None:
    # Llama-2-7B at 16 bits on an A10G: 12.6 GiB of weights. At 65 % of its memory (14.6 GiB) the
    # target fits short sequences, but its 2.0 GiB TinyLlama draft leaves no room for the reserve.
    short = {"quantization": "none", "gpuMemoryUtilization": 0.65, "maxContextLength": 512}
    assert plan(spec(serving={**short, "speculative": "off"})).fits
    pinned = plan(spec(serving=drafting(**short)))
    assert (pinned.fits, pinned.failure) == (False, "WeightsDoNotFit")
    assert "none weights 12.6 GiB + draft model weights 2.0 GiB + runtime reserve" in pinned.reason
    # At 75 % the target holds one 4096-token sequence; with the draft, 1.2 GiB is left for 2.1 GiB.
    tight = {"quantization": "none", "gpuMemoryUtilization": 0.75}
    assert plan(spec(serving={**tight, "speculative": "off"})).fits
    pinned = plan(spec(serving=drafting(**tight)))
    assert (pinned.fits, pinned.failure) == (False, "ContextDoesNotFit")
    assert "one 4096-token sequence with its draft's KV and 4 lookahead slots needs 2.1 GiB" in pinned.reason
    # Under auto the target runs without it, and says why.
    auto = plan(spec(serving={**tight, "draftModel": TINYLLAMA}, load={"requestsPerSecond": 0.2, "temperature": 0}))
    assert auto.fits and auto.speculative == "ngram" and auto.draft_model is None and auto.draft_weight_bytes == 0
    assert "(the draft model does not fit: one 4096-token sequence" in auto.reasons["speculative"]
    # With room for it, auto runs the draft it was given.
    roomy = plan(
        spec(gpu="H100-80GB", serving={"draftModel": TINYLLAMA}, load={"requestsPerSecond": 0.2, "temperature": 0})
    )
    assert roomy.speculative == "draft" and roomy.draft_weight_bytes == 1_100_048_384 * 2


def test_the_drafts_time_counts_in_the_predicted_tpot() -> None:
    # Llama-3-8B with its 1B draft against n-gram drafts: the draft model's k decode steps read its
    # weights k times per step, so at the same acceptance it would be slower; the assumed 0.7 against
    # n-grams' 0.29 still wins.
    load = {"requestsPerSecond": 0.2, "temperature": 0}
    draft = plan(spec("llama-3-8b", "H100-80GB", serving=drafting(LLAMA_3_2_1B), load=load))
    ngram = plan(spec("llama-3-8b", "H100-80GB", serving={"speculative": "ngram"}, load=load))
    off = plan(spec("llama-3-8b", "H100-80GB", serving={"speculative": "off"}, load=load))
    assert draft.predicted_tpot_ms < ngram.predicted_tpot_ms < off.predicted_tpot_ms
    # The draft computes each prompt too: a longer TTFT.
    assert draft.predicted_ttft_ms > ngram.predicted_ttft_ms


# What the engine allocates, against the planner.


def test_the_planners_draft_bytes_are_what_the_engine_allocates(tmp_path: Path) -> None:
    """A small INT4 target and a small draft of its vocabulary, loaded by the engine's model runner
    with a draft: its weight bytes and its KV bytes per slot are the planner's (RoPE's frequency
    tables aside), and so is its block count for a given KV budget."""
    pytest.importorskip("torch")
    from kvpilot.engine.contract.config import EngineConfig
    from kvpilot.engine.worker.model_runner import ModelRunner
    from tests.operator.planning.small_llama import TWO_LAYERS, small_llama

    target = small_llama(tmp_path / "target", **TWO_LAYERS)
    draft = small_llama(
        tmp_path / "draft",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    budget = 1 << 20
    runner = ModelRunner(
        EngineConfig(
            model=str(tmp_path / "target"),
            dtype="bfloat16",
            device="cpu",
            quantization="int4",
            speculative="draft",
            draft_model=str(tmp_path / "draft"),
            kv_cache_memory_bytes=budget,
        ),
        tmp_path / "target",
    )
    kv_per_token = sizing.kv_bytes_per_token(target) + sizing.kv_bytes_per_token(draft)
    assert runner.kv_bytes_per_token == kv_per_token
    assert runner.num_blocks == budget // (kv_per_token * 16)
    rope = sum(
        t.numel() * t.element_size() for m in (runner.model, runner.draft_model) for t in m.model.rotary_emb.buffers()
    )
    assert runner.weight_bytes - rope == sizing.weight_bytes(target, "int4") + sizing.weight_bytes(draft, "none")


# Delivering the draft's files into the pod.


def test_an_hf_draft_is_downloaded_by_its_own_init_container_into_the_shared_cache() -> None:
    p = pod(
        spec(
            model_fields={
                "source": "hf://meta-llama/Llama-2-7b-hf",
                "tokenSecret": {"name": "hf"},
                "cache": {"claimName": "models"},
            },
            serving=drafting(),
        )
    )
    model_init, draft_init = p["initContainers"]
    assert (model_init["name"], draft_init["name"]) == ("download", "download-draft")
    download = build_parser("download")
    model_args = download.parse_args(["download", *model_init["args"]])
    draft_args = download.parse_args(["download", *draft_init["args"]])
    assert (draft_args.repo, draft_args.revision) == ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "main")
    engine = engine_flags(p)
    assert (engine.model, engine.draft_model) == (model_args.local_dir, draft_args.local_dir)
    assert engine.draft_model == "/model-cache/hf/TinyLlama/TinyLlama-1.1B-Chat-v1.0@main"
    assert (engine.speculative, engine.num_speculative_tokens) == ("draft", 4)
    # One cache volume (the claim), mounted once in the engine; both downloads get the token.
    assert [v for v in p["volumes"] if v["name"] == "model-cache"] == [
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    ]
    assert p["containers"][0]["volumeMounts"] == [
        {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert token in model_init["env"] and token in draft_init["env"]
    assert draft_init["command"] == ["kvpilot", "download"] and draft_init["image"] == "reg/kvpilot:1"


def test_an_hf_draft_beside_a_model_on_a_claim_gets_the_cache_and_the_token() -> None:
    p = pod(
        spec(model_fields={"source": "pvc://weights/llama-2-7b", "tokenSecret": {"name": "hf"}}, serving=drafting())
    )
    (init,) = p["initContainers"]
    assert init["name"] == "download-draft"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert p["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        # Only the draft is downloaded: TinyLlama's 2.0 GiB x 1.1 + 1 GiB, twice for a 32-bit checkpoint.
        {"name": "model-cache", "emptyDir": {"sizeLimit": "7Gi"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    engine = engine_flags(p)
    assert (engine.model, engine.draft_model) == (
        "/models/weights/llama-2-7b",
        "/model-cache/hf/TinyLlama/TinyLlama-1.1B-Chat-v1.0@main",
    )


@pytest.mark.parametrize(
    "draft, volumes, draft_path",
    [
        # The model's claim: its volume and mount serve the draft too.
        ("pvc://weights/tinyllama-1.1b", ["model"], "/models/weights/tinyllama-1.1b"),
        ("pvc://drafts/tinyllama-1.1b", ["model", "draft-model"], "/models/drafts/tinyllama-1.1b"),
        ("/opt/models/tinyllama-1.1b", ["model"], "/opt/models/tinyllama-1.1b"),
    ],
)
def test_a_draft_on_a_claim_or_in_the_image_is_mounted_or_used_as_it_is(
    draft: str, volumes: list[str], draft_path: str
) -> None:
    p = pod(spec(model_fields={"source": "pvc://weights/llama-2-7b"}, serving=drafting(draft)))
    assert "initContainers" not in p
    assert [v["name"] for v in p["volumes"]] == [*volumes, "tmp"]
    mounts = {m["mountPath"]: m for m in p["containers"][0]["volumeMounts"]}
    assert len(mounts) == len(p["containers"][0]["volumeMounts"])  # no mount path twice
    assert all(m.get("readOnly") for path, m in mounts.items() if path != "/tmp")
    assert engine_flags(p).draft_model == draft_path
    if "draft-model" in volumes:
        assert p["volumes"][1] == {
            "name": "draft-model",
            "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True},
        }
        assert mounts["/models/drafts"]["name"] == "draft-model"


def test_a_draft_the_plan_does_not_run_is_not_delivered() -> None:
    p = pod(
        spec(
            model_fields={"source": "hf://meta-llama/Llama-2-7b-hf"},
            serving={"speculative": "ngram", "draftModel": TINYLLAMA},
        )
    )
    assert [c["name"] for c in p["initContainers"]] == ["download"]
    engine = engine_flags(p)
    assert (engine.speculative, engine.draft_model) == ("ngram", None)


# Specs that cannot run a draft: refused by the schema, or planned as a clear no.


@pytest.mark.parametrize(
    "serving, message",
    [
        ({"speculative": "draft"}, "speculative 'draft' needs serving.draftModel"),
        ({"speculative": "eagle"}, "speculative 'eagle' needs serving.draftModel"),
        (drafting("tinyllama-1.1b"), "serving.draftModel 'tinyllama-1.1b' must be hf://org/repo[@revision]"),
        (drafting("s3://bucket/draft"), "must be hf://org/repo[@revision], pvc://claim/path or an absolute path"),
        (
            {
                "draftModelArchitecture": {
                    "layers": 1,
                    "hiddenSize": 64,
                    "attentionHeads": 1,
                    "kvHeads": 1,
                    "vocabSize": 32000,
                    "parameters": 1,
                    "maxContext": 1,
                }
            },
            "serving.draftModelArchitecture needs serving.draftModel",
        ),
    ],
)
def test_the_spec_refuses_what_the_crd_refuses(serving: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        spec(serving=serving)


def test_the_crd_has_the_draft_rules() -> None:
    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "crds" / "inferenceservice.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    serving = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["serving"]
    rules = {r["rule"]: r["message"] for r in serving["x-kubernetes-validations"]}
    assert (
        rules["!has(self.draftModelArchitecture) || has(self.draftModel)"]
        == "serving.draftModelArchitecture needs serving.draftModel"
    )
    model = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert (
        serving["properties"]["draftModelArchitecture"]["properties"]
        == model["properties"]["architecture"]["properties"]
    )


def test_a_draft_not_in_the_catalog_needs_its_architecture() -> None:
    unknown = plan(spec(serving=drafting("pvc://weights/my-draft")))
    assert (unknown.fits, unknown.failure) == (False, "UnknownDraftModel")
    assert "serving.draftModel 'pvc://weights/my-draft' is not a catalog model" in unknown.reason
    assert "serving.draftModelArchitecture is not set" in unknown.reason
    # In auto the spec still names a draft the planner cannot size: the same no, not a silent n-gram.
    assert plan(spec(serving={"draftModel": "pvc://weights/my-draft"})).failure == "UnknownDraftModel"
    # Pinned to a mode without a draft, the draft is not looked at.
    assert plan(spec(serving={"speculative": "ngram", "draftModel": "pvc://weights/my-draft"})).fits
    # Its architecture (from its config.json) sizes it: TinyLlama's, under another name.
    tiny = MODELS["tinyllama-1.1b"].model_dump(by_alias=True, exclude={"source"})
    named = plan(spec(serving=drafting("pvc://weights/my-draft", draftModelArchitecture=tiny)))
    assert named.fits and named.draft_weight_bytes == plan(spec(serving=drafting())).draft_weight_bytes


def test_catalog_drafts_are_found_by_repository_or_folder_name() -> None:
    for source in (
        TINYLLAMA,
        "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0@v1.0",
        "pvc://weights/tinyllama-1.1b/",
        "/opt/TinyLlama-1.1B-Chat-v1.0",
    ):
        assert plan(spec(serving=drafting(source))).draft_weight_bytes == 2 * MODELS["tinyllama-1.1b"].parameters


def test_a_draft_of_another_vocabulary_is_refused_as_the_engine_would() -> None:
    result = plan(spec(serving=drafting("hf://HuggingFaceTB/SmolLM2-135M-Instruct")))
    assert (result.fits, result.failure) == (False, "DraftVocabularyMismatch")
    assert "a vocabulary of 49152 tokens and llama-2-7b 32000" in result.reason
    assert isinstance(result, Plan) and result.draft_model is None


# A draft known by its checkpoint's config.json (read by the operator from the Hub, a claim or the
# engine image: tests/operator/controller/test_draft_checkpoint.py), as the target can be.

HF_CONFIGS = Path(__file__).parent / "hf_configs"
LLAMA_3_2_3B = "hf://meta-llama/Llama-3.2-3B"


def config_json(name: str, **stored: Any) -> ModelConfig:
    """A real config.json of tests/operator/planning/hf_configs read as the operator reads it, with the
    checkpoint's bytes (and scheme) `stored` gives."""
    read = read_config(json.loads((HF_CONFIGS / f"{name}.json").read_text()), f"config.json of {name}")
    assert isinstance(read, ModelConfig), read
    architecture = read.architecture.model_copy(update={"checkpoint_bytes": stored.get("bytes")})
    return ModelConfig(architecture, stored.get("scheme", read.quantization))


def test_a_draft_known_by_its_config_json_is_sized_from_it() -> None:
    draft = config_json("meta-llama--Llama-3.2-3B")
    drafted = spec("llama-3-8b", "H100-80GB", serving=drafting(LLAMA_3_2_3B, maxContextLength=8192))
    result = plan(drafted, PlanContext(draft_checkpoint=draft))
    assert result.fits and (result.speculative, result.draft_model) == ("draft", LLAMA_3_2_3B), result.reason
    # Llama-3.2-3B by hand: 3,212,749,824 parameters (its head tied to the embedding) at 16 bits; K and V
    # of 28 layers x 8 heads x 128 at 16 bits per token.
    assert (result.draft_weight_bytes, result.draft_kv_bytes_per_token) == (3_212_749_824 * 2, 2 * 28 * 8 * 128 * 2)
    assert f"draft model {LLAMA_3_2_3B}: 6.0 GiB of weights (unquantized)" in result.reasons["speculative"]
    # The same architecture written in the spec plans the same; what the spec or the catalog give wins.
    written = draft.architecture.model_dump(by_alias=True, exclude_none=True)
    given = spec(
        "llama-3-8b", "H100-80GB", serving=drafting(LLAMA_3_2_3B, maxContextLength=8192, draftModelArchitecture=written)
    )
    assert plan(given, PlanContext(draft_checkpoint=config_json("meta-llama--Llama-3.2-3B", bytes=1))) == result
    catalog = plan(spec(serving=drafting()), PlanContext(draft_checkpoint=draft))
    assert catalog.draft_weight_bytes == 2 * MODELS["tinyllama-1.1b"].parameters


def test_a_draft_stored_quantized_is_held_as_stored_by_vllm_and_refused_by_our_engine() -> None:
    stored = 3_500_000_000  # an FP8 Llama-3.2-3B's safetensors total
    fp8 = config_json("meta-llama--Llama-3.2-3B", bytes=stored, scheme="fp8")
    drafted = {"maxContextLength": 8192, **drafting(LLAMA_3_2_3B)}
    vllm = plan(spec("llama-3-8b", "H100-80GB", runtime="vllm", serving=drafted), PlanContext(draft_checkpoint=fp8))
    assert vllm.fits and vllm.speculative == "draft" and vllm.draft_weight_bytes == stored, vllm.reason
    assert "3.3 GiB of weights (as stored)" in vllm.reasons["speculative"]
    unknown = fp8._replace(architecture=fp8.architecture.model_copy(update={"checkpoint_bytes": None}))
    unsized = plan(
        spec("llama-3-8b", "H100-80GB", runtime="vllm", serving=drafted), PlanContext(draft_checkpoint=unknown)
    )
    assert (unsized.fits, unsized.failure) == (False, "InvalidArchitecture")
    assert "stored as fp8, sized from its safetensors' bytes, which are not known" in unsized.reason
    ours = plan(spec("llama-3-8b", "H100-80GB", serving=drafted), PlanContext(draft_checkpoint=fp8))
    assert (ours.fits, ours.failure) == (False, "UnsupportedByRuntime")
    assert "it is stored as fp8, and runtime kvpilot loads a draft at 16 bits" in ours.reason


def test_a_draft_the_runtime_cannot_draft_with_is_refused_by_what_it_holds() -> None:
    # A hybrid's per-sequence state cannot be rolled back past rejected drafts, on either runtime.
    hybrid = config_json("Qwen--Qwen3-Next-80B-A3B-Thinking")
    serving = drafting("hf://Qwen/Qwen3-Next-80B-A3B-Thinking")
    for runtime in ("kvpilot", "vllm"):
        refused = plan(
            spec("llama-3-70b", "H100-80GB", runtime=runtime, serving=serving), PlanContext(draft_checkpoint=hybrid)
        )
        assert (refused.fits, refused.failure) == (False, "UnsupportedByRuntime")
        assert "it has 36 gated_deltanet layers that keep a state per sequence" in refused.reason
    # Sliding-window layers: our engine runs only decoders that attend to the whole sequence.
    gemma = config_json("google--gemma-2-2b-it")
    target = {"vocabSize": gemma.architecture.vocab_size}
    windowed = spec(
        "gemma-target",
        "H100-80GB",
        model_fields={"architecture": MODELS["llama-3-8b"].model_dump(by_alias=True) | target},
        serving=drafting("hf://google/gemma-2-2b-it"),
    )
    refused = plan(windowed, PlanContext(draft_checkpoint=gemma))
    assert refused.failure == "UnsupportedByRuntime" and "sliding-window layers (window 4096)" in refused.reason
    # A plain decoder of a class our engine does not build (Qwen3): vLLM drafts with it, ours would not load it.
    qwen3 = config_json("Qwen--Qwen3-8B")
    for runtime in ("kvpilot", "vllm"):
        beside_qwen3 = spec(
            "qwen3-target",
            "H100-80GB",
            runtime=runtime,
            model_fields={"architecture": MODELS["llama-3-8b"].model_dump(by_alias=True) | {"vocabSize": 151936}},
            serving=drafting("hf://Qwen/Qwen3-8B"),
        )
        drafted = plan(beside_qwen3, PlanContext(draft_checkpoint=qwen3))
        if runtime == "vllm":
            assert drafted.fits and drafted.speculative == "draft", drafted.reason
        else:
            assert drafted.failure == "UnsupportedByRuntime", drafted.reason
            assert "it is a Qwen3ForCausalLM, and runtime kvpilot loads only LlamaForCausalLM" in drafted.reason


def test_a_windowed_draft_beside_sparse_attention_is_refused_as_not_sized() -> None:
    """GLM-5's indexer keys and latents beside a draft's sliding-window layers: vLLM groups those pages
    among one another in a way the planner does not size, so the plan says so instead of a guess."""
    glm5 = config_json("zai-org--GLM-5")
    gemma = config_json("google--gemma-2-2b-it")
    target = glm5.architecture.model_dump(by_alias=True) | {"vocabSize": gemma.architecture.vocab_size}
    beside = spec(
        "glm-5",
        "H200",
        runtime="vllm",
        model_fields={"architecture": target},
        serving=drafting("hf://google/gemma-2-2b-it"),
    )
    refused = plan(beside, PlanContext(draft_checkpoint=gemma))
    assert refused.failure == "UnsupportedByRuntime", refused.reason
    assert "it has windowed layers, which the planner does not size beside sparse attention" in refused.reason


@pytest.mark.parametrize(
    "serving, runtime, adapters, read",
    [
        (drafting(LLAMA_3_2_3B), "kvpilot", False, True),
        ({"draftModel": LLAMA_3_2_3B}, "kvpilot", False, True),  # auto may choose it
        ({"speculative": "eagle", "draftModel": LLAMA_3_2_3B}, "vllm", False, True),
        ({"speculative": "ngram", "draftModel": LLAMA_3_2_3B}, "kvpilot", False, False),
        ({"speculative": "off", "draftModel": LLAMA_3_2_3B}, "vllm", False, False),
        ({"draftModel": LLAMA_3_2_3B}, "kvpilot", True, False),  # beside adapters our engine drafts no model
        ({"draftModel": LLAMA_3_2_3B}, "vllm", True, True),
        (drafting(TINYLLAMA), "kvpilot", False, False),  # the catalog's
        (
            drafting(LLAMA_3_2_3B, draftModelArchitecture=MODELS["llama-3.2-1b"].model_dump(by_alias=True)),
            "vllm",
            False,
            False,
        ),
    ],
)
def test_a_drafts_checkpoint_is_read_only_when_a_plan_may_run_it_and_nothing_describes_it(
    serving: dict[str, Any], runtime: str, adapters: bool, read: bool
) -> None:
    lora = {"adapters": [{"name": "a", "source": "/adapters/a"}]} if adapters else {}
    drafted = spec("llama-3-8b", "H100-80GB", runtime=runtime, serving=serving, **lora)
    assert draft_to_read(drafted) == (LLAMA_3_2_3B if read else None)
