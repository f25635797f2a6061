"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output.

Decoding a slice of byte-level BPE tokens can end inside a multi-byte character (U+FFFD) or depend
on the token before it (spaces), so text is only appended once the slice decodes cleanly, and each
slice starts one step back so that its first token has its left context.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class DetokenizerState:
    prefix_offset: int = 0  # output tokens before this are already text and give no context
    read_offset: int = 0  # output tokens before this are already in the text
    text: str = ""


def append_tokens(tokenizer: PreTrainedTokenizerBase, state: DetokenizerState, output_ids: list[int]) -> str:
    """Extend state.text with whatever output_ids[state.read_offset:] spell cleanly; return state.text."""
    prefix = tokenizer.decode(output_ids[state.prefix_offset : state.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(output_ids[state.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        state.text += full[len(prefix) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(output_ids)
    return state.text
