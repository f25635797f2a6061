"""Speculative decoding: TPOT and output tokens/s with and without drafts (n-gram lookup, or a
draft model: the target's first layers), at several batch sizes, on prompts whose answers copy
from the prompt and on prompts whose answers do not.

    .venv/bin/python -m bench.spec_decode [--modes ngram,draft] [--batch-sizes 1,8,32] [--rounds 3]
    .venv/bin/python -m bench.spec_decode --modes ngram-no-window,ngram   # the acceptance window's effect

A mode is `off`, a speculative mode under the engine's default acceptance window, or one with
`-no-window`: every request proposes whatever becomes of its drafts.

The engines (speculative off and each mode) are loaded in one process and run alternately, round by
round, so that noise on a shared machine hits all alike. Decoding is greedy; in bf16 the two may still
part at a near-tie, and the table says how many outputs stayed equal. Results go to
bench/out/spec_decode.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.machine import machine, write_result

if TYPE_CHECKING:
    from kvpilot.engine import LLMEngine

PASSAGE = (
    "The river town of Alder Bend was founded in 1823 by Mara Quill, a ferry keeper who charged "
    "two pennies a crossing. By 1850 the town had a mill, a school with forty pupils and a bridge "
    "of grey stone that replaced the ferry. The bridge flooded in 1862 and again in 1901, when "
    "the mayor, Tobias Wren, ordered a levee built along the east bank. Today Alder Bend has "
    "3,400 residents, a museum in the old mill and a festival every June that celebrates the ferry."
)
CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    totals = []
    running = 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        if i >= window - 1:
            totals.append(running / window)
    return totals
"""
# Answers that repeat their input: editing, extraction, quoting.
COPY_HEAVY = [
    f"Repeat the following text word for word:\n\n{PASSAGE}",
    f"Rename the function to rolling_mean and return the whole code:\n\n{CODE}",
    f"Copy every sentence of this text that contains a year:\n\n{PASSAGE}",
    f"Add a docstring to this function and return the whole code:\n\n{CODE}",
]
# Answers written from scratch.
OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, for a ten-year-old.",
    "Give five tips for keeping houseplants alive in winter, with a reason for each.",
    "Describe a day in the life of a medieval blacksmith.",
]
PROMPT_SETS = {"copy-heavy": COPY_HEAVY, "open-ended": OPEN_ENDED}


