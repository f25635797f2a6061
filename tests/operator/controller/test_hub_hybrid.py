"""A hybrid (Gated DeltaNet or Mamba-2 layers beside attention) known only by its hf:// repository:
the operator reads its config.json through the Hub client, plans it for vLLM with its state pages,
and keeps that architecture, state included, in status.lastGoodPlan."""

from __future__ import annotations

import json
from pathlib import Path

from kvpilot.operator.api.status import status_of
from kvpilot.operator.controller.reconcile import decide, observe
from kvpilot.operator.planning import recurrent
from tests.operator.controller.test_decide import HUB_SPEC, FakeHub, Secrets, deployment, kinds
from tests.operator.controller.test_reconcile import body

QWEN3_NEXT = Path(__file__).parents[1] / "planning" / "hf_configs" / "Qwen--Qwen3-Next-80B-A3B-Thinking.json"


def test_a_hybrid_known_only_by_its_repository_is_planned_for_vllm_with_its_state_pages() -> None:
    config = json.loads(QWEN3_NEXT.read_text())
    # Two GPUs pinned: the state page per GPU below is TP 2's (left to itself the planner takes 4, which
    # vLLM runs with the 2 KV heads copied: tests/operator/planning/test_tensor_parallel.py).
    spec = {**HUB_SPEC, "runtime": "vllm", "accelerator": {"type": "H100-80GB", "count": 2}}
    decided = decide(observe(body(spec), Secrets(), None, FakeHub(config)), "i", None)  # type: ignore[arg-type]
    result = decided.result
    assert result.fits and result.reasons["model"] == "the checkpoint's config.json of hf://acme/tiny-chat@v2"
    # 36 Gated DeltaNet layers: on two H100s (FlashInfer's prefill), 576-token blocks hold a state page,
    # its convolution window 4 rows wider for the 4 prompt-lookup tokens auto drafts at this light load.
    assert (result.gpu_count, result.block_size, result.speculative) == (2, 576, "ngram")
    assert "a state per sequence of 581,632 bytes per GPU" in result.reasons["kvCache"]
    assert "7 state pages per sequence and group under prefix caching, 4 of them" in result.reasons["kvCache"]
    args = deployment(decided.wanted)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--block-size=576" in args
    # The state is kept with the architecture: the status's types take it as written, and it is the config's.
    assert decided.last_good is not None
    written = decided.last_good.dump()
    assert written["checkpoint"]["architecture"]["state"]["kind"] == "gated_deltanet"
    typed = status_of({"status": {"lastGoodPlan": written}}).last_good_plan
    assert typed is not None and typed.model_dump(mode="json", by_alias=True, exclude_none=True) == written
    kept = typed.checkpoint.architecture if typed.checkpoint else None
    assert kept is not None and recurrent.architecture_state(kept) == recurrent.recurrent_state(config)
    # Our engine runs no state layers: a clear refusal, no Deployment of a guess.
    one_gpu = {**spec, "runtime": "kvpilot", "accelerator": {"type": "H100-80GB"}}
    ours = decide(observe(body(one_gpu), Secrets(), None, FakeHub(config)), "i", None)  # type: ignore[arg-type]
    assert ours.result.failure == "UnsupportedByRuntime" and "gated_deltanet layers" in ours.result.reason
    assert "Deployment" not in kinds(ours.wanted)
