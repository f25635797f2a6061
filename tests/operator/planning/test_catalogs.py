from kvpilot.operator.planning.gpus import GPUS, PRODUCT_LABELS, find_gpu
from kvpilot.operator.planning.models import MODELS, find_model

REQUIRED_GPUS = {"T4", "L4", "A10G", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "MI300X"}
REQUIRED_MODELS = {
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "smollm2-135m",
}


def test_gpu_catalog_covers_the_issue_and_cites_sources() -> None:
    assert REQUIRED_GPUS <= set(GPUS)
    for gpu in GPUS.values():
        assert gpu.source.startswith("https://"), gpu.name
        assert gpu.memory_gib > 0 and gpu.bandwidth_gbps > 0
        # INT8 tensor throughput is twice FP16 on every one of these parts.
        assert abs(gpu.int8_tops / gpu.fp16_tflops - 2) < 0.05, gpu.name


def test_gpu_spec_sheet_numbers() -> None:
    a10g, h100, a100 = GPUS["A10G"], GPUS["H100-80GB"], GPUS["A100-80GB"]
    assert (a10g.memory_gib, a10g.bandwidth_gbps) == (24, 600)
    assert (h100.memory_gib, h100.bandwidth_gbps, h100.fp16_tflops, h100.fp8) == (80, 3350, 989, True)
    assert (a100.bandwidth_gbps, a100.fp16_tflops, a100.fp8) == (2039, 312, False)
    assert GPUS["H200"].memory_gib == 141 and GPUS["MI300X"].memory_gib == 192


def test_product_labels_are_what_gpu_feature_discovery_sets() -> None:
    assert PRODUCT_LABELS["A10G"] == "NVIDIA-A10G"
    assert PRODUCT_LABELS["H100-80GB"] == "NVIDIA-H100-80GB-HBM3"
    assert PRODUCT_LABELS["T4"] == "Tesla-T4"
    assert len(set(PRODUCT_LABELS.values())) == len(PRODUCT_LABELS)
    for name, product in PRODUCT_LABELS.items():
        assert find_gpu(product) is GPUS[name]
        assert find_gpu(name.lower()) is GPUS[name]
    assert GPUS["MI300X"].resource == "amd.com/gpu"
    assert find_gpu("TPU-v5") is None


def test_model_catalog_matches_hf_configs_and_cites_them() -> None:
    assert REQUIRED_MODELS <= set(MODELS)
    for name, arch in MODELS.items():
        assert "huggingface.co" in arch.source and "config.json" in arch.source, name
        assert arch.hidden_size == arch.attention_heads * arch.head_size, name
    smol = MODELS["smollm2-135m"]
    assert (smol.layers, smol.attention_heads, smol.kv_heads, smol.head_size) == (30, 9, 3, 64)
    qwen = MODELS["qwen2.5-7b"]
    assert (qwen.layers, qwen.attention_heads, qwen.kv_heads, qwen.head_size) == (28, 28, 4, 128)
    mixtral = MODELS["mixtral-8x7b"]
    assert mixtral.parameters_per_token < mixtral.parameters / 3


def test_find_model_accepts_hf_repo_names() -> None:
    assert find_model("meta-llama/Llama-2-7b-chat-hf") is MODELS["llama-2-7b"]
    assert find_model("Meta-Llama-3-8B-Instruct") is MODELS["llama-3-8b"]
    assert find_model("HuggingFaceTB/SmolLM2-135M-Instruct") is MODELS["smollm2-135m"]
    assert find_model("mistralai/Mistral-7B-Instruct-v0.3") is MODELS["mistral-7b"]
    # The draft models, by their repositories.
    assert find_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0") is MODELS["tinyllama-1.1b"]
    assert find_model("meta-llama/Llama-3.2-1B-Instruct") is MODELS["llama-3.2-1b"]
    assert MODELS["tinyllama-1.1b"].vocab_size == MODELS["llama-2-7b"].vocab_size
    assert MODELS["llama-3.2-1b"].vocab_size == MODELS["llama-3-8b"].vocab_size
    assert find_model("gpt-5") is None
