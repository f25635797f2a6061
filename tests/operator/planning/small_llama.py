"""Small random Llamas saved to a folder the engine loads, each with the planner's Architecture of it:
the tests that hold the planner's bytes against what the engine allocates build both from one shape."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot.operator.api.spec import Architecture

VOCAB = 512
CONTEXT = 256
# Two layers of grouped-query attention: the planner's sizing test and the draft test's target.
TWO_LAYERS = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def small_llama(folder: Path, tied: bool = False, **shape: int) -> Architecture:
    """Save a random Llama of `shape` on VOCAB tokens and CONTEXT positions in `folder`; the Architecture
    the planner sizes it by (its parameters counted from the model itself)."""
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=CONTEXT, tie_word_embeddings=tied, **shape)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return Architecture(
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        attention_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        vocab_size=VOCAB,
        parameters=sum(p.numel() for p in model.parameters()),
        max_context=CONTEXT,
        tie_word_embeddings=tied,
    )
