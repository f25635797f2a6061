"""Speculative mtp: vLLM drafting with the checkpoint's own multi-token-prediction modules (DeepSeek
V3/R1/V3.2, GLM-4.5 and later), sized beside the target and refused where vLLM would refuse them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning import sizing, speculation
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


def spec(arch: Architecture, stored: str | None, runtime: str = "vllm", **serving: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "runtime": runtime,
            "model": {
                "name": "deepseek-v3",
                "source": "hf://deepseek-ai/DeepSeek-V3",
                "architecture": arch.model_dump(by_alias=True, exclude_none=True),
                **({"quantization": stored} if stored else {}),
            },
            "accelerator": {"type": "H200"},
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
