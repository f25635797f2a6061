"""The planner's GPU latency against published vLLM serving benchmarks at fixed concurrency
(bench/latency_calibration.py over bench/public/vllm_serving_points.json: each point's source, model,
GPU, tensor parallelism, checkpoint scheme, lengths and concurrency).

The bounds are the counts the calibrated model reaches, so that a change which loses a point fails
here; every point outside them is named below with why. The constants were chosen on the fit points
(newer vLLM, models up to 120B, and every other point of the modern set, by index); the held-out ones
(DeepSeek-R1 and Llama 3.1 405B on 8 GPUs, older vLLM builds) were not looked at while choosing them,
and the model misses them all: those builds ran far below what the same GPUs reach with the vLLM the
planner renders for. The modern held-out set (dense models on vLLM 0.8 and later, gathered after the
first constants were set; its other half chose the per-sequence step cost and the GEMM efficiency
curve) holds every TPOT within 15 % and misses only a 0.5B model's TTFT on an L4 benchmarked from a
Kubernetes Job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import latency_calibration as lc
from kvpilot.operator.planning import latency, sizing
from kvpilot.operator.planning.model_config import read_config

ROWS = lc.rows()
HF_CONFIGS = Path(__file__).parent / "hf_configs"
BY_INDEX = {row.case.index: row for row in ROWS}

DEEPSEEK = (
    "vLLM 0.7.3 / 0.7.4 (early 2025) on DeepSeek-R1: the TTFT follows the wave's (c + 1) / 2 prompts (its ratio is "
    "flat over c = 4..128) but each 3200-token prefill takes 5-10x our estimate, and decoding 1.6-3x our reads "
    "(those builds' MLA prefill and block-FP8 fused MoE)"
)
ROCM_405B = (
    "an early ROCm source build of vLLM 0.6.3 (Oct 2024) on 8 MI300X: decode at ~2 TB/s of each GPU's 5.3 (1.6x our "
    "estimate, 4-5x from c = 64 on: their note blames its CUDA-graph sizes), prefill at ~5 % of peak"
)
FAST_PREFILL = (
    "a row of the tt-inference-server harness (2-8 requests a row) faster than its neighbours allow: Qwen2.5-72B's "
    "2048 tokens in 150 ms on 2 H100s (its 1024 took 129, its 4096 505) and Qwen3-14B's 4096 in 217 ms (its 2048 "
    "took 283) would need 90 % of the GPUs' dense peak and more, where their other rows reach 55-70 %"
)
L4_SMALL_MODEL = (
    "Qwen2.5-0.5B on an L4 (vLLM 0.23, 256-token prompts), benchmarked from a Kubernetes Job, the server on a 4-vCPU "
    "host: TTFT 38-135 ms at c = 2-32 where our waves of 256-token prefills and 5 ms per request give 11-60 ms "
    "(0.27-0.44): a fixed 25-75 ms of the client path and host that the model lacks, not the GPU's work"
)
CHAT_CLIENT_SHAREGPT = (
    "Qwen3-8B on an H100 (vLLM 0.11, gpustack's performance lab): ShareGPT prompts of 233 tokens on average through "
    "the chat endpoint, TTFT a flat 60-65 ms at c = 1-8 where ours is 13-30 ms: ~47 ms a request beyond our 5 ms "
    "(the page's SGLang, same client and GPU: 27 ms) that no GPU work explains; and prompts of varying length keep "
    "the clients out of step, so the waves our closed loop assumes (ours rising with c) do not form"
)
# Published point -> why the model misses it (TPOT beyond 25 % or TTFT beyond 50 %).
MISSES: dict[int, str] = {
    **{i: DEEPSEEK for i in range(17, 29)},
    **{i: ROCM_405B for i in (29, 30, 31, 32, 34, 35, 36, 37, 38)},
    13: "a custom chat client (AsyncOpenAI, a reasoning model's first streamed chunk): 20 ms beyond our 19 ms",
    15: "the same client on an MI300X: 77 ms, twice the H200's, where its spec sheet is faster",
    16: "the same client on a B200: 43 ms, no faster than the H200's 39: the harness's own time",
    39: "a report of slowness (vllm-project/vllm#20469): AWQ decoding 2.2x its reads at 16k context",
    49: "1k in / 8k out doubles the 1k / 1k TPOT at the same concurrency where our KV reads add 10 %; a power-capping "
    "sweep (the source's title)",
    **{i: FAST_PREFILL for i in (53, 61)},
    **{i: L4_SMALL_MODEL for i in range(71, 76)},
    **{i: CHAT_CLIENT_SHAREGPT for i in range(76, 80)},
}


def _missed(row: lc.Row) -> bool:
    tpot, ttft = row.tpot_ratio, row.ttft_ratio
    return (tpot is not None and abs(tpot - 1) > lc.TPOT_BOUND) or (ttft is not None and abs(ttft - 1) > lc.TTFT_BOUND)


def test_the_points_cover_gpus_sizes_schemes_and_concurrency() -> None:
    points = json.loads(lc.POINTS_FILE.read_text())
    assert len(ROWS) == 63 and all(points[r.case.index]["source"] for r in ROWS)
    assert sum(1 for r in ROWS if r.tpot_ratio) == 59 and sum(1 for r in ROWS if r.case.concurrency == 1) == 29
    assert {r.case.gpu for r in ROWS} >= {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "MI300X", "L4"}
    assert {r.case.tp for r in ROWS} == {1, 2, 8} and {r.case.quantization for r in ROWS} == {
        "none",
        "awq",
        "fp8",
        "mxfp4",
    }
    assert max(r.case.concurrency for r in ROWS) == 256 and max(r.case.prompt for r in ROWS) == 128000


def test_every_miss_is_named_and_the_fit_points_hold() -> None:
    missed = {r.case.index for r in ROWS if _missed(r)}
    assert missed <= set(MISSES), {i: (BY_INDEX[i].ttft_ratio, BY_INDEX[i].tpot_ratio) for i in missed - set(MISSES)}
    found = lc.summaries(ROWS)
    assert found["TPOT fit"].within >= 19 and 0.9 <= found["TPOT fit"].median <= 1.1, found["TPOT fit"]
    assert found["TPOT all"].within >= 32 and found["TTFT all"].within >= 21
    assert found["TTFT c=1 fit"].within >= 9


def test_the_modern_held_out_set_is_dense_models_on_vllm_0_8_and_later() -> None:
    """The even-indexed half of the modern points (the odd half chose GPU_SEQUENCE_OVERHEAD_S and the GEMM
    efficiency curve): 8 lone requests of Qwen2.5-72B on 2 H100s and Qwen3-14B and 1.7B on an A100-40GB at
    128-8192 prompt tokens, and 5 points at 4-50 concurrent requests: Qwen2.5-32B and Qwen2-7B on an A100-80GB
    (vLLM 0.10.1.1, 1024 / 1024), Qwen2.5-0.5B on an L4 (vLLM 0.23, 256 / 128). Every TPOT within 15 %; the
    lone requests' TTFT within 50 % (median 1.02), where the constants before them held 5 of 8."""
    points = json.loads(lc.POINTS_FILE.read_text())
    modern = [r for r in ROWS if r.case.part == lc.MODERN]
    assert [r.case.index for r in modern] == list(range(50, 76, 2))
    assert {r.case.concurrency for r in modern} == {1, 4, 10, 16, 20, 50}
    assert {r.case.model for r in modern} == {
        "Qwen/Qwen2.5-72B-Instruct",
        "Qwen/Qwen3-14B",
        "Qwen/Qwen3-1.7B",
        "Qwen/Qwen2.5-32B",
        "Qwen/Qwen2-7B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
    }
    versions = [points[r.case.index]["vllm_version"].split()[0].split(".") for r in modern]
    assert all((int(major), int(minor)) >= (0, 8) for major, minor, *_ in versions)
    found = lc.summaries(ROWS)
    assert found["TPOT modern aim"][:2] == (13, 13) and 0.93 <= found["TPOT modern"].median <= 1.03
    assert found["TTFT modern"][:2] == (10, 12) and found["TTFT modern aim"][:2] == (5, 12)
    assert found["TTFT c=1 modern"][:2] == (8, 8) and 0.9 <= found["TTFT c=1 modern"].median <= 1.15


