"""The decode-attention kernel of a git revision against the working tree's, side by side in one
process (the VM's speed moves too much between runs to compare two).

Both sources (engine/model/cpu_kernels.py) are built under operator namespaces of their own and
called alternately on the embedded model's shapes: 30 layers of a bf16 cache of 3 KV heads x 64,
one sequence of `ctx` tokens in 16-token blocks in random order, 9 query heads. A step is one call
per layer; between two calls 3 MB are read (a decode step's int4 weights of one layer), so each
layer's KV comes from memory as in a served step; `--hot` leaves that out. Times in ms per step,
the median of 12 alternating rounds.

    .venv/bin/python -m bench.attention_ab [--rev HEAD] [--contexts 100,400,1000,2000] [--hot]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch
from torch.utils.cpp_extension import load_inline

from kvpilot.engine.model import cpu_kernels
from kvpilot.engine.worker.cpu_features import read_cpu_flags

LAYERS, KV_HEADS, DIM, HEADS, SLOTS, BLOCK = 30, 3, 64, 9, 8192, 16
KERNEL = "engine/model/cpu_kernels.py"


def _source_at(rev: str) -> str:
    """The kernel source of engine/model/cpu_kernels.py at a git revision."""
    text = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], capture_output=True, text=True, check=True).stdout
    scope: dict[str, object] = {"__name__": "kernels_at_rev"}
    exec(compile(text, f"{rev}:{KERNEL}", "exec"), scope)
    return str(scope["_SOURCE"])


def _build(namespace: str, source: str) -> Callable[..., torch.Tensor]:
    """Build a kernel source with its operators under `namespace`; its attention operator."""
    renamed = source.replace("TORCH_LIBRARY(kvpilot", f"TORCH_LIBRARY({namespace}").replace(
        "TORCH_LIBRARY_IMPL(kvpilot", f"TORCH_LIBRARY_IMPL({namespace}"
    )
    load_inline(
        namespace,
        cpp_sources=renamed,
        extra_cflags=["-O3", "-fopenmp", *cpu_kernels.level_for(read_cpu_flags()).cflags],
        extra_ldflags=["-fopenmp"],
        build_directory=tempfile.mkdtemp(prefix=f"{namespace}-"),
        is_python_module=False,
    )
    return getattr(torch.ops, namespace).paged_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="the revision to compare the working tree with")
    parser.add_argument("--contexts", default="100,400,1000,2000")
    parser.add_argument("--hot", action="store_true", help="no read between layers: the KV stays in cache")
    args = parser.parse_args()
    ops = {
        args.rev: _build("kv_rev", _source_at(args.rev)),
        "tree": _build("kv_tree", cpu_kernels._SOURCE),
    }
    torch.manual_seed(0)
    caches = [
        (torch.randn(SLOTS, KV_HEADS, DIM).bfloat16(), torch.randn(SLOTS, KV_HEADS, DIM).bfloat16())
        for _ in range(LAYERS)
    ]
    between = torch.randn(3 * 1024 * 1024 // 4)
    print(f"threads {torch.get_num_threads()}, {'hot' if args.hot else 'cold'} KV")
    for ctx in (int(c) for c in args.contexts.split(",")):
        blocks = torch.randperm(SLOTS // BLOCK)[: -(-ctx // BLOCK)]
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:ctx][None].contiguous()
        lengths, q = torch.tensor([ctx]), torch.randn(1, HEADS, DIM)
        first, second = (op(q, *caches[0], slots, lengths, DIM**-0.5) for op in ops.values())
        torch.testing.assert_close(first, second, atol=1e-5, rtol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for round_ in range(12):
            for name in list(ops) if round_ % 2 else list(ops)[::-1]:
                spent = 0
                for k, v in caches:
                    if not args.hot:
                        between.sum()
                    started = time.perf_counter_ns()
                    ops[name](q, k, v, slots, lengths, DIM**-0.5)
                    spent += time.perf_counter_ns() - started
                times[name].append(spent / 1e6)
        rev, tree = (statistics.median(times[name]) for name in ops)
        print(f"ctx {ctx:5d}: {args.rev} {rev:.3f} ms/step  tree {tree:.3f} ms/step  tree/{args.rev} {tree / rev:.2f}")


if __name__ == "__main__":
    main()
