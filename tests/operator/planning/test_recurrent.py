"""A hybrid's per-sequence state and KV cache as vLLM 0.33 allocates them (planning/recurrent.py), on
the real configs; test_model_config.py checks the same numbers against vLLM's own code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning import recurrent, sizing
from kvpilot.operator.planning.model_config import HYBRID_LAYERS, hybrid_parameters, read_config
from kvpilot.operator.planning.plan import plan
from tests.operator.planning.test_model_config import (
    TINY_HYBRIDS,
    hybrid_config,
    plan_command,
    stored_count,
    transformers_model,
)

HF_CONFIGS = Path(__file__).parent / "hf_configs"
QWEN3_NEXT = HF_CONFIGS / "Qwen--Qwen3-Next-80B-A3B-Thinking.json"
NEMOTRON_H = HF_CONFIGS / "nvidia--Nemotron-H-56B-Base-8K.json"
# A multimodal wrapper over a hybrid: its language model's state in fp32 (text_config's mamba_ssm_dtype).
QWEN3_5_MOE = HF_CONFIGS / "Qwen--Qwen3.5-35B-A3B.json"


def state_of(path: Path) -> recurrent.RecurrentState:
    state = recurrent.recurrent_state(json.loads(path.read_text()))
    assert state is not None
    return state


def test_qwen3_next_on_two_h100s_keeps_its_gated_deltanet_state_in_576_token_blocks() -> None:
    state = state_of(QWEN3_NEXT)
    assert (state.layers, state.attention_layers) == (36, 12)
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving("H100-80GB", tp=2))
    # Per GPU: a 3-token window of 8192 / 2 channels and 16 of 32 heads' 128 x 128 state, in bf16.
    assert hybrid.state_bytes == 3 * 4096 * 2 + 16 * 128 * 128 * 2 == 548_864
    # One KV head of 256 values per GPU: 1024 bytes a token; FlashInfer's 64-token grid on Hopper.
    assert hybrid.block_size == 64 * math.ceil(548_864 / (64 * 1024)) == 576
    assert hybrid.page_bytes == 576 * 1024
    layout = hybrid.layout
    assert (layout.full_groups, layout.state_groups, layout.state_blocks) == (1, 3, 3)
    block = sizing.kv_block_bytes(layout, hybrid.block_size)
    assert block == 2 * 12 * 576 * 1024  # a block on each of the 2 GPUs, for the 12 layers of a group
    assert sizing.sequence_blocks(layout, 262_144, hybrid.block_size, 0) == 456 + 9
    assert sizing.sequence_blocks(layout, 32_768, hybrid.block_size, 0) == 57 + 9
    # 40 GiB on each GPU: 6068 blocks, 13 sequences of the full context, 91 of 32k tokens.
    pool = 2 * 40 * sizing.GiB
    assert pool // block == 6068
    assert sizing.sequences_that_fit(pool, layout, 262_144, hybrid.block_size) == 13
    assert sizing.sequences_that_fit(pool, layout, 32_768, hybrid.block_size) == 91


def test_without_flashinfer_the_block_is_a_multiple_of_16_and_no_checkpoint_page_is_kept() -> None:
    hybrid = recurrent.hybrid_kv(state_of(QWEN3_NEXT), recurrent.Serving("L40S", tp=2))
    assert hybrid.block_size == 16 * math.ceil(548_864 / (16 * 1024)) == 544
    assert hybrid.layout.state_blocks == 2


def test_nemotron_h_keeps_its_mamba_2_state_in_fp32_with_a_checkpoint_page() -> None:
    state = state_of(NEMOTRON_H)
    assert (state.layers, state.attention_layers, state.fp32_state) == (54, 10, True)
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving("H100-80GB"))
    # 3 tokens of 256 x 64 channels and 8 groups of 2 x 256 in bf16; 256 heads of 64 x 256 in fp32.
    assert hybrid.state_bytes == 3 * (16_384 + 8 * 512) * 2 + 256 * 64 * 256 * 4
    # 8 KV heads of 128 values: 4096 bytes a token per layer.
    assert hybrid.block_size == 16 * math.ceil(hybrid.state_bytes / (16 * 4096)) == 4128
    # 10 attention and 54 state layers: groups of 10, the last state group padded.
    assert (hybrid.layout.full_groups, hybrid.layout.state_groups, hybrid.layout.state_blocks) == (1, 6, 3)


@pytest.mark.parametrize(("groups", "tp"), [(1, 2), (8, 16)])
def test_mamba_2_groups_are_made_the_gpu_count_where_it_does_not_divide_them(groups: int, tp: int) -> None:
    state = state_of(NEMOTRON_H)._replace(groups=groups, heads=48 * tp)
    conv = 3 * (state.conv_channels + tp * 512) // tp * 2
    assert recurrent.state_page_bytes(state, tp) == conv + 48 * 64 * 256 * 4


def test_a_larger_block_the_plan_asks_for_is_kept() -> None:
    assert recurrent.hybrid_block_size(1024, 548_864, 1024, 16) == 1024
    assert recurrent.hybrid_block_size(1024, 548_864, 32, 16) == 32 * 17


def test_every_hybrid_read_has_its_parameters_counted() -> None:
    assert set(recurrent.READERS) == set(HYBRID_LAYERS)


@pytest.mark.parametrize(
    "given", [*TINY_HYBRIDS.values(), QWEN3_NEXT, NEMOTRON_H], ids=[*TINY_HYBRIDS, "qwen3-next-80b", "nemotron-h-56b"]
)
def test_a_hybrids_parameters_are_counted_as_transformers_builds_it(given: dict | Path) -> None:
    read = json.loads(given.read_text()) if isinstance(given, Path) else given
    built = transformers_model({k: v for k, v in read.items() if k not in ("auto_map", "architectures")})
    total, active = hybrid_parameters(read, recurrent.recurrent_state(read))
    assert total == stored_count(built)
    assert active <= total
    if isinstance(given, Path) and "Qwen3" in given.name:
        # 80B with 3B active, as the model's name says (its multi-token-prediction layer aside).
        assert (total, active) == (79_674_391_296, 3_874_929_408)


@pytest.mark.parametrize(
    ("config", "tp", "block", "state_bytes"),
    # Qwen3-Next at TP 4 too: its 2 KV heads copied, one on each GPU (vLLM's num_kv_head_replicas).
    [
        (QWEN3_NEXT, 2, 576, 548_864),
        (QWEN3_NEXT, 4, 320, 274_432),
        (NEMOTRON_H, 2, 4128, 8_450_048),
        (QWEN3_5_MOE, 2, 1088, 1_073_152),
    ],
)
def test_kvpilot_plan_sizes_a_hybrid_for_vllm_with_its_state_pages(
    config: Path, tp: int, block: int, state_bytes: int
) -> None:
    # Not speculating (test_a_hybrid_speculates_with_a_state_page_per_draft_token), on `tp` GPUs.
    run = plan_command(
        "--model-config",
        str(config),
        "--gpu",
        "H100-80GB",
        "--gpus",
        str(tp),
        "--runtime",
        "vllm",
        "--speculative",
        "off",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    planned = json.loads(run.stdout)
    read = read_config(json.loads(config.read_text()), "t")
    assert not isinstance(read, str), read
    state = recurrent.architecture_state(read.architecture)
    assert state == recurrent.recurrent_state(hybrid_config(config.stem))
    # FlashInfer's Gated DeltaNet (Hopper) and Mamba-2 both keep a checkpoint page: 3 per group.
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving("H100-80GB", tp))
    assert (planned["gpu_count"], planned["block_size"], hybrid.block_size) == (tp, block, block)
    assert recurrent.state_page_bytes(state, tp) == state_bytes
    # vLLM is told the block size it would raise serving.blockSize to, so that it keeps the planned one.
    assert f"--block-size={block}" in planned["args"]
    layout = hybrid.layout
    assert planned["kv_blocks"] == planned["kv_pool_bytes"] // sizing.kv_block_bytes(layout, block)
    mean = math.ceil(512 + 256 / 2)  # the spec's default load: prompt + half the output
    fitting = planned["kv_blocks"] // sizing.sequence_blocks(layout, mean, block, 0)
    assert planned["max_num_seqs"] == min(fitting, 1024) and fitting > 0
    kv = planned["reasons"]["kvCache"]
    assert f"a state per sequence of {state_bytes:,} bytes per GPU" in kv and f"{block}-token blocks" in kv
    assert f"{planned['max_num_seqs']} sequences at the mean context" in kv
    assert f"{layout.state_groups} state layer groups; 3 state pages per sequence and group" in kv
    # Our engine runs no state layers.
    ours = plan_command("--model-config", str(config), "--gpu", "H100-80GB", "--runtime", "kvpilot", "--json")
    refused = json.loads(ours.stdout)
    assert ours.returncode == 1 and refused["failure"] == "UnsupportedByRuntime", refused
    assert f"{state.layers} {state.kind} layers that keep a state per sequence" in refused["reason"]


def test_adapters_on_a_hybrid_are_not_planned_as_if_its_state_layers_were_attention() -> None:
    read = read_config(json.loads(NEMOTRON_H.read_text()), "t")
    assert not isinstance(read, str), read
    spec = InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {
                "name": "nemotron-h",
                "architecture": read.architecture.model_dump(by_alias=True, exclude_none=True),
            },
            "accelerator": {"type": "H100-80GB"},
            "adapters": [{"name": "sql", "source": "hf://org/sql-lora", "rank": 8}],
        }
    )
    refused = plan(spec)
    assert refused.failure == "AdaptersNotPlanned" and "mamba2 layers' projections" in refused.reason, refused.reason
    # Without adapters the same spec plans.
    assert plan(spec.model_copy(update={"adapters": []})).fits


@pytest.mark.parametrize("name", ["granite-4.0-h-moe-biases", "falcon-h1"])
def test_kvpilot_plan_sizes_granite_4_h_and_falcon_h1_for_vllm(name: str, tmp_path: Path) -> None:
    """Their layers counted as vLLM builds them (test_model_config checks the count against vLLM's
    modules) and their state as vLLM holds it; Falcon-H1's every layer keeps both K and V and a state."""
    config = TINY_HYBRIDS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = plan_command(
        "--model-config", str(tmp_path), "--gpu", "H100-80GB", "--runtime", "vllm", "--speculative", "off", "--json"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    planned = json.loads(run.stdout)
    state = recurrent.recurrent_state(config)
    assert state is not None
    total, _ = hybrid_parameters(config, state)
    block = recurrent.hybrid_kv(state, recurrent.Serving("H100-80GB")).block_size
    assert planned["fits"] and planned["weight_bytes"] == 2 * total
    assert planned["block_size"] == block and f"--block-size={block}" in planned["args"]
    assert f"in each of {state.layers} mamba2 layers a state per sequence" in planned["reasons"]["kvCache"]
    assert f"in {state.attention_layers} attention layers" in planned["reasons"]["kvCache"]


def _planned(config: Path, *args: str) -> dict:
    run = plan_command("--model-config", str(config), "--gpu", "H100-80GB", "--runtime", "vllm", *args, "--json")
    return json.loads(run.stdout)


@pytest.mark.parametrize(("config", "tp"), [(QWEN3_NEXT, 2), (NEMOTRON_H, 2), (QWEN3_5_MOE, 1)])
def test_a_hybrid_speculates_with_a_state_page_per_draft_token(config: Path, tp: int) -> None:
    """At a load light enough (a batch under 8) auto speculates with prompt lookup, and the replica is
    sized as vLLM then holds it (test_model_config checks those pages against vLLM's own): each state
    layer's page a convolution row wider and a page more per sequence and group for each draft token."""
    k = 4
    state = recurrent.recurrent_state(hybrid_config(config.stem))
    assert state is not None
    off = _planned(config, "--gpus", str(tp), "--speculative", "off")
    for mode in ("auto", "ngram"):
        planned = _planned(config, "--gpus", str(tp), "--rps", "0.5", "--speculative", mode)
        assert planned["fits"] and planned["speculative"] == "ngram", planned["reason"]
        assert f'"num_speculative_tokens":{k}' in next(a for a in planned["args"] if "--speculative-config" in a)
        # In the KV cache's dtype the plan chose (FP8 where the context fits only so): a token's bytes.
        serving = recurrent.Serving("H100-80GB", tp, bytes_per_value=1 if planned["kv_cache_dtype"] == "fp8" else 2)
        hybrid = recurrent.hybrid_kv(state, serving._replace(speculative_tokens=k))
        pages = hybrid.layout.state_blocks
        assert pages == recurrent.hybrid_kv(state, serving).layout.state_blocks + k
        assert planned["block_size"] == hybrid.block_size >= off["block_size"]
        assert f"--block-size={hybrid.block_size}" in planned["args"]
        assert recurrent.state_page_bytes(state, tp, k) > recurrent.state_page_bytes(state, tp)
        assert planned["kv_blocks"] == planned["kv_pool_bytes"] // sizing.kv_block_bytes(
            hybrid.layout, hybrid.block_size
        )
        fitting = planned["kv_blocks"] // sizing.sequence_blocks(hybrid.layout, 512 + 128, hybrid.block_size, 0)
        assert planned["max_num_seqs"] == min(fitting, 1024)
        kv = planned["reasons"]["kvCache"]
        assert f"a state per sequence of {recurrent.state_page_bytes(state, tp, k):,} bytes per GPU" in kv
        assert f"{pages} state pages per sequence and group under prefix caching, {k} of them" in kv


