"""Where one decode step's milliseconds go, at batch 1 and 16, per weight scheme.

    .venv/bin/python -m bench.profile_step [--batches 1,16] [--schemes none,int4] [--steps 40] [--compile-decode]

For each (scheme, batch): the embedded model in the CPU default dtype, `batch` requests with
64-127-token prompts prefilled, then `steps` decode steps timed plainly (the step time), and the
same number again under torch.profiler for the split: self CPU time per aten op, summed into
groups (linear layers, attention, KV gathers and writes, norms and elementwise, sampling, copies),
plus what no op accounts for (Python: scheduling, input preparation, bookkeeping, detokenizing).
With --compile-decode, batch-1 steps run the compiled graph: its fused kernels and its entry
(guards, wrappers) are groups of their own.
The profiler adds its own cost per op, so the split is read as shares of the profiled step,
scaled to the plain step time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.quantization import VARIANTS, decoding_engine

# aten op names -> group: exact names, then name fragments; the first group that matches wins.
GROUPS: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    ("attention", frozenset({"softmax", "_softmax", "baddbmm"}), ("scaled_dot_product", "attention")),
    ("linear", frozenset({"linear", "addmm", "mm", "bmm", "matmul"}), ("pack_mm",)),
    ("KV gather/write", frozenset(), ("index_select", "index_put", "index_copy", "gather", "scatter")),
    (
        "sampling",
        frozenset({"argmax", "topk", "sort", "multinomial", "exponential_", "log_softmax", "cumsum", "max", "div_"}),
        (),
    ),
    (
        "copies/casts/views",
        frozenset(
            {
                "copy_",
                "to",
                "_to_copy",
                "contiguous",
                "clone",
                "cat",
                "stack",
                "empty",
                "empty_like",
                "zeros",
                "full",
                "arange",
                "lift_fresh",
                "as_strided",
                "view",
                "reshape",
                "_reshape_alias",
                "slice",
                "select",
                "unsqueeze",
                "transpose",
                "permute",
                "expand",
                "narrow",
                "split",
                "split_with_sizes",
                "chunk",
                "t",
                "unbind",
                "detach",
                "item",
                "_local_scalar_dense",
                "resize_",
            }
        ),
        (),
    ),
    (
        "norms/elementwise/rope",
        frozenset(
            {
                "mul",
                "add",
                "rsqrt",
                "pow",
                "mean",
                "silu",
                "neg",
                "sub",
                "div",
                "cos",
                "sin",
                "where",
                "masked_fill",
                "embedding",
                "exp",
                "sum",
                "clamp",
                "mul_",
                "add_",
                "rms_norm",
                "_fused_rms_norm",
            }
        ),
        (),
    ),
)


# Profiler events of a torch.compile graph (not aten ops): its generated kernels, and its entry.
COMPILED_GROUPS: tuple[tuple[str, str], ...] = (
    ("## Call CompiledFxGraph", "compiled fused kernels"),
    ("TorchDynamo Cache Lookup", "compiled graph entry"),
    ("Pregraph bytecode", "compiled graph entry"),
    ("Torch-Compiled Region", "compiled graph entry"),
    ("AOTDispatcher", "compiled graph entry"),
)


def group_of(op: str) -> str:
    name = op.removeprefix("aten::")
    for group, exact, fragments in GROUPS:
        if name in exact or any(f in name for f in fragments):
            return group
    return "other ops"


def profile_one(label: str, batch: int, steps: int, compile_decode: bool) -> dict[str, object]:
    engine = decoding_engine(label, batch, 2 * steps + 8, compile_decode)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) / steps * 1000
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        group = (
            group_of(event.key)
            if event.key.startswith("aten::")
            else next((g for prefix, g in COMPILED_GROUPS if event.key.startswith(prefix)), None)
        )
        if group is not None:
            groups[group] += event.self_cpu_time_total / 1000 / steps
    groups["Python and the rest"] = max(0.0, profiled_ms - sum(groups.values()))
    scale = step_ms / profiled_ms
    return {
        "scheme": label,
        "batch": batch,
        "compile_decode": compile_decode,
        "step_ms": round(step_ms, 2),
        "profiled_step_ms": round(profiled_ms, 2),
        "split_ms": {k: round(v * scale, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--schemes", default="none,int4", help=f"of {', '.join(v[0] for v in VARIANTS)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compile-decode", action="store_true", help="the engine's compile_decode (batch 1 compiled)")
    parser.add_argument("--output", default="bench/out/profile_step.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for label in args.schemes.split(","):
            result = profile_one(label, batch, args.steps, args.compile_decode)
            results.append(result)
            split = ", ".join(f"{k} {v}" for k, v in result["split_ms"].items())  # type: ignore[union-attr]
            print(f"{label:>5} batch {batch:>3}: {result['step_ms']} ms/step ({split})", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