def test_a_per_sequence_step_cost_keeps_tpot_level_as_concurrency_rises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without GPU_SEQUENCE_OVERHEAD_S our TPOT ratio fell as c rose (1.11 to 0.88 for the 0.5B model on an L4
    from c = 2 to 32, 0.85 for Qwen2-7B on an A100 at c = 50, 0.85 for gpt-oss-120b at 64 on 8 H100s); with it
    those points stay within 15 %. The A100's TTFT in waves of 1024-token prompts reads as a prefill at half the
    peak, where the lone prompts of the same GPU read faster: 0.73-0.83."""
    crowd = {r.case.index: r for r in ROWS if r.case.part not in (lc.HELD_OUT, lc.LATER) and r.case.concurrency > 1}
    assert sorted(crowd) == [14, 46, 47, 48, 49, *range(66, 76)]
    assert all(abs(crowd[i].tpot_ratio - 1) <= 0.15 for i in (*range(66, 76), 46, 48))
    l4 = [crowd[i].tpot_ratio for i in range(71, 76)]
    assert l4[-1] < l4[0] and l4[0] / l4[-1] < 1.2
    monkeypatch.setattr(latency, "GPU_SEQUENCE_OVERHEAD_S", 0.0)
    flat = [lc.predicted_ms(crowd[i].case)[1] / crowd[i].case.tpot_ms for i in (71, 75, 70, 48)]
    assert flat[0] / flat[1] > 1.25 and flat[2] < 0.86 and flat[3] < 0.86
    assert all(0.7 <= crowd[i].ttft_ratio <= 0.85 for i in (66, 67, 70))


@pytest.mark.parametrize("index", sorted(set(BY_INDEX) - set(MISSES)))
def test_a_point_the_model_explains_stays_within_its_bounds(index: int) -> None:
    row = BY_INDEX[index]
    assert not _missed(row), (row.case, row.ttft_ms, row.tpot_ms)


def test_a_wave_of_concurrent_prompts_waits_its_turn_and_interrupts_the_decodes() -> None:
    """At fixed lengths, TTFT grows as the (c + 1) / 2 prompts a request waits for; TPOT grows by
    the later prompts' prefill steps it decodes through; a lone request pays its own costs."""
    replica = lc.replica(BY_INDEX[40].case)  # Qwen3-14B on an A100, 2048 tokens per step

    def at(c: int) -> tuple[float, float]:
        return latency.at_concurrency(replica, (1024, 256), c, 2048)

    (ttft_1, tpot_1), (ttft_16, tpot_16), (ttft_32, tpot_32) = at(1), at(16), at(32)
    waiting = [t - latency.GPU_REQUEST_OVERHEAD_S for t in (ttft_1, ttft_16, ttft_32)]
    assert waiting[1] / waiting[0] == pytest.approx(17 / 2, rel=0.15) and waiting[2] / waiting[1] > 1.8
    decode_32 = latency.gpu_step_seconds(replica, (32, 1024 + 128))
    assert tpot_1 < tpot_16 < tpot_32 and tpot_32 > 1.2 * decode_32
    assert ttft_1 > latency.GPU_REQUEST_OVERHEAD_S + latency.gpu_overhead_seconds(replica.arch)


