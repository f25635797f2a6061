from typing import Any, get_args

import pytest

from kvpilot.engine.contract.config import CAPABILITIES, EngineCapabilities
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec, Quantization, Speculative
from kvpilot.operator.planning import choices, latency, sizing
from kvpilot.operator.planning import plan as plan_module
from kvpilot.operator.planning.choices import Situation, choose_speculative
from kvpilot.operator.planning.plan import PlanContext, plan

GiB = 1024**3


def spec(model: str = "llama-2-7b", gpu: str | None = "A10G", **sections: Any) -> InferenceServiceSpec:
    body: dict[str, Any] = {"model": {"name": model}, "accelerator": {"type": gpu}, **sections}
    return InferenceServiceSpec.model_validate(body)


def test_llama_2_7b_on_a10g_fits_3_full_4k_sequences_and_batches_for_the_mean_context() -> None:
    result = plan(spec(serving={"maxContextLength": 4096}))
    assert result.fits and result.failure is None
    assert result.quantization == "none"
    assert result.kv_bytes_per_token == 512 * 1024
    assert result.weight_bytes == 2 * 6_738_415_616
    # 90% of the 22.1 GiB (22589 MiB) an A10G reports - 12.6 GiB weights - ~1 GiB runtime reserve
    # leaves ~6.3 GiB: 3 sequences of 2 GiB at the full context. The textbook figure of 5 assumes
    # all of a marketed 24 GB usable and no reserve.
    assert 6 * GiB < result.kv_pool_bytes < 6.5 * GiB
    assert "3 at the full 4096" in result.reasons["kvCache"]
    assert "90% of the 22.1 GiB A10G reports" in result.reasons["kvCache"]
    # The batch is sized for the mean context, 512 + 256 / 2 = 640 tokens (40 blocks of 16 tokens,
    # 320 MiB): 20 sequences, the long ones preempted, as vLLM does.
    assert result.max_num_seqs == 20 == result.kv_blocks // 40
    assert "20 sequences at the mean context of 640 tokens" in result.reasons["kvCache"]
    assert result.max_model_len == 4096
    assert result.kv_blocks == result.kv_pool_bytes // (result.kv_bytes_per_token * 16)


def test_llama_3_8b_at_1_request_per_second_needs_one_l4() -> None:
    # The issue's example: sized for every sequence at max_model_len, the planner asked for 3-4 L4s;
    # sized for the mean context (512 in + 256 / 2 out), one L4 meets the default SLO.
    result = plan(
        spec("llama-3-8b", "L4", load={"requestsPerSecond": 1, "meanPromptTokens": 512, "meanOutputTokens": 256})
    )
    assert result.fits and result.meets_slo
    assert result.replicas == 1
    assert "1 replica(s) for 1 req/s" in result.reasons["replicas"]


def test_full_memory_without_reserve_fits_4_sequences_not_the_textbook_5(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "RUNTIME_OVERHEAD_BYTES", 0)
    monkeypatch.setattr(sizing, "ACTIVATION_BYTES_PER_HIDDEN", 0)
    result = plan(spec(serving={"maxContextLength": 4096, "gpuMemoryUtilization": 1.0, "quantization": "none"}))
    # 22.49 GiB reported - 12.55 GiB of weights = 9.94 GiB: 4 whole 2 GiB sequences (the textbook's
    # 5 counts the marketed 24 GB).
    assert "4 at the full 4096" in result.reasons["kvCache"]


def test_70b_on_one_80gb_gpu_gets_int4_when_int8_leaves_too_little_kv(fuller: EngineCapabilities) -> None:
    result = plan(
        spec("llama-2-70b", "H100-80GB", autoscaling={"maxReplicas": 1}, load={"requestsPerSecond": 4}),
        PlanContext(capabilities=fuller),
    )
    assert result.fits and result.quantization == "int4"
    reason = result.reasons["quantization"]
    assert "none" in reason and "128.5 GiB" in reason  # FP16 weights cannot fit 80 GiB
    assert "int8" in reason and "only 29 fit" in reason  # INT8 leaves room for 29 mean-context sequences
    assert (
        plan(
            spec("llama-2-70b", "H100-80GB", autoscaling={"maxReplicas": 1}), PlanContext(capabilities=fuller)
        ).quantization
        == "int8"
    )
    assert round(result.weight_bytes / GiB, 1) == 40.6  # test_sizing: INT4 group 32, embedding and head wide
    assert result.meets_slo


