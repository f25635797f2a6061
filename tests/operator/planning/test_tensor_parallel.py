"""Tensor parallelism in the planner: the runtime's sizes, the smallest that fits and meets the
SLO, per-GPU memory, the all-reduce cost, and the heads and node bounds that rule a size out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.controller.render import engine_args
from kvpilot.operator.planning import recurrent, sizing, speculation
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.model_config import read_config
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.placement import heads_problem
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.vllm.model_configs import eagle_head


def spec(model: str, gpu: str, runtime: str = "vllm", **fields: Any) -> InferenceServiceSpec:
    accelerator = {"type": gpu, **fields.pop("accelerator", {})}
    return InferenceServiceSpec.model_validate(
        {"runtime": runtime, "model": {"name": model}, "accelerator": accelerator} | fields
    )


def test_a_70b_model_on_h100s_is_split_over_the_fewest_gpus_that_hold_it_and_says_why() -> None:
    result = plan(spec("llama-3-70b", "H100-80GB", serving={"quantization": "none"}))
    assert result.fits and result.quantization == "none" and result.gpu_count in (2, 4)
    why = result.reasons["tensorParallel"]
    assert why.startswith(f"{result.gpu_count}: the smallest of runtime vllm's sizes (1, 2, 4, 8) on H100-80GB")
    assert "NVLink" in why and "rejected TP 1: llama-3-70b none weights 131.4 GiB" in why
    # Per GPU: the weights and the KV pool divide by the TP size; each GPU keeps its own reserve.
    per_gpu_weights = result.weight_bytes / result.gpu_count
    assert per_gpu_weights + result.kv_pool_bytes / result.gpu_count < GPUS["H100-80GB"].memory_bytes * 0.9


def test_a_70b_model_on_an_l4_pool_is_split_or_refused_with_the_numbers() -> None:
    result = plan(spec("llama-3-70b", "L4"))
    assert result.fits and result.gpu_count == 8, result.reason
    assert "PCIe" in result.reasons["tensorParallel"] and "TP 4:" in result.reasons["tensorParallel"]
    refused = plan(spec("llama-3-70b", "L4", accelerator={"count": 2}))
    assert not refused.fits and refused.failure == "WeightsDoNotFit"
    assert "of the 44.1 GiB 2 x L4 report" in refused.reason


def test_an_8b_model_keeps_one_gpu_where_it_fits() -> None:
    for gpu in ("L4", "A100-80GB", "H100-80GB"):
        result = plan(spec("llama-3-8b", gpu))
        assert result.fits and result.gpu_count == 1 and result.reasons["tensorParallel"].startswith("1: the smallest")


def test_heads_that_do_not_divide_rule_a_size_out() -> None:
    # Qwen2.5-7B: 28 attention heads, 4 KV heads. TP 8 divides neither.
    pinned = plan(spec("qwen2.5-7b", "L4", accelerator={"count": 8}))
    assert not pinned.fits and pinned.failure == "NoTensorParallelSize"
    assert "TP 8 does not divide 28 attention heads and 4 KV heads" in pinned.reason
    # Unpinned, the planner never reaches for it, and says so.
    tight = plan(spec("qwen2.5-7b", "T4", serving={"quantization": "none"}))
    assert tight.gpu_count in (1, 2, 4)
    assert "TP 8 does not divide 28 attention heads and 4 KV heads" in tight.reasons["tensorParallel"]


def test_the_all_reduce_is_paid_on_every_step_and_costs_more_over_pcie() -> None:
    tp2 = sizing.allreduce_seconds(4096 * 2 * 8, 2, GPUS["H100-80GB"].link_bytes_per_s, 10e-6)
    pcie = sizing.allreduce_seconds(4096 * 2 * 8, 2, GPUS["L4"].link_bytes_per_s, 30e-6)
    assert sizing.allreduce_seconds(1e6, 1, 1e9, 1e-5) == 0 and pcie > tp2 > 10e-6
    # Two GPUs double the bandwidth but add two all-reduces per layer: TPOT falls by less than half,
    # and the pool gains a second GPU's memory less a second reserve.
    one = plan(spec("llama-3-8b", "H100-80GB", accelerator={"count": 1}))
    two = plan(spec("llama-3-8b", "H100-80GB", accelerator={"count": 2}))
    assert two.predicted_tpot_ms > one.predicted_tpot_ms / 2  # the all-reduces eat into the split
    assert two.kv_pool_bytes > 2 * one.kv_pool_bytes - 2 * sizing.GiB


def test_our_engine_refuses_more_than_one_gpu_and_names_the_runtime_that_runs_it() -> None:
    result = plan(spec("llama-3-70b", "H100-80GB", runtime="kvpilot", accelerator={"count": 4}))
    assert (result.fits, result.failure) == (False, "UnsupportedByRuntime")
    assert "runtime: vllm runs tensor parallelism over 4" in result.reason


def test_the_nodes_gpu_count_bounds_the_size_below_the_catalog() -> None:
    # A10G: 24 GB each. A 70B model in INT4-AWQ needs more than 2 of them; the catalog's machines
    # hold 8, this cluster's (g5.12xlarge) 4.
    body = InferenceServiceSpec.model_validate(
        {"runtime": "vllm", "model": {"name": "llama-3-70b", "quantization": "awq"}, "accelerator": {"type": "A10G"}}
    )
    assert plan(body).gpu_count == 4
    narrow = plan(body, PlanContext(gpus_per_node={"NVIDIA-A10G": 2}))
    assert not narrow.fits and narrow.gpu_count == 2
    # In 16 bits it needs more than 4: the no-fit says how much, and why not 8.
    wide = plan(spec("llama-3-70b", "A10G"), PlanContext(gpus_per_node={"NVIDIA-A10G": 4}))
    assert (wide.fits, wide.failure, wide.gpu_count) == (False, "WeightsDoNotFit", 4)
    assert "4 x A10G" in wide.reason and wide.reason.endswith("TP 8 > the 4 A10G GPUs the cluster's nodes carry")


def test_node_gpu_counts_come_from_the_count_label_else_allocatable() -> None:
    from kvpilot.operator.kube.cluster import gpu_nodes

    def node(labels: dict[str, str], allocatable: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"labels": labels}, "status": {"allocatable": allocatable}}

    nodes = [
        node({"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "4"}, {"nvidia.com/gpu": "3"}),
        node({"nvidia.com/gpu.product": "NVIDIA-L4"}, {"nvidia.com/gpu": "8"}),
        node({"nvidia.com/gpu.product": "NVIDIA-A10G", "nvidia.com/gpu.count": "not-a-number"}, {}),
        node({"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}, {"amd.com/gpu": "8"}),
        node({"kubernetes.io/os": "linux"}, {"cpu": "96"}),
    ]
    assert gpu_nodes(nodes) == {"NVIDIA-L4": 8, "NVIDIA-A10G": 0, "AMD_Instinct_MI300X": 8}


def test_a_draft_whose_heads_the_size_does_not_divide_is_left_out_or_refused_when_pinned() -> None:
    draft = {"draftModel": "hf://Qwen/Qwen2.5-7B-Instruct"}  # 28 attention heads, 4 KV heads
    fields: dict[str, Any] = {"accelerator": {"count": 8}, "load": {"requestsPerSecond": 0.1, "temperature": 0}}
    pinned = plan(spec("qwen2.5-72b", "L4", serving={**draft, "speculative": "draft"}, **fields))
    assert (pinned.fits, pinned.failure) == (False, "NoTensorParallelSize")
    assert "serving.draftModel hf://Qwen/Qwen2.5-7B-Instruct: TP 8 does not divide 28 attention heads" in pinned.reason
    chosen = plan(spec("qwen2.5-72b", "L4", serving={**draft, "speculative": "auto"}, **fields))
    assert chosen.fits and chosen.gpu_count == 8 and chosen.speculative != "draft" and chosen.draft_model is None


def test_an_eagle_head_is_planned_beside_the_target_on_vllm() -> None:
    head = eagle_head(MODELS["llama-3-8b"])
    serving = {
        "speculative": "eagle",
        "draftModel": "hf://yuhuili/EAGLE-LLaMA3-Instruct-8B",
        "draftModelArchitecture": head.model_dump(by_alias=True),
    }
    result = plan(spec("llama-3-8b", "H100-80GB", serving=serving))
    assert result.fits and result.speculative == "eagle" and result.draft_model == serving["draftModel"]
    # The EAGLE papers' 0.75 per token, as the share of 4 drafts the engines report.
    assert result.assumed_draft_acceptance == round(speculation.accepted_share(0.75, 4), 4) == 0.5127
    assert "EAGLE head hf://yuhuili" in result.reasons["speculative"]
    assert result.draft_weight_bytes == head.parameters * 2  # 16-bit, beside the target's
    eagle = spec("llama-3-8b", "H100-80GB", serving=serving)
    assert eagle.runtime == "vllm"
    args = engine_args(eagle, result, "/m", "/e")
    assert '--speculative-config={"method":"eagle","model":"/e","num_speculative_tokens":4}' in args


QWEN3_NEXT = Path(__file__).parent / "hf_configs" / "Qwen--Qwen3-Next-80B-A3B-Thinking.json"


def _architecture(path: Path) -> Architecture:
    read = read_config(json.loads(path.read_text()), path.stem)
    assert not isinstance(read, str), read
    return read.architecture


def _with(arch: Architecture, gpu: str, tp: int) -> InferenceServiceSpec:
    # Not speculating: a hybrid's state pages would then hold the draft tokens too (test_recurrent.py).
    return spec(
        "model",
        gpu,
        accelerator={"count": tp},
        serving={"quantization": "none", "speculative": "off"},
        load={"requestsPerSecond": 0.5},
    ).model_copy(
        update={
            "model": InferenceServiceSpec.model_validate(
                {"model": {"name": "model", "architecture": arch.model_dump(by_alias=True, exclude_none=True)}}
            ).model
        }
    )


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_qwen3_next_s_two_kv_heads_are_copied_where_the_gpus_outnumber_them(tp: int) -> None:
    arch = _architecture(QWEN3_NEXT)
    assert (arch.kv_heads, arch.attention_heads, arch.head_size) == (2, 16, 256)
    result = plan(_with(arch, "H200", tp))
    assert result.fits and result.gpu_count == tp, result.reason
    # One KV head per GPU: its share at TP 2, a copy at 4 and 8 (vLLM's num_kv_head_replicas), so a
    # token's K and V over the replica grow with the GPUs instead of staying 2 heads' worth.
    attention_layers = arch.state.attention_layers if arch.state else 0
    assert result.kv_bytes_per_token == tp * attention_layers * 2 * 1 * arch.head_size * 2
    # The Gated DeltaNet state splits evenly: a tp-th of the convolution's channels and of the heads.
    state = recurrent.architecture_state(arch)
    assert state is not None
    conv, recurrent_values = state.conv_width * state.conv_channels // tp, state.heads // tp * state.head_values
    state_bytes = recurrent.state_page_bytes(state, tp)
    assert state_bytes == (conv + recurrent_values) * 2
    assert f"a state per sequence of {state_bytes:,} bytes per GPU" in result.reasons["kvCache"]
    assert result.block_size == recurrent.hybrid_kv(state, recurrent.Serving("H200", tp)).block_size


def test_a_dense_model_s_kv_heads_are_copied_where_the_gpus_outnumber_them() -> None:
    two_kv_heads = MODELS["llama-3-8b"].model_copy(update={"kv_heads": 2})
    for tp in (1, 2, 4, 8):
        # 2 heads' K and V per token on one or two GPUs; one head on each of 4 or 8.
        heads_held = max(2, tp)
        expected = two_kv_heads.layers * 2 * heads_held * two_kv_heads.head_size * 2
        assert sizing.kv_bytes_per_token(two_kv_heads, 2, tp) == expected
        assert heads_problem(two_kv_heads, tp) is None
        assert sizing.kv_layout(two_kv_heads, 2, tp).group_bytes_per_token == expected
    result = plan(_with(two_kv_heads, "H100-80GB", 4))
    assert result.fits and result.kv_bytes_per_token == two_kv_heads.layers * 2 * 4 * two_kv_heads.head_size * 2


def test_kv_or_state_heads_the_size_neither_divides_nor_copies_evenly_rule_it_out() -> None:
    six = MODELS["llama-3-8b"].model_copy(update={"kv_heads": 6, "attention_heads": 24})
    assert heads_problem(six, 4) == "TP 4 does not divide 24 attention heads and 6 KV heads"
    assert heads_problem(six, 2) is None
    arch = _architecture(QWEN3_NEXT)
    assert arch.state is not None
    odd_state = arch.model_copy(update={"state": arch.state.model_copy(update={"heads": 12})})
    assert (
        heads_problem(odd_state, 8)
        == "TP 8 does not divide the gated_deltanet layers' 12 heads and 8192 convolution channels"
    )
    assert heads_problem(odd_state, 4) is None


SCOUT = Path(__file__).parent / "hf_configs" / "meta-llama--Llama-4-Scout-17B-16E-Instruct.json"


def _speculating(arch: Architecture, mode: str, head: Architecture, tp: int) -> InferenceServiceSpec:
    """`arch` on `tp` H200s drafting with `head` under `mode`, 128k tokens at most."""
    serving = {
        "speculative": mode,
        "draftModel": "hf://org/head",
        "draftModelArchitecture": head.model_dump(by_alias=True, exclude_none=True),
        "maxContextLength": 131072,
    }
    return InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {"name": "model", "architecture": arch.model_dump(by_alias=True, exclude_none=True)},
            "accelerator": {"type": "H200", "count": tp},
            "serving": serving,
            "load": {"requestsPerSecond": 0.2},
        }
    )


def test_llama_4_beside_an_eagle_head_keeps_every_token_of_its_chunked_layers() -> None:
    scout = _architecture(SCOUT)
    assert scout.chunked and (scout.layers, scout.windowed_layers) == (48, 36)
    # A head of one full-attention decoder layer of Scout's KV shape (sizes beside the KV are not checked).
    local = {"sliding_window": None, "sliding_layers": None, "sliding_kind": "window", "vision_parameters": None}
    head = Architecture.model_validate(eagle_head(scout.model_copy(update=local)).model_dump())
    eagle, drafted = (plan(_speculating(scout, mode, head, 2)) for mode in ("eagle", "draft"))
    assert eagle.fits and drafted.fits, (eagle.reason, drafted.reason)
    assert eagle.kv_bytes_per_token == drafted.kv_bytes_per_token == 49 * 2 * 8 * 128 * 2
    # EAGLE: vLLM turns its hybrid KV cache manager off, so a block holds a token of all 48 layers and
    # the head's, and a 128k sequence every token of them.
    assert eagle.kv_blocks == eagle.kv_pool_bytes // (16 * eagle.kv_bytes_per_token)
    assert "every token in all 48 layers, the 36 chunked local attention ones too" in eagle.reasons["kvCache"]
    assert f"{131072 * eagle.kv_bytes_per_token / sizing.GiB:.1f} GiB per full sequence" in eagle.reasons["kvCache"]
    # A draft model keeps it on: blocks of one group of 12 layers (and the draft's slot), and chunked
    # groups that keep the current chunk.
    group = 12 * 2 * 8 * 128 * 2 + drafted.draft_kv_bytes_per_token
    assert drafted.kv_blocks == drafted.kv_pool_bytes // (16 * group)
    assert "3 chunked local attention and 1 full-attention layer groups" in drafted.reasons["kvCache"]
    assert _full_sequences(eagle) < _full_sequences(drafted)


def test_chunks_that_are_not_whole_blocks_are_refused_as_vllm_would() -> None:
    """vLLM 0.33 asserts attention_chunk_size % block_size == 0 when it maps a chunk to its blocks, on the
    first request: the planner says so before a pod is rendered."""
    scout = _architecture(SCOUT)

    def spec(chunk: int, block: int) -> InferenceServiceSpec:
        arch = scout.model_copy(update={"sliding_window": chunk})
        return InferenceServiceSpec.model_validate(
            {
                "runtime": "vllm",
                "model": {"name": "scout", "architecture": arch.model_dump(by_alias=True, exclude_none=True)},
                "accelerator": {"type": "H200", "count": 8},
                "serving": {"blockSize": block, "maxContextLength": 32768},
            }
        )

    assert plan(spec(8192, 64)).fits and plan(spec(8208, 16)).fits
    refused = plan(spec(8208, 32))
    assert not refused.fits and refused.failure == "UnsupportedByRuntime"
    assert "attention chunks of 8208 tokens" in refused.reason and "blockSize 32-token blocks" in refused.reason


def _full_sequences(result: Plan) -> int:
    """How many max_model_len sequences the plan's reason says fit."""
    return int(result.reasons["kvCache"].split(" at the full ")[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_drafts_kv_heads_are_copied_on_the_targets_gpus_where_they_outnumber_them(tp: int) -> None:
    # Llama-3-70B (8 KV heads: its share on each GPU) drafting with a 1B of 2 KV heads: split over
    # 2 GPUs, copied to tp / 2 GPUs each over 4 and 8 (vLLM's num_kv_head_replicas), so the draft's
    # slot of a token over the replica holds tp heads, not 2.
    draft = MODELS["llama-3.2-1b"].model_copy(update={"kv_heads": 2})
    serving = {
        "speculative": "draft",
        "draftModel": "hf://org/draft",
        "draftModelArchitecture": draft.model_dump(by_alias=True, exclude_none=True),
        "quantization": "none",
    }
    result = plan(spec("llama-3-70b", "H200", accelerator={"count": tp}, serving=serving))
    assert result.fits and (result.gpu_count, result.speculative) == (tp, "draft"), result.reason
    heads_held = max(draft.kv_heads, tp)
    draft_kv = draft.layers * 2 * heads_held * draft.head_size * 2
    target_kv = 80 * 2 * 8 * 128 * 2  # 8 KV heads: 8 / tp of them on each GPU, never copied here
    assert (result.draft_kv_bytes_per_token, result.kv_bytes_per_token) == (draft_kv, target_kv + draft_kv)
    # Every block holds the target's and the draft's slots of its tokens, copies included.
    assert result.kv_blocks == result.kv_pool_bytes // (16 * (target_kv + draft_kv))
    assert f"{draft_kv / sizing.MiB:.3g} MiB of KV per token" in result.reasons["speculative"]