def test_local_layers_attend_to_their_window_or_chunk_and_read_only_its_kv() -> None:
    """gpt-oss-120b: 18 of its 36 layers slide over 128 tokens. A decode at 10k tokens attends to (and reads
    the K and V of) 10k tokens in the full layers and 128 in the sliding ones; chunked layers of the same
    size attend to the tokens since their chunk began, 64 on average once past the first chunk."""
    replica = lc.replica(BY_INDEX[48].case)
    arch = replica.arch
    assert (arch.layers, arch.windowed_layers, arch.sliding_window) == (36, 18, 128)
    assert latency._layer_tokens(arch, 10_000) == (18 * 10_000, 18 * 128)
    assert latency._layer_tokens(arch, 100) == (18 * 100, 18 * 100)
    chunked = arch.model_copy(update={"sliding_kind": "chunk"})
    assert latency._layer_tokens(chunked, 10_000) == (18 * 10_000, 18 * 64)
    assert latency._layer_tokens(chunked, 100) == (18 * 100, 18 * 100)
    full = replica._replace(arch=arch.model_copy(update={"sliding_window": None, "sliding_layers": None}))
    assert latency._kv_read_bytes(replica, 10_000) == pytest.approx(replica.kv_per_token * (10_000 + 128) / 2)
    assert latency._kv_read_bytes(full, 10_000) == replica.kv_per_token * 10_000
    assert latency.gpu_step_seconds(replica, (64, 10_000)) < latency.gpu_step_seconds(full, (64, 10_000))


