"""The step cost of LoRA adapters in a batch against the base model alone (issue 43).

    .venv/bin/python -m bench.lora_step [--batch 8] [--rank 16] [--steps 22] [--rounds 5]

The embedded model (CPU default dtype) with `batch` requests decoding, in five configurations, each
measured once per round in turn (interleaved: a shared machine's drift falls on all of them alike):
LoRA off; LoRA on, every request on the base model; one adapter for all; two adapters, half each;
four adapters, a quarter each. The adapters are random PEFT ones of `rank` on all seven projections
(made with `peft` in a temporary folder). A configuration's step is the median decode step of
`steps`; the table gives the median over rounds and the ratio to LoRA off.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.llm import LLM
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.model.loader import embedded_model_dir
from tests.engine.lora_fixtures import AdapterSpec, make_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (label, adapters in the batch; 0 with LoRA on: the base model through the wrapped layers; None: LoRA off)
CONFIGS: tuple[tuple[str, int | None], ...] = (
    ("LoRA off", None),
    ("LoRA on, base model", 0),
    ("1 adapter", 1),
    ("2 adapters", 2),
    ("4 adapters", 4),
)


def _engine(adapters: list[Path], count: int | None, batch: int, max_tokens: int) -> LLMEngine:
    """`batch` requests prefilled and one decode step taken: every further step() is a decode step."""
    lora = {} if count is None else {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4}
    engine = LLM(kv_cache_memory_bytes=1 << 30, max_num_seqs=batch, max_num_batched_tokens=8192, **lora).engine
    for i, path in enumerate(adapters if count else []):
        engine.add_lora(f"a{i}", str(path))
    text = engine.tokenize("Paged attention keeps the keys and values of every token in fixed-size blocks. " * 20)
    for i in range(batch):
        name = f"a{i % count}" if count else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(text[i % 17 : i % 17 + 64], params, lora_name=name)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()
    return engine


def _median_step(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_step", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        adapters = []
        for i in range(4):
            make_adapter(
                embedded_model_dir(),
                AdapterSpec(f"a{i}", args.rank, 2 * args.rank, TARGETS, i + 1),
                Path(scratch) / f"a{i}",
            )
            adapters.append(Path(scratch) / f"a{i}")
        seen: dict[str, list[float]] = {label: [] for label, _ in CONFIGS}
        for round_ in range(args.rounds):
            for label, count in CONFIGS:
                engine = _engine(adapters, count, args.batch, args.steps + 8)
                seen[label].append(_median_step(engine, args.steps))
            print(f"round {round_ + 1}/{args.rounds}", flush=True)
    base = statistics.median(seen["LoRA off"])
    print(f"\n| batch of {args.batch}, rank {args.rank} | step | vs LoRA off |\n| --- | --- | --- |")
    for label, _ in CONFIGS:
        step = statistics.median(seen[label])
        print(f"| {label} | {step * 1000:.1f} ms | {step / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