def test_70b_on_a_24gb_gpu_is_a_clear_no_fit_with_numbers(fuller: EngineCapabilities) -> None:
    result = plan(spec("llama-3-70b", "A10G"), PlanContext(capabilities=fuller))
    assert not result.fits
    assert result.failure == "WeightsDoNotFit"
    assert result.quantization == "int4"  # even the smallest scheme was tried
    assert "42.8 GiB" in result.reason and "19.9 GiB" in result.reason


def test_7b_on_h100_with_loose_slo_stays_unquantized() -> None:
    result = plan(spec(gpu="H100-80GB", slo={"ttftP95Ms": 5000, "tpotP95Ms": 200}))
    assert result.quantization == "none" and result.meets_slo
    assert result.replicas == 1
    assert "least lossy" in result.reasons["quantization"]


def test_tight_slo_on_slow_gpu_picks_a_quantized_scheme(fuller: EngineCapabilities) -> None:
    # FP16 Llama-2-7B decodes at ~28 ms/token on an A10G; a 20 ms TPOT SLO needs fewer bytes.
    result = plan(
        spec(slo={"tpotP95Ms": 20}, serving={"speculative": "off"}, load={"requestsPerSecond": 0.1}),
        PlanContext(capabilities=fuller),
    )
    assert result.quantization in ("int8", "w8a8", "int4")
    assert result.predicted_tpot_ms <= 20
    assert "none" in result.reasons["quantization"]


def test_explicit_quantization_is_respected(fuller: EngineCapabilities) -> None:
    result = plan(spec(gpu="H100-80GB", serving={"quantization": "int4"}), PlanContext(capabilities=fuller))
    assert result.quantization == "int4"
    assert result.reasons["quantization"] == "int4: set in the spec"


@pytest.mark.parametrize("batch, expected", [(1.0, "ngram"), (64.0, "off")])
def test_speculation_on_at_batch_1_off_at_batch_64(batch: float, expected: str, fuller: EngineCapabilities) -> None:
    chosen, reason = choose_speculative(
        "auto", Situation(batch=batch, tpot_bound=True, temperature=0.2), draft_model=None, supported=fuller.speculative
    )
    assert chosen == expected
    assert f"{batch:.1f}" in reason


def test_speculation_off_at_high_temperature_or_ttft_bound_and_draft_when_given(fuller: EngineCapabilities) -> None:
    modes = fuller.speculative
    assert (
        choose_speculative(
            "auto", Situation(batch=1, tpot_bound=True, temperature=1.2), draft_model=None, supported=modes
        )[0]
        == "off"
    )
    assert (
        choose_speculative(
            "auto", Situation(batch=1, tpot_bound=False, temperature=0.0), draft_model=None, supported=modes
        )[0]
        == "off"
    )
    assert (
        choose_speculative(
            "auto",
            Situation(batch=1, tpot_bound=True, temperature=0.0),
            draft_model="hf://TinyLlama/TinyLlama-1.1B",
            supported=modes,
        )[0]
        == "draft"
    )
    assert (
        choose_speculative(
            "off", Situation(batch=1, tpot_bound=True, temperature=0.0), draft_model=None, supported=modes
        )[0]
        == "off"
    )


