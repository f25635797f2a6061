"""Decode speed and weight memory per quantization scheme, side by side in one run.

    .venv/bin/python -m bench.quantization [--batches 1,16,64] [--steps 48] [--rounds 2]
        [--schemes fp32,none,int8,int4,w8a8] [--cpu-kernels auto|bf16|vnni|fp32]

For each batch size, every scheme in turn (order alternating by round) loads the embedded model,
admits `batch` requests (prompts of 64-127 tokens), runs their prefill, then times `steps` decode
steps. Decode tokens/s = batch x steps / time; the median over rounds is reported per scheme,
with its ratio to the unquantized model (fp32, and the CPU default dtype "none") in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.machine import machine, write_result
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.llm_engine import LLMEngine

# (label, quantization, dtype): the unquantized model in fp32 and in the CPU default (bf16 where native).
VARIANTS = (
    ("fp32", "none", "float32"),
    ("none", "none", "auto"),
    ("int8", "int8", "auto"),
    ("int4", "int4", "auto"),
    ("w8a8", "w8a8", "auto"),
)
SCHEMES = tuple(label for label, _, _ in VARIANTS)


def decoding_engine(
    label: str, batch: int, max_tokens: int, compile_decode: bool = False, cpu_kernels: str = "auto"
) -> LLMEngine:
    """The embedded model under `label`'s scheme with `batch` requests (prompts of 64-127 tokens)
    prefilled and one decode step taken: every further step() is a decode step of `batch`."""
    _, scheme, dtype = next(v for v in VARIANTS if v[0] == label)
    llm = LLM(
        quantization=scheme,
        dtype=dtype,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=8192,
        compile_decode=compile_decode,
        cpu_kernels=cpu_kernels,
    )
    engine = llm.engine
    text = engine.tokenize("Paged attention keeps the keys and values of every token in fixed-size blocks. " * 20)
    for i in range(batch):
        engine.add_request(
            text[i % 17 : i % 17 + 64 + i % 64], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill, untimed
    engine.step()  # one decode step to warm up
    return engine


def decode_tokens_per_second(label: str, batch: int, steps: int, cpu_kernels: str) -> tuple[float, int]:
    engine = decoding_engine(label, batch, steps + 8, cpu_kernels=cpu_kernels)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    return batch * steps / elapsed, engine.runner.weight_bytes


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantization", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="of " + ",".join(SCHEMES))
    parser.add_argument("--cpu-kernels", default="auto", help="the engine's cpu_kernels (auto, bf16, vnni, fp32)")
    parser.add_argument("--output", default="bench/out/quantization.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    schemes = tuple(args.schemes.split(","))
    runs: dict[str, dict[str, list[float]]] = {}
    weights: dict[str, int] = {}
    for batch in batches:
        for rnd in range(args.rounds):
            order = schemes if rnd % 2 == 0 else tuple(reversed(schemes))
            for scheme in order:
                tps, weights[scheme] = decode_tokens_per_second(scheme, batch, args.steps, args.cpu_kernels)
                runs.setdefault(str(batch), {}).setdefault(scheme, []).append(tps)
                print(
                    f"batch {batch:3d} round {rnd + 1} {scheme:5s}: {tps:8.1f} decode tok/s  "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    ratios = [(a, b) for a in schemes for b in ("none", "fp32", "int8") if a != b and b in schemes and a != "fp32"]
    print(
        "\n| batch | "
        + " | ".join(f"{s} tok/s" for s in schemes)
        + "".join(f" | {a} / {b}" for a, b in ratios)
        + " |\n| ---: | "
        + " | ".join("---:" for _ in [*schemes, *ratios])
        + " |"
    )
    medians = {b: {s: statistics.median(v) for s, v in per.items()} for b, per in runs.items()}
    for b, m in medians.items():
        cells = [f"{m[s]:.1f}" for s in schemes] + [f"{m[a] / m[c]:.2f}x" for a, c in ratios]
        print(f"| {b} | " + " | ".join(cells) + " |")
    print("\nweights: " + ", ".join(f"{s} {weights[s] / 2**20:.1f} MiB" for s in schemes))
    write_result(
        Path(args.output),
        {
            "command": "python -m bench.quantization",
            "args": vars(args),
            "runs": runs,
            "medians": medians,
            "weight_bytes": weights,
            "machine": machine(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