def test_the_later_held_out_set_decodes_within_the_aim_and_misses_the_chat_clients_ttft() -> None:
    """Points gathered after the constants were last set (2026-12-07), never used to choose them: Qwen3-8B on
    one H100 at c = 1, 2, 4 and 8 (vLLM 0.11, ShareGPT through the chat endpoint). TPOT within 15 % but every
    one pessimistic (1.09-1.12: 7.2-7.7 ms published, where our 1 ms + 25 us a layer of step cost beside 6.1 ms
    of weight reads gives 8.0-8.4), as Llama-3.1-8B on an A100 (vLLM 0.23, #65: 1.11) is: recent vLLM's
    step costs less than the mid-2025 builds the constant was read off. TTFT misses (CHAT_CLIENT_SHAREGPT)."""
    later = [r for r in ROWS if r.case.part == lc.LATER]
    assert [(r.case.index, r.case.concurrency) for r in later] == [(76, 1), (77, 2), (78, 4), (79, 8)]
    assert all(1.05 <= r.tpot_ratio <= 1.15 for r in later if r.tpot_ratio)
    ttft = [r.ttft_ratio for r in later]
    assert all(t is not None and t < 0.5 for t in ttft) and ttft == sorted(ttft), ttft
    found = lc.summaries(ROWS)
    assert found["TPOT later aim"][:2] == (4, 4) and found["TTFT later"][:2] == (0, 4)


def test_sparse_attention_attends_to_its_top_k_and_reads_every_tokens_indexer_key() -> None:
    """DeepSeek V3.2 (R1's layers with a lightning indexer) on R1's replica: a decode at 100k tokens
    attends to the indexer's 2048 in each of its 61 layers, reading those latents and every token's
    132-byte key, so its step is a fraction of R1's there; under 2048 tokens it attends to them all
    and reads the keys besides."""
    dense = lc.replica(BY_INDEX[17].case)
    read = read_config(json.loads((HF_CONFIGS / "deepseek-ai--DeepSeek-V3.2.json").read_text()), "v3.2")
    assert not isinstance(read, str), read
    arch = read.architecture
    sparse = dense._replace(arch=arch, kv_per_token=sizing.kv_bytes_per_token(arch, 2, dense.tp))
    assert arch.indexer is not None and (arch.indexer.top_k, arch.indexer.layers) == (2048, 61)
    assert latency._layer_tokens(arch, 100_000) == (61 * 2048, 0)
    assert latency._layer_tokens(arch, 1_000) == (61 * 1_000, 0)
    keys = sizing.indexer_bytes_per_token(arch, dense.tp)
    assert keys == 61 * 132 * dense.tp
    assert latency._kv_read_bytes(sparse, 100_000) == pytest.approx(
        (sparse.kv_per_token - keys) * 2048 + keys * 100_000
    )
    assert latency._kv_read_bytes(sparse, 1_000) == pytest.approx(sparse.kv_per_token * 1_000)
    assert 3 * latency.gpu_step_seconds(sparse, (64, 100_000)) < latency.gpu_step_seconds(dense, (64, 100_000))
    assert latency.gpu_step_seconds(sparse, (64, 1_000)) >= latency.gpu_step_seconds(dense, (64, 1_000))