def test_plan_turns_speculation_on_at_low_load_and_off_at_high_load(fuller: EngineCapabilities) -> None:
    light = plan(
        spec(gpu="H100-80GB", load={"requestsPerSecond": 0.2, "temperature": 0}), PlanContext(capabilities=fuller)
    )
    assert light.speculative == "ngram" and light.num_speculative_tokens == 4
    assert light.predicted_batch < choices.SPECULATION_MAX_BATCH
    heavy = plan(
        spec(
            gpu="H100-80GB",
            load={"requestsPerSecond": 30, "temperature": 0},
            serving={"maxContextLength": 1024},
            autoscaling={"maxReplicas": 1},
        ),
        PlanContext(capabilities=fuller),
    )
    assert heavy.speculative == "off"
    assert heavy.predicted_batch > 32
    assert "predicted batch" in heavy.reasons["speculative"]


def test_replicas_grow_with_load_within_bounds() -> None:
    one = plan(spec(gpu="H100-80GB", load={"requestsPerSecond": 1}))
    many = plan(spec(gpu="H100-80GB", load={"requestsPerSecond": 40}, autoscaling={"maxReplicas": 8}))
    assert one.replicas == 1
    assert 1 < many.replicas <= 8 and many.meets_slo
    capped = plan(spec(gpu="H100-80GB", load={"requestsPerSecond": 400}, autoscaling={"maxReplicas": 2}))
    assert capped.fits and capped.replicas == 2 and not capped.meets_slo
    assert "SLO not met at maxReplicas 2" in capped.reasons["replicas"]


def test_unknown_model_unknown_gpu_and_bad_inputs_are_results_not_exceptions() -> None:
    unknown_model = plan(spec("gpt-5"))
    assert (unknown_model.fits, unknown_model.failure) == (False, "UnknownModel")
    assert "spec.model.architecture" in unknown_model.reason
    unknown_gpu = plan(spec(gpu="TPU-v5"))
    assert (unknown_gpu.fits, unknown_gpu.failure) == (False, "UnknownGPU")
    no_gpu = plan(spec(gpu=None))
    assert no_gpu.failure == "NoGPUType"
    too_long = plan(spec(serving={"maxContextLength": 8192}))
    assert too_long.failure == "ContextTooLong" and "4096" in too_long.reason
    multi = plan(spec(accelerator={"type": "A10G", "count": 2}))
    assert multi.failure == "UnsupportedByRuntime"
    assert "accelerator.count 2: runtime kvpilot runs 1 GPU(s) per replica; runtime: vllm" in multi.reason


def test_context_leaving_room_for_no_sequence_is_a_no_fit(fuller: EngineCapabilities) -> None:
    # Mixtral-8x7B's INT4 weights (27.4 GiB) fit in 80 % of an A100-40GB (32 GiB), but one
    # 32k-token sequence (0.125 MiB/token x 32768 = 4 GiB of KV) does not fit in what is left.
    result = plan(
        spec("mixtral-8x7b", "A100-40GB", serving={"gpuMemoryUtilization": 0.8}), PlanContext(capabilities=fuller)
    )
    assert not result.fits and result.failure == "ContextDoesNotFit"
    assert result.quantization == "int4"
    assert "one 32768-token sequence needs 4.0 GiB of KV cache" in result.reason
    shorter = plan(
        spec("mixtral-8x7b", "A100-40GB", serving={"gpuMemoryUtilization": 0.8, "maxContextLength": 8192}),
        PlanContext(capabilities=fuller),
    )
    assert shorter.fits and shorter.quantization == "int4"


def test_explicit_architecture_wins_over_the_catalog() -> None:
    tiny = {
        "layers": 2,
        "hiddenSize": 64,
        "attentionHeads": 4,
        "kvHeads": 2,
        "vocabSize": 1000,
        "parameters": 1_000_000,
        "maxContext": 512,
    }
    result = plan(
        InferenceServiceSpec.model_validate(
            {"model": {"name": "llama-2-7b", "architecture": tiny}, "accelerator": {"type": "A10G"}}
        )
    )
    assert result.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert result.max_model_len == 512
    assert result.reasons["model"] == "spec.model.architecture"


