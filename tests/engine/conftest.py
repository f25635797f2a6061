from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from tests.engine.oracle import Reference, greedy_reference

# Used to build prompts of exact token lengths; varied enough that the model does not loop at once.
CORPUS = """
Paged attention stores the key and value vectors of every token in fixed-size blocks, so memory is
allocated on demand and shared between requests that begin with the same words. The scheduler runs
one step at a time: it first lets every running sequence decode a token, then fills what is left of
the token budget with pieces of waiting prompts. When memory runs out, the newest sequence is
preempted and recomputed later. In 1969 the first crewed lunar landing took place; the astronauts
collected rocks, planted a flag and returned safely. def quicksort(xs): return xs if len(xs) < 2
else quicksort([x for x in xs[1:] if x < xs[0]]) + [xs[0]] + quicksort([x for x in xs[1:] if x >= xs[0]])
The recipe needs two cups of flour, one egg, a pinch of salt and a spoon of honey. Mix, rest for an
hour, then bake at two hundred degrees until golden. Rivers carve valleys over millions of years;
glaciers leave lakes behind them. Photosynthesis turns light, water and carbon dioxide into sugar.
"""


@pytest.fixture(scope="session")
def corpus_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    return (ids * (1 + 600 // len(ids)))[:600]


def make_prompts(corpus_ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly the given lengths, each starting at a different place in the corpus."""
    return [corpus_ids[(7 * i) % 100 : (7 * i) % 100 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="session")
def hf_greedy(hf_model: PreTrainedModel):
    cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    def run(prompt: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = greedy_reference(hf_model, prompt, max_new_tokens)
        return cache[key]

    return run
