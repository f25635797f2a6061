"""The worked sizing numbers (Llama-2-7B FP16: 0.5 MiB per token, 2 GiB per 4k sequence, about 5 sequences
in the ~10 GB a 24 GB GPU has left after 14 GB of weights) as oracles for the sizing maths."""

from pathlib import Path

import pytest

from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.models import MODELS

GiB = 1024**3
MiB = 1024**2
LLAMA_2_7B = MODELS["llama-2-7b"]


def test_llama_2_7b_fp16_kv_is_half_a_mib_per_token_and_2_gib_per_4k_sequence() -> None:
    per_token = sizing.kv_bytes_per_token(LLAMA_2_7B)
    assert per_token == 2 * 32 * 32 * 128 * 2 == MiB // 2
    assert per_token * 4096 == 2 * GiB


def test_24_gb_gpu_with_14_gb_of_weights_fits_5_sequences_of_4k_not_32() -> None:
    pool = sizing.kv_pool_bytes(24 * GiB, utilization=1.0, weights=14 * GiB, reserve=0)
    assert pool == 10 * GiB
    fits = sizing.sequences_that_fit(pool, sizing.kv_layout(LLAMA_2_7B), 4096)
    assert fits == 5
    # Sizing for weights only would promise 32; those 32 need 64 GiB of KV cache.
    assert 32 * sizing.kv_bytes_per_token(LLAMA_2_7B) * 4096 == 64 * GiB


def test_paged_blocks_round_each_sequence_up_to_whole_blocks() -> None:
    per_token = sizing.kv_layout(LLAMA_2_7B)
    assert per_token.group_bytes_per_token == sizing.kv_bytes_per_token(LLAMA_2_7B)
    # 4097 tokens need 257 blocks of 16, so 10 GiB (1280 blocks) holds 4 such sequences, not 5.
    assert sizing.sequences_that_fit(10 * GiB, per_token, 4097, block_size=16) == 4
    assert sizing.sequences_that_fit(10 * GiB, per_token, 4096, block_size=16) == 5
    assert sizing.sequences_that_fit(-1, per_token, 16) == 0


