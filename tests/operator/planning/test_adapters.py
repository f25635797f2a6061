"""LoRA adapters in the plan: the settings (max_loras, max_lora_rank, max_cpu_loras), the GPU memory
their slots take from the KV pool (as vLLM 0.33 preallocates them), their step cost, the reasons, and
the adapter sets that cannot be served."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator import cli
from kvpilot.operator.api.spec import AdapterSpec, InferenceServiceSpec
from kvpilot.operator.planning import adapters, sizing
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.operator.planning.test_cpu_plan import _compiled, _steps, builtin
from tests.operator.planning.test_cpu_plan import spec as cpu_spec


def lora(*ranks: int | None) -> list[dict[str, Any]]:
    return [{"name": f"a{i}", "source": f"/adapters/a{i}", **({"rank": r} if r else {})} for i, r in enumerate(ranks)]


def spec(adapter_list: list[dict[str, Any]], runtime: str = "vllm", **sections: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "runtime": runtime,
            "model": {"name": "llama-3-8b"},
            "accelerator": {"type": "A100-80GB", "count": 1},
            "adapters": adapter_list,
            **sections,
        }
    )


def vllm_slot_values(model: str, rank: int, tp: int) -> int:
    """One slot's values on one GPU, from the shapes vLLM 0.33's create_lora_weights allocates for a
    Llama (tensor-parallel rank 0), written out tensor by tensor."""
    arch = MODELS[model]
    hidden, head, vocab = arch.hidden_size, arch.head_size, arch.vocab_size
    q, kv, mlp = arch.attention_heads * head // tp, arch.kv_heads * head // tp, 14336 // tp
    assert model == "llama-3-8b"  # its intermediate_size is 14336
    layer = (
        # qkv_proj (MergedQKVParallelLinearWithLoRA): lora_a (rank, hidden) x 3 slices, lora_b (q|k|v, rank)
        3 * rank * hidden
        + (q + kv + kv) * rank
        # o_proj (RowParallelLinearWithLoRA): lora_a (rank, q per GPU), lora_b (hidden, rank)
        + rank * q
        + hidden * rank
        # gate_up_proj (MergedColumnParallelLinearWithLoRA): lora_a (rank, hidden) x 2, lora_b (mlp, rank) x 2
        + 2 * rank * hidden
        + 2 * mlp * rank
        # down_proj (RowParallelLinearWithLoRA): lora_a (rank, mlp per GPU), lora_b (hidden, rank)
        + rank * mlp
        + hidden * rank
    )
    # embed_tokens (VocabParallelEmbeddingWithLoRA): a (vocab, rank), b (hidden, rank); the LM head
    # (LogitsProcessorWithLoRA): a (rank, hidden), b (vocab, rank).
    ends = vocab * rank + hidden * rank + rank * hidden + vocab * rank
    return arch.layers * layer + ends


def test_llama_3_8b_slots_are_what_vllm_allocates() -> None:
    arch = MODELS["llama-3-8b"]
    one = adapters.slot_bytes(arch, 16, 1, 2)
    assert one == vllm_slot_values("llama-3-8b", 16, 1) * 2 == 92_356_608  # 88.1 MiB per rank-16 slot
    settings = adapters.lora_settings([AdapterSpec(name=f"a{i}", source="/a", rank=16) for i in range(4)])
    assert settings is not None
    assert adapters.resident_bytes(arch, settings, 1, 2) == 4 * one == 369_426_432  # 352 MiB
    # Under tensor parallelism each GPU holds its share of the sharded side and the whole of the other.
    assert adapters.slot_bytes(arch, 16, 2, 2) == 2 * vllm_slot_values("llama-3-8b", 16, 2) * 2


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ((8,), (4, 8, 16, 0)),
        ((12, 16), (4, 16, 16, 0)),
        ((None,), (4, adapters.ASSUMED_RANK, 16, 1)),
        ((4, 64, None, 8, 16, 1), (adapters.MAX_RESIDENT, 64, 16, 1)),
        ((300,), (4, 320, 16, 0)),
        ((512, 1), (4, 512, 16, 0)),
        ((2,), (4, 8, 16, 0)),
        ((8,) * 20, (4, 8, 20, 0)),  # past CPU_CACHED: every adapter cached
    ],
)
def test_settings_hold_every_adapter_in_host_memory_and_a_few_on_the_gpu(
    ranks: tuple[int | None, ...], expected: tuple[int, int, int, int]
) -> None:
    settings = adapters.lora_settings([AdapterSpec.model_validate(a) for a in lora(*ranks)])
    assert settings is not None
    assert (settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras, settings.unranked) == expected
    assert settings.max_lora_rank in adapters.MAX_LORA_RANKS
    assert adapters.lora_settings([]) is None


def test_the_slots_come_out_of_the_kv_pool_and_the_reasons_say_how_much() -> None:
    # Our engine's reserve does not follow the pool, so the difference is exactly the slots.
    base = plan(spec([], runtime="kvpilot"))
    served = plan(spec(lora(16, 16, 16, 8, None), runtime="kvpilot"))
    assert base.fits and served.fits
    assert served.lora is not None
    assert (served.lora.adapters, served.lora.max_loras, served.lora.max_lora_rank, served.lora.max_cpu_loras) == (
        5,
        4,
        16,
        16,
    )
    assert served.lora.slot_bytes == 369_426_432
    assert base.kv_pool_bytes - served.kv_pool_bytes == served.lora.slot_bytes
    assert served.weight_bytes == base.weight_bytes  # the weights are the model's; the slots are apart
    assert "LoRA slots 0.3 GiB" in served.reasons["kvCache"]
    why = served.reasons["adapters"]
    assert why.startswith("max_loras 4, max_lora_rank 16, max_cpu_loras 16: 4 slots on the GPU for 5 adapter(s)")
    assert "352 MiB of GPU memory from the KV pool" in why
    assert "1 adapter(s) without a rank counted as rank 16" in why
    assert "a decode step reads them, +0.18 ms at most" in why  # 352 MiB at the A100's 2039 GB/s
    assert "prefill's low-rank products add 0.6% to its FLOPs" in why
    # A plan without adapters has no LoRA settings, no reason for them, and dumps as before they existed.
    assert base.lora is None and "adapters" not in base.reasons
    assert "lora" not in base.model_dump() and "lora" in served.model_dump()


def test_vllm_plans_count_the_slots_with_the_weights_it_profiles() -> None:
    base, served = plan(spec([])), plan(spec(lora(64, 64)))
    slots = adapters.MAX_RESIDENT * adapters.slot_bytes(MODELS["llama-3-8b"], 64, 1, 2)
    assert served.lora is not None and served.lora.slot_bytes == slots
    # vLLM's sampler reserve follows max_num_seqs, which a smaller pool lowers: the pool shrinks by about the slots.
    shrink = base.kv_pool_bytes - served.kv_pool_bytes
    assert served.lora.slot_bytes * 0.95 <= shrink <= served.lora.slot_bytes
    assert served.max_num_seqs < base.max_num_seqs


def test_a_decode_step_reads_the_resident_slots() -> None:
    quiet = {"load": {"requestsPerSecond": 0.1}, "serving": {"speculative": "off"}}
    base, served = plan(spec([], runtime="kvpilot", **quiet)), plan(spec(lora(256, 256), runtime="kvpilot", **quiet))
    assert served.lora is not None
    # 2 rank-256 slots, 2.75 GiB, read in every decode step at the A100's ~2 TB/s: 1.45 ms a step, a little
    # more at the p95 TPOT (whose steps also carry prefill chunks).
    read_ms = served.lora.slot_bytes / 2039e9 * 1000
    assert read_ms <= served.predicted_tpot_ms - base.predicted_tpot_ms <= 1.5 * read_ms


def test_adapters_that_leave_no_room_for_one_sequence_are_a_clear_no_fit() -> None:
    pinned = {"serving": {"maxContextLength": 8192, "quantization": "none", "kvCacheDtype": "model"}}
    on_l4 = {**pinned, "accelerator": {"type": "L4", "count": 1}}
    assert plan(spec(lora(64, 64, 64, 64), **on_l4)).fits
    refused = plan(spec(lora(128, 128, 128, 128), **on_l4))
    assert not refused.fits and refused.failure == "ContextDoesNotFit"
    assert refused.lora is None
    assert refused.reason.startswith(
        "one 8192-token sequence needs 1.0 GiB of KV cache but only 0.8 GiB is left of 90% of the 22.0 GiB L4 "
        "reports (19.8 GiB) after none weights 15.0 GiB + LoRA slots 2.8 GiB"
    )
    heavy = plan(spec(lora(512, 512, 512, 512), **on_l4))
    assert heavy.failure == "WeightsDoNotFit"
    assert "+ LoRA slots 11.0 GiB + runtime reserve" in heavy.reason


def test_a_mixture_of_experts_slots_are_not_sized() -> None:
    refused = plan(
        InferenceServiceSpec.model_validate(
            {"runtime": "vllm", "model": {"name": "mixtral-8x7b"}, "adapters": lora(16)}
        )
    )
    assert refused.failure == "AdaptersNotPlanned"
    assert "allocated per expert" in refused.reason


def test_our_engine_runs_adapters_without_a_draft_model_or_a_compiled_step() -> None:
    pinned = plan(spec(lora(8), runtime="kvpilot", serving={"speculative": "draft", "draftModel": "/drafts/x"}))
    assert pinned.failure == "UnsupportedByRuntime"
    assert "serving.speculative 'draft': runtime kvpilot does not run it with spec.adapters" in pinned.reason
    drafted = {"speculative": "auto", "draftModel": "hf://meta-llama/Llama-3.2-1B-Instruct"}
    with_draft = plan(spec([], runtime="kvpilot", serving=drafted, load={"requestsPerSecond": 0.1}))
    assert with_draft.speculative == "draft"  # without adapters auto picks the draft model here
    served = plan(spec(lora(8), runtime="kvpilot", serving=drafted, load={"requestsPerSecond": 0.1}))
    assert served.fits and served.speculative == "ngram"
    # Where a compiled decode step is what meets the TPOT SLO (test_cpu_plan's case), adapters keep the
    # eager step, the one that serves them.
    eager_ms = _steps(builtin(), "none").decode[0].seconds * 1000
    tight = {"load": {"requestsPerSecond": 0.2, "meanPromptTokens": 60, "meanOutputTokens": 64}}
    cpu = cpu_spec("compiled", slo={"tpotP95Ms": round(eager_ms * 0.9)}, serving={"quantization": "none"}, **tight)
    measured = PlanContext(device_profiles={"compiled": _compiled(eager_ms * 0.6 / 1000)})
    assert plan(cpu, measured).compile_decode
    served = plan(cpu.model_copy(update={"adapters": [AdapterSpec.model_validate(a) for a in lora(8)]}), measured)
    assert served.fits and served.lora is not None and not served.compile_decode
    assert "compiledDecode" not in served.reasons


def test_speculating_with_adapters_verifies_every_running_sequence_in_one_step() -> None:
    served = plan(spec(lora(8), serving={"speculative": "ngram"}))
    assert served.fits and served.speculative == "ngram" and served.num_speculative_tokens == 4
    assert served.max_num_batched_tokens >= served.max_num_seqs * 5
    assert "with adapters and speculation each step verifies k + 1 = 5 tokens" in served.reasons["kvCache"]


def test_the_slots_scale_with_rank_slots_and_tensor_parallelism() -> None:
    arch = MODELS["llama-3-8b"]
    assert adapters.slot_bytes(arch, 32, 1, 2) == 2 * adapters.slot_bytes(arch, 16, 1, 2)
    # TP splits the layers' sharded side and repeats the rest on each GPU: more in all, less per GPU.
    one, two = adapters.slot_bytes(arch, 16, 1, 2), adapters.slot_bytes(arch, 16, 2, 2)
    assert one < two < 2 * one
    assert sizing.GiB > 4 * one


MANIFEST = """
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: chat, namespace: team-a}
spec:
  runtime: vllm
  model: {name: llama-3-8b}
  accelerator: {type: A100-80GB}
  adapters:
    - {name: sql, source: "hf://org/sql-lora", rank: 16}
    - {name: support, source: "pvc://adapters/support", rank: 16}
    - {name: legal, source: /adapters/legal}
    - {name: hr, source: /adapters/hr, rank: 8}