@dataclass
class Run:
    prompt_set: str
    batch: int
    speculative: str
    seconds: float
    output_tokens: int
    tpot_ms: float  # mean over requests of (finish - first token) / (tokens - 1)
    draft_tokens: int
    accepted_tokens: int
    drafts: int
    same_outputs: float | None = None  # share of requests whose output equals speculation off's

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]], list[float]]:
    """Generate all prompts together; (seconds, output tokens per prompt, TPOT per prompt)."""
    from kvpilot.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    ids = [engine.add_request(p, params).request_id for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                tokens[out.request_id] += out.new_token_ids
            if out.finished:
                done[out.request_id] = now
    seconds = time.perf_counter() - start
    tpots = [(done[i] - first[i]) / (len(tokens[i]) - 1) for i in ids if len(tokens[i]) > 1]
    return seconds, [tokens[i] for i in ids], tpots


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.llm_engine import LLMEngine

    modes = ["off", *args.modes]
    engines = {
        mode: LLMEngine(
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_max_batch_size=max(args.batch_sizes),
            kv_cache_memory_bytes=1 << 30,
            **mode_options(mode, args.draft_layers),
        )
        for mode in modes
    }
    print(f"torch threads {torch.get_num_threads()}, dtype {engines['off'].runner.dtype}", flush=True)
    runs: list[Run] = []
    for set_name, texts in PROMPT_SETS.items():
        prompts = [engines["off"].apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        for batch in args.batch_sizes:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            for round_ in range(args.rounds):
                outputs = {}
                for mode in modes if round_ % 2 == 0 else modes[::-1]:
                    engine = engines[mode]
                    before = engine.scheduler.spec_decoding
                    seconds, tokens, tpots = run_batch(engine, batch_prompts, args.max_tokens)
                    after = engine.scheduler.spec_decoding
                    outputs[mode] = tokens
                    runs.append(
                        Run(
                            set_name,
                            batch,
                            mode,
                            seconds,
                            sum(map(len, tokens)),
                            1000 * statistics.mean(tpots),
                            after.num_draft_tokens - before.num_draft_tokens,
                            after.num_accepted_tokens - before.num_accepted_tokens,
                            after.num_drafts - before.num_drafts,
                        )
                    )
                    print(
                        f"  {set_name} batch {batch} round {round_} {mode}: {seconds:.1f}s "
                        f"{runs[-1].tokens_per_second:.1f} tok/s TPOT {runs[-1].tpot_ms:.1f} ms",
                        flush=True,
                    )
                # In bf16 a verification step (several rows) and a decode step (one row) may round a
                # near-tie differently, so greedy outputs can part; the share that stays equal is reported.
                for run_ in runs[-len(modes) :]:
                    run_.same_outputs = sum(a == b for a, b in zip(outputs["off"], outputs[run_.speculative])) / batch
    summary = summarise(runs)
    for line in summary["table"]:
        print(line)
    write_result(
        Path(args.output),
        {
            "machine": machine(),
            "args": vars(args),
            "runs": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in runs],
            **summary,
        },
    )
    return 0


def mode_options(mode: str, draft_layers: int) -> dict[str, object]:
    """Engine options of a mode; `-no-window` sets min acceptance 0, so that no request backs off."""
    speculative = mode.removesuffix("-no-window")
    options: dict[str, object] = {"speculative": speculative}
    if speculative != mode:
        options["speculative_min_acceptance"] = 0.0
    if speculative == "draft":
        options["draft_layers"] = draft_layers
    return options


def summarise(runs: list[Run]) -> dict:
    """Medians over rounds, each mode against speculation off; speedup = tokens/s over off's."""
    table = [
        "| prompts | batch | mode | off tok/s | mode tok/s | speedup | TPOT off / mode (ms) | acceptance "
        "| tokens per verify step | same output |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    rows = []
    for set_name, batch, mode in dict.fromkeys(
        (r.prompt_set, r.batch, r.speculative) for r in runs if r.speculative != "off"
    ):
        pick = {
            m: [r for r in runs if (r.prompt_set, r.batch, r.speculative) == (set_name, batch, m)]
            for m in ("off", mode)
        }
        tps = {m: statistics.median(r.tokens_per_second for r in rs) for m, rs in pick.items()}
        tpot = {m: statistics.median(r.tpot_ms for r in rs) for m, rs in pick.items()}
        drafted = sum(r.draft_tokens for r in pick[mode])
        accepted = sum(r.accepted_tokens for r in pick[mode])
        steps = sum(r.drafts for r in pick[mode])
        acceptance = accepted / drafted if drafted else 0.0
        per_step = (accepted + steps) / steps if steps else 1.0
        same = statistics.mean(r.same_outputs for r in pick[mode])
        rows.append(
            {
                "prompt_set": set_name,
                "batch": batch,
                "mode": mode,
                "tokens_per_second": tps,
                "tpot_ms": tpot,
                "same_outputs": same,
                "speedup": tps[mode] / tps["off"],
                "acceptance": acceptance,
                "tokens_per_verify_step": per_step,
            }
        )
        table.append(
            f"| {set_name} | {batch} | {mode} | {tps['off']:.1f} | {tps[mode]:.1f} | {tps[mode] / tps['off']:.2f}x | "
            f"{tpot['off']:.1f} / {tpot[mode]:.1f} | {acceptance:.2f} | {per_step:.2f} | {same:.0%} |"
        )
    return {"summary": rows, "table": table}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spec_decode", description="n-gram speculative decoding on and off"
    )
    parser.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["ngram"],
        help="speculative modes to compare with off, each also as MODE-no-window (default: ngram)",
    )
    parser.add_argument(
        "--draft-layers", type=int, default=8, help="draft mode: the target's layers the draft runs (default: 8)"
    )
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per setting (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most (default: 160)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output", default="bench/out/spec_decode.json")
    return parser


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