def test_sliding_window_groups_keep_the_window_and_the_tokens_in_flight_full_ones_every_token() -> None:
    # Gemma 3 1B's shape: 26 layers, every sixth full, 1 KV head of 256; a 512-token window.
    gemma = LLAMA_2_7B.model_copy(
        update={"layers": 26, "kv_heads": 1, "head_dim": 256, "sliding_window": 512, "sliding_layers": 22}
    )
    layout = sizing.kv_layout(gemma)
    # 4 full layers set the group size: one full group, ceil(22 / 4) = 6 sliding groups of (at most) 4.
    assert layout == sizing.KVLayout(4 * 2 * 256 * 2, full_groups=1, sliding_groups=6, window=512)
    # 32768 tokens: 2048 blocks of 16 in the full group; each sliding group ceil((511 + 100) / 16) + 1.
    assert sizing.sequence_blocks(layout, 32768, 16, in_flight=100) == 2048 + 6 * (39 + 1)
    # A sequence shorter than its window keeps all of it, and one block more.
    assert sizing.sequence_blocks(layout, 100, 16, in_flight=100) == 7 + 6 * 8
    assert sizing.sequences_that_fit(2 * GiB, layout, 32768, 16, 100) == (2 * GiB // (16 * 4096)) // 2288


def test_chunked_groups_keep_the_current_chunk_and_the_tokens_in_flight_from_a_blocks_start() -> None:
    # Llama 4's shape: 48 layers, every fourth full (NoPE), the others in 8192-token chunks.
    llama4 = LLAMA_2_7B.model_copy(
        update={"layers": 48, "kv_heads": 8, "sliding_window": 8192, "sliding_layers": 36, "sliding_kind": "chunk"}
    )
    layout = sizing.kv_layout(llama4)
    assert llama4.chunked and layout.chunked
    assert (layout.full_groups, layout.sliding_groups, layout.window) == (1, 3, 8192)
    # ceil((8192 + 100) / 16) = 519 blocks per chunked group: no block more for a start inside one
    # (a sliding window of the same size takes ceil((8191 + 100) / 16) + 1 = 520).
    assert sizing.sequence_blocks(layout, 32768, 16, in_flight=100) == 2048 + 3 * 519
    windowed = sizing.kv_layout(llama4.model_copy(update={"sliding_kind": "window"}))
    assert not windowed.chunked
    assert sizing.sequence_blocks(windowed, 32768, 16, in_flight=100) == 2048 + 3 * 520
    # A sequence shorter than the chunk keeps all of it in every group, in as many blocks.
    assert sizing.sequence_blocks(layout, 100, 16, in_flight=100) == 4 * 7


def test_vllm_holds_every_token_of_chunked_layers_beside_an_eagle_head_only() -> None:
    chunked = LLAMA_2_7B.model_copy(
        update={"layers": 48, "kv_heads": 8, "sliding_window": 8192, "sliding_layers": 36, "sliding_kind": "chunk"}
    )
    head = chunked.model_copy(update={"layers": 1, "sliding_window": None, "sliding_layers": None})
    assert sizing.every_token_held(chunked, "eagle", head)
    # A draft model, another mode, or sliding windows keep vLLM's hybrid KV cache manager on.
    assert not sizing.every_token_held(chunked, "draft", head)
    assert not sizing.every_token_held(chunked, "eagle", None)
    assert not sizing.every_token_held(chunked.model_copy(update={"sliding_kind": "window"}), "eagle", head)
    # Nothing full anywhere (every layer chunked, the head's too): the specs stay uniform, unpromoted.
    all_chunked = chunked.model_copy(update={"sliding_layers": None})
    assert not sizing.every_token_held(all_chunked, "eagle", all_chunked.model_copy(update={"layers": 1}))
    assert sizing.every_token_held(all_chunked, "eagle", head)
    # Held whole: one group of all 48 layers, every token of the sequence.
    whole = sizing.kv_layout(chunked, every_token=True)
    assert whole == sizing.KVLayout(48 * 2 * 8 * 128 * 2, full_groups=1, sliding_groups=0, window=None)
    assert sizing.sequence_blocks(whole, 32768, 16, in_flight=100) == 2048


def test_a_latent_is_one_per_token_and_layer_and_whole_on_every_gpu() -> None:
    deepseek = LLAMA_2_7B.model_copy(update={"layers": 61, "kv_heads": 1, "latent_dim": 576})
    assert sizing.kv_bytes_per_token(deepseek) == 61 * 576 * 2
    assert sizing.kv_bytes_per_token(deepseek, tp=8) == 8 * 61 * 576 * 2
    assert sizing.kv_layout(deepseek, tp=8) == sizing.KVLayout(8 * 61 * 576 * 2, 1, 0, None)
    # K and V heads are split over the GPUs: the group's bytes per token do not change.
    assert sizing.kv_bytes_per_token(LLAMA_2_7B, tp=8) == sizing.kv_bytes_per_token(LLAMA_2_7B)


def test_gqa_divides_the_kv_cache_by_query_heads_over_kv_heads() -> None:
    llama_3_8b = MODELS["llama-3-8b"]  # same 32 layers x 128 head dim as Llama-2-7B, 8 KV heads
    ratio = llama_3_8b.attention_heads // llama_3_8b.kv_heads
    assert ratio == 4
    assert sizing.kv_bytes_per_token(llama_3_8b) * ratio == sizing.kv_bytes_per_token(LLAMA_2_7B)
    llama_2_70b = MODELS["llama-2-70b"]  # 64 query heads share 8 KV heads
    mha = 2 * llama_2_70b.layers * llama_2_70b.attention_heads * 128 * 2
    assert sizing.kv_bytes_per_token(llama_2_70b) == mha // 8


def test_weight_bytes_by_hand_for_llama_2_70b_at_each_scheme() -> None:
    arch = MODELS["llama-2-70b"]
    assert sizing.weight_bytes(arch, "none") == 2 * 68_976_648_192  # every parameter 16-bit
    embedding = 32000 * 8192  # the embedding, and (untied) the LM head, each
    norms = (2 * 80 + 1) * 8192
    body = 68_976_648_192 - 2 * embedding - norms  # the decoder layers' linear weights
    kept = (embedding + norms) * 2  # embedding and norms stay 16-bit
    head = embedding + 32000 * 2  # the LM head at INT8 under every scheme, a bf16 scale per row
    assert sizing.weight_bytes(arch, "int8") == kept + head + body
    # INT4 group 32: half a byte per weight and a bf16 scale and zero per 32 weights = 0.625 bytes.
    assert sizing.INT4_GROUP == 32
    assert sizing.weight_bytes(arch, "int4") == kept + head + body * 5 // 8 == 43_571_034_624  # 40.6 GiB
    # Not the quarter of FP16 that INT4 alone would suggest: the group scales add a quarter of the
    # packed bytes, and the embedding and LM head stay wide.
    assert 0.31 < sizing.weight_bytes(arch, "int4") / sizing.weight_bytes(arch, "none") < 0.32


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_weight_bytes_are_what_the_engine_allocates(tmp_path: Path, quantization: str, tied: bool) -> None:
    """The planner's bytes against the engine's own: a small random Llama loaded by the engine's
    loader at each scheme and the engine's default group, counted as the model runner counts its
    weight bytes. Left out by the planner, and here: RoPE's frequency table and INT8's per-row
    scales of the decoder layers (2 bytes per row of `in_features` weights)."""
    torch = pytest.importorskip("torch")
    from kvpilot.engine.model.loader import load_config, load_model
    from tests.operator.planning.small_llama import TWO_LAYERS, small_llama

    arch = small_llama(tmp_path, tied, **TWO_LAYERS)
    model = load_model(tmp_path, load_config(tmp_path), torch.bfloat16, torch.device("cpu"), quantization)
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    rope = sum(t.numel() * t.element_size() for t in model.model.rotary_emb.buffers())
    row_scales = sum(
        m.scales.numel() * m.scales.element_size()
        for m in model.model.layers.modules()
        if isinstance(getattr(m, "scales", None), torch.Tensor)
    )
    assert sizing.weight_bytes(arch, quantization) == held - rope - row_scales


def test_latency_is_ttft_plus_n_minus_1_tpot() -> None:
    # Handbook check: TTFT 200 ms, TPOT 30 ms, 101 output tokens -> 3200 ms.
    assert sizing.request_latency(200, 30, 101) == 3200


def test_decode_is_bandwidth_bound_at_batch_1_and_compute_bound_at_huge_batch() -> None:
    weights = sizing.weight_bytes(LLAMA_2_7B, "none")
    rates = sizing.Rates(bandwidth=2e12, ops_per_s=300e12)
    one = sizing.decode_step_seconds(weights, LLAMA_2_7B.parameters, 1, rates)
    assert one == weights / (2e12 * sizing.DECODE_BANDWIDTH_EFFICIENCY)
    huge = sizing.decode_step_seconds(weights, LLAMA_2_7B.parameters, 4096, rates)
    assert huge == 2 * LLAMA_2_7B.parameters * 4096 / (300e12 * sizing.PREFILL_COMPUTE_EFFICIENCY)


def test_prefill_is_two_flops_per_parameter_per_token() -> None:
    seconds = sizing.prefill_seconds(7_000_000_000, 1000, 1e15)
    assert seconds == 2 * 7e9 * 1000 / (1e15 * sizing.PREFILL_COMPUTE_EFFICIENCY)