"""


def _plan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(argv)
    out = io.StringIO()
    code = cli.run_plan(args, out=out)
    return code, out.getvalue() + capsys.readouterr().err


def test_kvpilot_plan_reads_the_adapters_of_a_manifest_and_shows_their_slots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "chat.yaml"
    manifest.write_text(MANIFEST)
    code, text = _plan_cli(["plan", "-f", str(manifest)], capsys)
    assert code == 0, text
    settings = "4: max_loras 4, max_lora_rank 16, max_cpu_loras 16; slots 0.34 GiB (taken from the KV pool)"
    assert f"LoRA adapters       {settings}" in text
    assert "  adapters: max_loras 4, max_lora_rank 16, max_cpu_loras 16: 4 slots on the GPU for 4 adapter(s)" in text
    code, text = _plan_cli(["plan", "-f", str(manifest), "--json"], capsys)
    body = json.loads(text)
    assert body["lora"] == {
        "adapters": 4,
        "max_loras": 4,
        "max_lora_rank": 16,
        "max_cpu_loras": 16,
        "slot_bytes": 369_426_432,
    }
    assert body["args"][-4:] == ["--enable-lora", "--max-loras=4", "--max-lora-rank=16", "--max-cpu-loras=16"]
    # The spec's own rules hold for a manifest as the API server's do.
    manifest.write_text(MANIFEST.replace("name: hr", "name: sql"))
    code, text = _plan_cli(["plan", "-f", str(manifest)], capsys)
    assert code == 2 and "adapters: each name once (sql repeated)" in text
    # Without adapters the table has no LoRA row and no adapters reason.
    code, text = _plan_cli(["plan", "--model", "llama-3-8b", "--gpu", "A100-80GB", "--runtime", "vllm"], capsys)
    assert code == 0 and "LoRA" not in text and "adapters:" not in text