def test_unset_gpu_picks_the_smallest_node_gpu_that_works(fuller: EngineCapabilities) -> None:
    choices = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A10G", "some-unknown-gpu"]
    small = plan(spec(gpu=None), PlanContext(available_gpus=tuple(choices), capabilities=fuller))
    assert small.gpu == "A10G" and small.meets_slo
    big = plan(spec("llama-2-70b", gpu=None), PlanContext(available_gpus=tuple(choices), capabilities=fuller))
    assert big.gpu == "H100-80GB"
    assert "smallest of the nodes' GPUs (A10G, H100-80GB)" in big.reasons["gpu"]


def test_every_fitting_plan_carries_a_reason_per_choice() -> None:
    result = plan(spec())
    assert set(result.reasons) == {
        "model",
        "gpu",
        "quantization",
        "kvCache",
        "batching",
        "speculative",
        "replicas",
        "startup",
        "tensorParallel",
    }
    assert all(result.reasons.values())
    assert result.max_num_batched_tokens >= result.max_num_seqs
    assert result.max_num_batched_tokens % 16 == 0


def test_plan_is_json_serialisable() -> None:
    result = plan(spec())
    assert Plan.model_validate_json(result.model_dump_json()) == result


# What the CRD lets a spec pin that the engine build under test does not run.
UNDECLARED = [("quantization", q) for q in get_args(Quantization) if q not in ("auto", *CAPABILITIES.quantization)] + [
    ("speculative", m) for m in get_args(Speculative) if m not in ("auto", *CAPABILITIES.speculative)
]
# The specs that a fuller engine serves with a quantized scheme, or with speculation.
SEARCHING = [
    spec("llama-2-70b", "H100-80GB", autoscaling={"maxReplicas": 1}),
    spec(slo={"tpotP95Ms": 20}, load={"requestsPerSecond": 0.1}),
    spec(gpu="H100-80GB", load={"requestsPerSecond": 0.2, "temperature": 0}),
    spec(
        gpu="H100-80GB",
        load={"requestsPerSecond": 0.2, "temperature": 0},
        serving={"draftModel": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"},
    ),
]


@pytest.mark.parametrize("body", SEARCHING, ids=["70b-h100", "tight-tpot", "idle-h100", "draft"])
def test_auto_chooses_only_what_the_engine_declares(body: InferenceServiceSpec, fuller: EngineCapabilities) -> None:
    searched = plan(body, PlanContext(capabilities=fuller))
    assert (searched.quantization, searched.speculative) != ("none", "off")  # a real search
    result = plan(body)
    assert result.quantization in CAPABILITIES.quantization
    assert result.speculative in CAPABILITIES.speculative
    assert result.failure != "UnsupportedByRuntime"


def test_reasons_say_which_options_the_engine_lacks() -> None:
    minimal = EngineCapabilities(quantization=("none",), speculative=("off",), dtypes=("auto",))
    idle = plan(
        spec(gpu="H100-80GB", load={"requestsPerSecond": 0.2, "temperature": 0}), PlanContext(capabilities=minimal)
    )
    assert (idle.quantization, idle.speculative) == ("none", "off")
    assert idle.reasons["speculative"] == "off: this runtime runs no speculative mode (supported: off)"
    assert idle.reasons["quantization"].endswith(
        "not tried: int8, fp8, w8a8, int4, which runtime kvpilot does not apply on load (supported: none)"
    )
    # A 70B model needs INT4 on one 80 GiB GPU: the no-fit says why nothing smaller was tried.
    big = plan(spec("llama-2-70b", "H100-80GB"), PlanContext(capabilities=minimal))
    assert (big.fits, big.failure, big.quantization) == (False, "WeightsDoNotFit", "none")
    assert "128.5 GiB" in big.reason and "not tried: int8, fp8, w8a8, int4" in big.reason
    assert big.reason.endswith("runtime: vllm splits a replica over up to 8 GPUs (tensor parallelism)")
    draft_only = choose_speculative(
        "auto", Situation(batch=1, tpot_bound=True, temperature=0), draft_model=None, supported=("off", "draft")
    )
    assert draft_only[0] == "off" and "serving.draftModel" in draft_only[1]


@pytest.mark.parametrize("field, value", UNDECLARED, ids=[f"{f}={v}" for f, v in UNDECLARED])
def test_pinning_what_the_engine_does_not_run_is_unsupported_by_engine(field: str, value: str) -> None:
    # eagle names its head in serving.draftModel, which the schema requires.
    head = {"draftModel": "hf://yuhuili/EAGLE-LLaMA3-Instruct-8B"} if value == "eagle" else {}
    result = plan(spec(gpu="H100-80GB", serving={field: value, **head}))
    assert (result.fits, result.failure) == (False, "UnsupportedByRuntime")
    supported = ", ".join(getattr(CAPABILITIES, field))
    assert f"serving.{field} {value!r}" in result.reason
    assert f"(supported: {supported}; or 'auto')" in result.reason


def test_both_unsupported_pins_are_named_and_no_sizeable_scheme_is_a_no_fit() -> None:
    minimal = EngineCapabilities(quantization=("none",), speculative=("off",), dtypes=("auto",))
    both = plan(spec(serving={"quantization": "int4", "speculative": "ngram"}), PlanContext(capabilities=minimal))
    assert both.failure == "UnsupportedByRuntime"
    assert "'int4'" in both.reason and "'ngram'" in both.reason
    # A scheme the engine declares but sizing has no byte count for is never chosen.
    unknown = EngineCapabilities(quantization=("nvfp4",), speculative=("off",), dtypes=("auto",))
    result = plan(spec(), PlanContext(capabilities=unknown))
    assert result.failure == "UnsupportedByRuntime" and "supported: nvfp4" in result.reason


def test_a_checkpoint_stored_quantized_is_planned_as_stored(fuller: EngineCapabilities) -> None:
    """model.quantization: the weights are already INT4 (a W4A16 checkpoint). The plan sizes them
    as INT4 under auto or the same pin; another pin is a clear no-plan, not a pod the engine
    refuses; the rendered engine follows the checkpoint (`--quantization none`)."""
    from kvpilot.operator.controller.render import engine_args

    stored = {"name": "llama-3-8b", "quantization": "int4"}
    for serving in ({}, {"quantization": "int4"}):
        body = {"model": stored, "accelerator": {"type": "L4"}, "serving": serving}
        result = plan(InferenceServiceSpec.model_validate(body), PlanContext(capabilities=fuller))
        assert result.fits and result.quantization == "int4"
        assert result.reasons["quantization"] == "int4: the checkpoint's own (model.quantization)"
        assert (
            result.weight_bytes
            == plan(
                spec("llama-3-8b", "L4", serving={"quantization": "int4"}), PlanContext(capabilities=fuller)
            ).weight_bytes
        )
        args = engine_args(InferenceServiceSpec.model_validate(body), result, "/models/llama")
        assert args[args.index("--quantization") + 1] == "none"
    mismatch = plan(
        InferenceServiceSpec.model_validate(
            {"model": stored, "accelerator": {"type": "L4"}, "serving": {"quantization": "int8"}}
        ),
        PlanContext(capabilities=fuller),
    )
    assert not mismatch.fits and mismatch.failure == "QuantizationMismatch"
    assert "quantized as int4 (model.quantization)" in mismatch.reason and "int8" in mismatch.reason


def test_without_low_bit_gpu_kernels_quantization_is_not_counted_on_for_decode_speed() -> None:
    """This engine build dequantizes each low-bit weight to 16 bits for its matmul on GPUs: a
    decode step moves the stored weight and that copy, so a tight TPOT SLO stays unquantized (the
    schemes would only be slower) and a pinned INT4 is predicted slower than FP16, not faster."""
    assert not CAPABILITIES.low_bit_gpu_matmuls
    tight = plan(spec(slo={"tpotP95Ms": 20}, serving={"speculative": "off"}, load={"requestsPerSecond": 0.1}))
    assert tight.quantization == "none" and not tight.meets_slo
    fp16, int4 = (
        plan(spec(serving={"speculative": "off", "quantization": q}, load={"requestsPerSecond": 0.1}))
        for q in ("none", "int4")
    )
    assert int4.weight_bytes < fp16.weight_bytes / 3  # the memory saving holds
    assert int4.predicted_tpot_ms > fp16.predicted_tpot_ms


ARCH = {
    "layers": 2,
    "hiddenSize": 64,
    "attentionHeads": 4,
    "kvHeads": 2,
    "vocabSize": 1000,
    "parameters": 300_000,
    "maxContext": 2048,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"attentionHeads": 128, "kvHeads": 64}, "hiddenSize 64 / attentionHeads 128 leaves no head dimension"),
        ({"parameters": 100_000}, "parameters 100,000 is not more than the embedding and the LM head"),
        ({"activeParameters": 400_000}, "activeParameters 400,000 > parameters 300,000"),
    ],
)
def test_an_architecture_the_crd_admits_but_sizing_cannot_use_is_invalid(change: dict[str, Any], words: str) -> None:
    # These raised ZeroDivisionError or planned 0.00 GiB of weights (issue 24, item 8).
    def tiny(architecture: dict[str, Any]) -> InferenceServiceSpec:
        return InferenceServiceSpec.model_validate(
            {"model": {"name": "tiny", "architecture": architecture}, "accelerator": {"type": "L4"}}
        )

    result = plan(tiny({**ARCH, **change}))
    assert (result.fits, result.failure) == (False, "InvalidArchitecture")
    assert result.reason.startswith("spec.model.architecture: ") and words in result.reason
    assert plan(tiny(ARCH)).fits


