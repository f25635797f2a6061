"""The worked sizing numbers (Llama-2-7B FP16: 0.5 MiB per token, 2 GiB per 4k sequence, about 5 sequences
in the ~10 GB a 24 GB GPU has left after 14 GB of weights) as oracles for the sizing maths."""

from kvpilot.operator import sizing
from kvpilot.operator.model_catalog import MODELS

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
    fits = sizing.sequences_that_fit(pool, sizing.kv_bytes_per_token(LLAMA_2_7B), 4096)
    assert fits == 5
    # Sizing for weights only would promise 32; those 32 need 64 GiB of KV cache.
    assert 32 * sizing.kv_bytes_per_token(LLAMA_2_7B) * 4096 == 64 * GiB


def test_paged_blocks_round_each_sequence_up_to_whole_blocks() -> None:
    per_token = sizing.kv_bytes_per_token(LLAMA_2_7B)
    # 4097 tokens need 257 blocks of 16, so 10 GiB (1280 blocks) holds 4 such sequences, not 5.
    assert sizing.sequences_that_fit(10 * GiB, per_token, 4097, block_size=16) == 4
    assert sizing.sequences_that_fit(10 * GiB, per_token, 4096, block_size=16) == 5
    assert sizing.sequences_that_fit(-1, per_token, 16) == 0


def test_gqa_divides_the_kv_cache_by_query_heads_over_kv_heads() -> None:
    llama_3_8b = MODELS["llama-3-8b"]  # same 32 layers x 128 head dim as Llama-2-7B, 8 KV heads
    ratio = llama_3_8b.attention_heads // llama_3_8b.kv_heads
    assert ratio == 4
    assert sizing.kv_bytes_per_token(llama_3_8b) * ratio == sizing.kv_bytes_per_token(LLAMA_2_7B)
    llama_2_70b = MODELS["llama-2-70b"]  # 64 query heads share 8 KV heads
    mha = 2 * llama_2_70b.layers * llama_2_70b.attention_heads * 128 * 2
    assert sizing.kv_bytes_per_token(llama_2_70b) == mha // 8


def test_int8_halves_and_int4_quarters_weight_bytes() -> None:
    params = LLAMA_2_7B.parameters
    fp16 = sizing.weight_bytes(params, "none")
    assert fp16 == 2 * params  # ~13.5 GB: the worked example's "14 GB of weights"
    assert sizing.weight_bytes(params, "int8") == fp16 // 2
    assert sizing.weight_bytes(params, "w8a8") == fp16 // 2
    assert sizing.weight_bytes(params, "int4") == fp16 // 4
    # INT4's group scales are accounted separately: 2.5 bytes per 128 weights, ~4% on top.
    overhead = sizing.quantization_overhead_bytes(params, "int4")
    assert 0.03 < overhead / sizing.weight_bytes(params, "int4") < 0.05
    assert sizing.quantization_overhead_bytes(params, "int8") == 0


def test_latency_is_ttft_plus_n_minus_1_tpot() -> None:
    # Handbook check: TTFT 200 ms, TPOT 30 ms, 101 output tokens -> 3200 ms.
    assert sizing.request_latency(200, 30, 101) == 3200


def test_decode_is_bandwidth_bound_at_batch_1_and_compute_bound_at_huge_batch() -> None:
    weights = sizing.weight_bytes(LLAMA_2_7B.parameters, "none")
    one = sizing.decode_step_seconds(bytes_read=weights, bandwidth=2e12,
                                     parameters_per_token=LLAMA_2_7B.parameters, batch=1,
                                     ops_per_s=300e12)
    assert one == weights / (2e12 * sizing.DECODE_BANDWIDTH_EFFICIENCY)
    huge = sizing.decode_step_seconds(bytes_read=weights, bandwidth=2e12,
                                      parameters_per_token=LLAMA_2_7B.parameters, batch=4096,
                                      ops_per_s=300e12)
    assert huge == 2 * LLAMA_2_7B.parameters * 4096 / (300e12 * sizing.PREFILL_COMPUTE_EFFICIENCY)


def test_prefill_is_two_flops_per_parameter_per_token() -> None:
    seconds = sizing.prefill_seconds(7_000_000_000, 1000, 1e15)
    assert seconds == 2 * 7e9 * 1000 / (1e15 * sizing.PREFILL_COMPUTE_EFFICIENCY)


def test_speculative_tokens_per_step() -> None:
    assert sizing.expected_tokens_per_step(0.0, 4) == 1
    assert sizing.expected_tokens_per_step(1.0, 4) == 5
    assert abs(sizing.expected_tokens_per_step(0.5, 1) - 1.5) < 1e-12
