"""Structured outputs: what the grammar's token mask costs per decode step, at batch 1 and 32.

    .venv/bin/python -m bench.structured_output [--batch-sizes 1,32] [--rounds 2] [--max-tokens 32]

Each round runs the same chat prompts twice on one engine, alternately: free, and under a JSON
schema (what the openai client's parse() sends for a small pydantic model), greedy. Two measures,
both robust to a shared machine:

- in the engine: per decode step of the constrained run, the time spent building the bitmask
  (xgrammar's matchers: feed the new tokens, fill each row) and applying it to the logits, over
  that same step's wall time; the median of these per-step shares.
- replayed: the constrained run's tokens fed again to fresh matchers, step by step, timing the
  mask work alone (fill + apply on [batch, vocab] logits), against the free run's decode step;
  both the minimum over steps and rounds (the least disturbed), so mask ms / step ms is the
  overhead of a quiet machine.

Results go to bench/out/structured_output.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import xgrammar

from bench.machine import machine, write_result
from kvpilot.engine import LLMEngine, SamplingParams
from kvpilot.engine.core.structured_output import StructuredOutput
from kvpilot.engine.worker.grammar import Grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "is_capital": {"type": "boolean"},
    },
    "required": ["name", "country", "is_capital"],
    "additionalProperties": False,
}
CITIES = (
    "Paris Tokyo Lima Oslo Cairo Delhi Rome Quito Lagos Seoul Hanoi Dakar Bern Kyiv Riga Doha "
    "Lyon Osaka Cusco Bergen Luxor Agra Milan Cuenca Kano Busan Hue Thies Basel Lviv Tartu Sydney"
).split()


class _Timer:
    """Accumulates the seconds spent in wrapped calls since the last take()."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):  # noqa: ANN001, ANN202 - any callable
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(engine: LLMEngine, batch: int, max_tokens: int, structured: StructuredOutput | None, timer: _Timer) -> dict:
    """One batch to the end: per decode step of the whole batch its wall time and mask time; the
    output tokens."""
    prompts = [
        engine.apply_chat_template(
            [
                {"role": "system", "content": "You answer in JSON with name, country and is_capital."},
                {"role": "user", "content": f"Tell me about {CITIES[i % len(CITIES)]}."},
            ]
        )
        for i in range(batch)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    steps, masks = [], []
    timer.take()
    while engine.has_unfinished():
        # Decode steps of the whole batch only: the tail, where some sequences have finished, is smaller.
        decoding = len(engine.requests) == batch and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.requests.values()
        )
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        mask = timer.take()
        if decoding:
            steps.append(elapsed)
            masks.append(mask)
    return {"steps": steps, "masks": masks, "outputs": [r.output_token_ids for r in requests]}


def replay(grammars: Grammars, structured: StructuredOutput, outputs: list[list[int]], vocab: int) -> list[float]:
    """The mask work of each step, seconds, for these outputs generated together: fill every row's
    bitmask from its matcher, apply it to [rows, vocab] logits, feed each row its next token."""
    grammar = grammars.compile(structured)
    matchers = [xgrammar.GrammarMatcher(grammar) for _ in outputs]
    bitmask = xgrammar.allocate_token_bitmask(len(outputs), vocab)
    logits = torch.zeros(len(outputs), vocab)
    seconds = []
    for position in range(min(map(len, outputs))):  # while the whole batch decodes, as in run()
        rows = list(range(len(outputs)))
        started = time.perf_counter()
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        for i in rows:
            matchers[i].accept_token(outputs[i][position])
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = LLMEngine(dtype=args.dtype, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    timer = _Timer()
    matchers = engine.runner.matchers
    matchers.bitmask = timer.wrap(matchers.bitmask)
    xgrammar.apply_token_bitmask_inplace = timer.wrap(xgrammar.apply_token_bitmask_inplace)
    structured = StructuredOutput.json_schema(SCHEMA)
    vocab = engine.runner.hf_config.vocab_size
    results = []
    for batch in map(int, args.batch_sizes.split(",")):
        run(engine, batch, 4, structured, timer)  # warm-up
        free_steps, shares, replayed = [], [], []
        for _ in range(args.rounds):
            free_steps += run(engine, batch, args.max_tokens, None, timer)["steps"]
            constrained = run(engine, batch, args.max_tokens, structured, timer)
            shares += [m / s for m, s in zip(constrained["masks"], constrained["steps"])]
            replayed += replay(engine.grammars, structured, constrained["outputs"], vocab)
        row = {
            "batch": batch,
            "in_engine_mask_share_median": statistics.median(shares),
            "replayed_mask_ms_min": 1e3 * min(replayed),
            "replayed_mask_ms_median": 1e3 * statistics.median(replayed),
            "free_step_ms_min": 1e3 * min(free_steps),
            "free_step_ms_median": 1e3 * statistics.median(free_steps),
        }
        row["overhead_min_over_min"] = row["replayed_mask_ms_min"] / row["free_step_ms_min"]
        results.append(row)
        print(
            f"batch {batch:>2}: mask {row['replayed_mask_ms_min']:.2f} ms/step replayed "
            f"({1e3 * row['replayed_mask_ms_min'] / batch:.0f} us/token), free decode step "
            f"{row['free_step_ms_min']:.1f} ms (min): overhead {100 * row['overhead_min_over_min']:.2f}%; "
            f"in the engine, median mask share of a step {100 * row['in_engine_mask_share_median']:.2f}%",
            flush=True,
        )
    out = Path(__file__).parent / "out" / "structured_output.json"
    record = {"machine": machine(), "args": vars(args), "rows": results}
    write_result(out, record)
    print(f"cpu: {record['machine']['cpu']}; wrote {out}")


if __name__ == "__main__":
    main()