def test_an_invalid_draft_architecture_is_named() -> None:
    result = plan(
        spec(
            "llama-3-8b",
            serving={
                "speculative": "draft",
                "draftModel": "/models/d",
                "draftModelArchitecture": {**ARCH, "vocabSize": 128256, "parameters": 1000},
            },
        )
    )
    assert result.failure == "InvalidArchitecture" and "serving.draftModel '/models/d'" in result.reason


def test_replicas_are_searched_in_log_time_up_to_the_crd_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.operator.api.spec import MAX_REPLICAS

    calls = []
    predict = latency.predict
    monkeypatch.setattr(latency, "predict", lambda *a, **k: calls.append(a[2]) or predict(*a, **k))
    # The chosen replica's capacity is a search of its own (test_variants.py): not counted here.
    monkeypatch.setattr(plan_module, "capacity_rps", lambda *a: 0.0)

    def at_most(replicas: int) -> Plan:
        return plan(
            spec(
                "llama-2-7b",
                "L4",
                serving={"quantization": "none", "speculative": "off"},
                load={"requestsPerSecond": 30},
                autoscaling={"maxReplicas": replicas},
            )
        )

    result = at_most(MAX_REPLICAS)
    assert result.fits and result.meets_slo and 1 < result.replicas < MAX_REPLICAS
    assert len(calls) <= 12  # log2(1000) + 2, where a search count by count made result.replicas
    # The fewest that meet the SLO: one fewer does not.
    assert not at_most(result.replicas - 1).meets_slo


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"autoscaling": {"maxReplicas": 1001}}, "less than or equal to 1000"),
        ({"replicas": 1_000_000, "autoscaling": {"mode": "off"}}, "less than or equal to 1000"),
        ({"replicas": 9, "autoscaling": {"maxReplicas": 4}}, "replicas 9 > autoscaling.maxReplicas 4"),
    ],
)
def test_replicas_are_bounded(bad: dict[str, Any], words: str) -> None:
    # A million replicas rendered a Deployment of a million (issue 24, item 7).
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=words):
        spec(**bad)
    assert spec(replicas=9, autoscaling={"mode": "external", "maxReplicas": 4}).replicas == 9