def test_jamba_does_not_speculate_and_no_drafter_is_planned_beside_state_layers(tmp_path: Path) -> None:
    """vLLM 0.33's Mamba (1) mixer verifies no drafts: auto leaves Jamba off, a pinned mode is refused;
    a draft model's or an EAGLE head's layers beside a hybrid's pages are not sized: refused too."""
    jamba = HF_CONFIGS / "ai21labs--AI21-Jamba-1.5-Mini.json"
    light = ("--rps", "0.5", "--gpus", "2")
    auto = _planned(jamba, *light)
    assert auto["fits"] and auto["speculative"] == "off", auto["reason"]
    assert "mamba1 layers verify no drafts" in auto["reasons"]["speculative"]
    pinned = _planned(jamba, *light, "--speculative", "ngram")
    assert pinned["failure"] == "UnsupportedByRuntime" and "Mamba (1) mixer" in pinned["reason"], pinned["reason"]
    # A draft of the target's vocabulary (the engine drafts only with the target's tokens).
    draft = tmp_path / "config.json"
    llama = json.loads((HF_CONFIGS / "meta-llama--Llama-3.2-3B.json").read_text())
    draft.write_text(json.dumps({**llama, "vocab_size": json.loads(QWEN3_NEXT.read_text())["vocab_size"]}))
    drafted = _planned(QWEN3_NEXT, *light, "--speculative", "draft", "--draft-model-config", str(draft))
    assert drafted["failure"] == "UnsupportedByRuntime", drafted["reason"]
    assert "a draft model's layers would share the blocks" in drafted["reason"]
    # Auto with a draft model at hand speculates with prompt lookup instead.
    auto = _planned(QWEN3_NEXT, *light, "--draft-model-config", str(draft))
    assert auto["speculative"] == "ngram" and auto["draft_weight_bytes"] == 0, auto["reasons"]["speculative"]
    assert "is not run: a draft model's layers would share the blocks" in auto["reasons"]["speculative"]
