"""Speculative mtp: vLLM drafting with the checkpoint's own multi-token-prediction modules (DeepSeek
V3/R1/V3.2, GLM-4.5 and later), sized beside the target and refused where vLLM would refuse them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning import recurrent, sizing, speculation
from kvpilot.operator.planning.model_config import read_config
from kvpilot.operator.planning.plan import plan

HF_CONFIGS = Path(__file__).parent / "hf_configs"
# DeepSeek-V3 as its repository stores it: metadata.total_size, and of it the MTP layer's bytes as its
# parts' stored dtypes make them (its experts in FP8, its own embedding and head in 16 bits).
DEEPSEEK_V3_TOTAL, DEEPSEEK_V3_MTP = 688_586_727_753, 14_981_005_312


def deepseek_v3(**update: Any) -> tuple[Architecture, str | None]:
    read = read_config(json.loads((HF_CONFIGS / "deepseek-ai--DeepSeek-V3.json").read_text()), "DeepSeek-V3")
    assert not isinstance(read, str)
    checkpoint = {"checkpoint_bytes": DEEPSEEK_V3_TOTAL, "mtp_bytes": DEEPSEEK_V3_MTP, **update}
    return read.architecture.model_copy(update=checkpoint), read.quantization


def spec(
    arch: Architecture, stored: str | None, runtime: str = "vllm", accelerator: dict | None = None, **serving: Any
) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "runtime": runtime,
            "model": {
                "name": "deepseek-v3",
                "source": "hf://deepseek-ai/DeepSeek-V3",
                "architecture": arch.model_dump(by_alias=True, exclude_none=True),
                **({"quantization": stored} if stored else {}),
            },
            "accelerator": accelerator or {"type": "H200"},
            "serving": {"speculative": "mtp", "numSpeculativeTokens": 1, **serving},
        }
    )


def test_deepseek_v3_drafts_with_its_mtp_layer_held_as_stored_beside_it() -> None:
    arch, stored = deepseek_v3()
    modules = arch.mtp
    assert stored == "fp8" and modules is not None and modules.layers == 1
    # One MoE layer, eh_proj (2 x 7168 x 7168) and three norms: 11.6 B values, 0.69 B a token computes with.
    assert modules.parameters == 11_610_068_224 and modules.active_parameters == 688_100_608
    served = spec(arch, stored)
    result = plan(served)
    assert result.fits and result.speculative == "mtp" and result.gpu_count == 8, result.reason
    container = render.deployment("svc", "ns", "uid", served, result)["spec"]["template"]["spec"]["containers"][0]
    assert '--speculative-config={"method":"mtp","num_speculative_tokens":1}' in container["args"]
    assert result.draft_model is None  # nothing to download: the drafter is in the target's checkpoint
    # Held as stored: at least the MTP tensors' bytes less the copies of the embedding and head vLLM
    # drops for the target's (11.27 GB of experts here), at most 5 % more (eh_proj, a plain nn.Linear,
    # in 16 bits), with what vLLM holds whole (eh_proj, norms, router, latent down-projections) on all 8.
    drafter = sizing.mtp_drafter(arch)
    layer = sizing.held_by_group(drafter, DEEPSEEK_V3_MTP - 2 * 129280 * 7168 * 2, 8)
    assert layer <= result.draft_weight_bytes <= layer * 1.05
    # One more latent per token (576 values, on each GPU), in the target's blocks.
    assert result.draft_kv_bytes_per_token == 576 * 2 * 8
    assert result.assumed_draft_acceptance == pytest.approx(speculation.PER_TOKEN_ACCEPTANCE["mtp"], abs=1e-3)
    assert "drafting with hf://deepseek-ai/DeepSeek-V3 (its MTP modules)" in result.reasons["speculative"]
    # Against no speculation: the drafter's memory, for a TPOT shorter at a lone sequence's batch.
    off = plan(spec(arch, stored, speculative="off", maxContextLength=8192))
    lone = plan(spec(arch, stored, maxContextLength=8192))
    assert lone.kv_blocks < off.kv_blocks and lone.predicted_tpot_ms < off.predicted_tpot_ms


def test_vllm_never_runs_mtp_where_it_would_refuse_it() -> None:
    arch, stored = deepseek_v3()
    # A checkpoint read without MTP tensors (a quantization that dropped them): vLLM refuses at load.
    none = plan(spec(arch.model_copy(update={"mtp_bytes": None}), stored))
    assert none.failure == "NoMtpModules" and "holds none" in none.reason
    unknown = plan(spec(arch.model_copy(update={"mtp_bytes": None, "checkpoint_bytes": None}), None))
    assert unknown.failure == "NoMtpModules" and "mtpBytes" in unknown.reason
    # A model without modules vLLM drafts with.
    plain = plan(spec(arch.model_copy(update={"mtp": None}), stored))
    assert plain.failure == "NoMtpModules" and "DeepseekV3ForCausalLM" in plain.reason
    # k drafts with n modules: whole rounds of them only.
    two = arch.model_copy(update={"mtp": arch.mtp.model_copy(update={"layers": 2})})  # type: ignore[union-attr]
    assert plan(spec(two, stored, numSpeculativeTokens=4)).fits
    odd = plan(spec(two, stored, numSpeculativeTokens=3))
    assert odd.failure == "UnsupportedByRuntime" and "numSpeculativeTokens 3" in odd.reason
    # Our engine drafts with none; vLLM beside adapters was never checked with one.
    ours = plan(spec(arch, None, runtime="kvpilot"))
    assert ours.failure is not None and "serving.speculative 'mtp'" in ours.reason


def test_auto_never_chooses_mtp() -> None:
    arch, stored = deepseek_v3()
    chosen = plan(spec(arch, stored, speculative="auto", maxContextLength=8192))
    assert chosen.fits and chosen.speculative != "mtp"


def qwen3_next(tp: int, **serving: Any) -> tuple[Architecture, InferenceServiceSpec]:
    """Qwen3-Next-80B as its bf16 checkpoint holds it: its MTP module's tensors (mtp.*: no copies of the
    embedding or the head) beside the decoder's, served on `tp` H100s."""
    read = read_config(json.loads((HF_CONFIGS / "Qwen--Qwen3-Next-80B-A3B-Thinking.json").read_text()), "Qwen3-Next")
    assert not isinstance(read, str) and read.architecture.mtp is not None
    arch = read.architecture
    mtp_bytes = 2 * arch.mtp.parameters  # type: ignore[union-attr]
    arch = arch.model_copy(update={"checkpoint_bytes": 2 * arch.parameters + mtp_bytes, "mtp_bytes": mtp_bytes})
    return arch, spec(arch, None, accelerator={"type": "H100-80GB", "count": tp}, **serving)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_next_drafts_with_its_mtp_module_in_its_hybrid_blocks(tp: int) -> None:
    """Qwen3-Next's one MTP module (a gated-attention layer with its experts, fc and three norms) drafts k
    tokens: its attention layer's K and V sit in the blocks vLLM raises for the state pages, which keep a
    page and a convolution row more per draft token (test_model_config checks it against vLLM's drafter)."""
    k = 2
    arch, served = qwen3_next(tp, numSpeculativeTokens=k, maxContextLength=32768)
    modules, state = arch.mtp, recurrent.architecture_state(arch)
    assert modules is not None and modules.layers == 1 and state is not None
    result = plan(served)
    assert result.fits and result.speculative == "mtp" and result.gpu_count == tp, result.reason
    container = render.deployment("svc", "ns", "uid", served, result)["spec"]["template"]["spec"]["containers"][0]
    assert '--speculative-config={"method":"mtp","num_speculative_tokens":2}' in container["args"]
    drafter = sizing.mtp_drafter(arch)
    # In 16 bits, what each GPU holds whole (norms, router, shared expert gate) on all of them.
    assert result.draft_weight_bytes == sizing.held_by_group(drafter, 2 * modules.parameters, tp)
    assert result.draft_kv_bytes_per_token == sizing.kv_bytes_per_token(drafter, 2, tp) > 0
    hybrid = recurrent.hybrid_kv(state, recurrent.Serving("H100-80GB", tp, speculative_tokens=k, mtp_layers=1))
    assert result.block_size == hybrid.block_size and f"--block-size={hybrid.block_size}" in container["args"]
    assert result.kv_blocks == result.kv_pool_bytes // sizing.kv_block_bytes(hybrid.layout, hybrid.block_size)
    assert "mtp: set in the spec; drafting with" in result.reasons["speculative"]
    assert "(its MTP modules)" in result.reasons["speculative"]
    # Against no speculation: the module's weights and state pages, for a shorter TPOT at a lone sequence.
    off = plan(served.model_copy(update={"serving": served.serving.model_copy(update={"speculative": "off"})}))
    assert off.fits and result.kv_pool_bytes < off.kv_pool_bytes
    assert result.predicted_tpot_ms < off.predicted_tpot_ms


def test_a_hybrid_without_mtp_modules_vllm_drafts_with_is_refused() -> None:
    arch, served = qwen3_next(2)
    unknown = plan(spec(arch.model_copy(update={"mtp_bytes": None, "checkpoint_bytes": None}), None))
    assert unknown.failure == "NoMtpModules" and "mtpBytes" in unknown.reason
    # Nemotron-H's (vLLM's NemotronHMTP) are not counted: refused, naming those that are.
    read = read_config(json.loads((HF_CONFIGS / "nvidia--Nemotron-H-56B-Base-8K.json").read_text()), "Nemotron-H")
    assert not isinstance(read, str) and read.architecture.mtp is None
    nemotron = plan(spec(read.architecture, None))
    assert nemotron.failure == "NoMtpModules" and "Qwen3NextForCausalLM" in nemotron.reason, nemotron.reason
    assert plan(served).fits
