"""The engine's oracle: HuggingFace greedy tokens; a divergence passes only at a proven near-tie (the two
top logits within a stated tolerance at the first differing position), and is reported."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

# Two logits closer than this are a near-tie: a different batch shape may order them either way.
NEAR_TIE_LOGIT_GAP = 1e-3


@dataclass
class Reference:
    """HuggingFace's greedy continuation of one prompt, and its raw logits at each step."""

    tokens: list[int]
    logits: list[torch.Tensor]


def greedy_reference(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, min_new_tokens: int = 0
) -> Reference:
    """HuggingFace's greedy continuation of `prompt` (`min_new_tokens`: at least so many, the EOS
    token held back until then, as the engine's ignore_eos does)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.config.eos_token_id,
        )
    return Reference(out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits])


def check_greedy(
    engine_tokens: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], label: str
) -> str | None:
    """Raise AssertionError unless the engine's tokens equal the reference or diverge at a proven near-tie.

    Returns a report of an accepted near-tie divergence, None on an exact match.
    """
    first_diff = next((i for i, (a, b) in enumerate(zip(engine_tokens, ref_tokens)) if a != b), None)
    if first_diff is None:
        assert len(engine_tokens) == len(ref_tokens), (
            f"{label}: same tokens but {len(engine_tokens)} generated vs {len(ref_tokens)} by HF"
        )
        return None
    logits = ref_logits[first_diff].float()
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    near_tie = gap <= NEAR_TIE_LOGIT_GAP and engine_tokens[first_diff] in top2.indices.tolist()
    assert near_tie, (
        f"{label}: diverges from HF at output position {first_diff}: engine {engine_tokens[first_diff]}, "
        f"HF {ref_tokens[first_diff]}, HF top-2 logit gap {gap:.6f} (> {NEAR_TIE_LOGIT_GAP}, not a near-tie)"
    )
    return f"{label}: near-tie at position {first_diff} (gap {gap:.2e}), accepted"
