from __future__ import annotations

import random

import pytest

from kvpilot.engine.output_processor import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "  leading spaces,\ttabs\nand new lines\n\n",
    "Émigré café naïve — “quotes” 你好，世界！ 🤖🚀 emoji and CJK",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        partial = detokenizer.append(ids[:n])
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        # Never ahead of the truth, never a broken character; at most a partial one held back.
        assert full.startswith(partial) and "\ufffd" not in partial
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_tokens_stay_a_prefix_of_the_full_decode(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        partial = detokenizer.append(ids[:n])
        assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(partial.rstrip("\ufffd"))
