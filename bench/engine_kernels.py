"""An engine's decode step on its C++ kernels (engine/cpu/kernels.py) against the same
engine's step on PyTorch's, per scheme and batch, in alternating rounds.

    .venv/bin/python -m bench.engine_kernels [--schemes none,int8,int4,w8a8] [--batches 1,16] [--rounds 4]

One engine per (scheme, batch) (bench.quantization.decoding_engine: prompts of 64-127 tokens
prefilled), switched between the two with `ModelRunner.use_cpu_kernels`: rounds of a few steps
each alternate, so the ratio holds while the machine's speed drifts (a shared VM: 2x between hours).
Prints the median step of each side and their ratio.
"""

from __future__ import annotations

import argparse
import statistics

from bench.quantization import decoding_engine
from kvpilot.engine.profiling.measure import call_seconds

STEPS_PER_ROUND = 4


def kernels_ratio(scheme: str, batch: int, rounds: int) -> tuple[float, float]:
    """Median decode step seconds (C++ kernels, PyTorch's kernels) of one engine."""
    engine = decoding_engine(scheme, batch, 2 * rounds * (STEPS_PER_ROUND + 1) + 8)
    runner = engine.runner
    if not runner.decode_kernel:  # a CPU engine starts on them wherever they loaded
        raise SystemExit("the C++ kernels did not load here (event=cpu_kernels_unavailable in the log)")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            runner.use_cpu_kernels(on)
            times[on] += call_seconds(engine.step, 0.0, min_calls=STEPS_PER_ROUND)
    runner.use_cpu_kernels(True)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="none,int8,int4,w8a8")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    for scheme in args.schemes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            ours, theirs = kernels_ratio(scheme, batch, args.rounds)
            print(
                f"{scheme} batch {batch}: C++ kernels {ours * 1e3:.1f} ms, PyTorch's {theirs * 1e3:.1f} ms, "
                f"x{ours / theirs:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
