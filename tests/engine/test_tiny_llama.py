"""Any local Llama-family HF folder loads, and matches HF on architectures SmolLM2 does not cover."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot.engine import LLM, SamplingParams
from tests.engine.oracle import check_greedy, greedy_reference

VARIANTS = {
    # Llama-3.1 style rope scaling with 4:1 GQA.
    "llama3-rope-gqa": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Linear scaling, multi-head attention, untied head.
    "linear-rope-mha": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
}


# Grouped queries, an untied head and a bias on every linear layer, as the quantization tests want
# them: o_proj's scales shared by the query heads of a kv head, biases beside quantized weights.
GQA_BIASES = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    attention_bias=True,
    mlp_bias=True,
)


def make_tiny_llama(folder: Path, tokenizer_dir: Path, **arch: object) -> LlamaForCausalLM:
    config = LlamaConfig(
        **{
            "vocab_size": 49152,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "max_position_embeddings": 512,
            # Wide weights give peaked logits: random models with tiny weights are all near-ties.
            "initializer_range": 0.3,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            **arch,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_llama_matches_hf(variant, tmp_path, model_dir, corpus_ids):
    hf = make_tiny_llama(tmp_path, model_dir, **VARIANTS[variant])
    llm = LLM(str(tmp_path), max_num_batched_tokens=48, kv_cache_memory_bytes=4 << 20, block_size=8, dtype="float32")
    prompts = [corpus_ids[i * 5 : i * 5 + n] for i, n in enumerate([3, 20, 70, 150, 260])]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = greedy_reference(hf, prompt, 20, min_new_tokens=20)
        check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, f"{variant} {len(prompt)}")
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_non_llama_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="neither"):
        LLM(str(tmp_path / "missing"))
