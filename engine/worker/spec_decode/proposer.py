"""Which proposer an engine speculates with (`speculative`), and the draft model it runs."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import load_config, load_model, resolve_model
from kvpilot.engine.worker.spec_decode import Proposer
from kvpilot.engine.worker.spec_decode.draft_proposer import DraftProposer
from kvpilot.engine.worker.spec_decode.ngram_proposer import NgramProposer


def load_draft(
    config: EngineConfig,
    target: LlamaForCausalLM,
    target_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LlamaForCausalLM | None, int]:
    """The draft model and the layers it runs: a separate model, or the target's first layers."""
    if config.speculative != "draft":
        return None, 0
    num_layers = target_config.num_hidden_layers
    if config.draft_model is None:
        layers = config.draft_layers or max(1, num_layers // 4)
        if layers >= num_layers:
            raise ValueError(f"draft_layers {layers} must be fewer than the model's {num_layers} layers")
        return target, layers
    path = resolve_model(config.draft_model)
    hf_config = load_config(path)
    if hf_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"draft model {config.draft_model!r} has a vocabulary of {hf_config.vocab_size} tokens, "
            f"the target {target_config.vocab_size}: drafts must be the target's tokens"
        )
    model = load_model(path, hf_config, dtype, device)
    return model, min(config.draft_layers or hf_config.num_hidden_layers, hf_config.num_hidden_layers)


def make_proposer(
    config: EngineConfig,
    draft_model: LlamaForCausalLM | None,
    draft_layers: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Proposer | None:
    """The proposer of `speculative` (none when off); a draft model's keeps its own KV cache of
    `num_slots` slots, addressed by the target's block tables."""
    if config.speculative == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max
        )
    if config.speculative == "draft":
        return DraftProposer(
            draft_model,
            draft_layers,
            config.num_speculative_tokens,
            num_slots,
            config.block_size,
            dtype,
            device,
            config.max_num_batched_tokens,
        )
    return None
