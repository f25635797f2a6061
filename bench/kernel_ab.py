"""A kernel of a git revision against the working tree's, side by side in one process (the VM's
speed moves too much between runs to compare two).

Both sources (engine/cpu/csrc/cpu_kernels.cpp; before it, the string in
engine/cpu/kernels.py) are built under operator namespaces of their own and
called alternately on the embedded model's shapes, one call per layer of its 30 making a step;
times in ms per step, the median of 12 alternating rounds, and the outputs of the two compared.

- `--op attention`: decode attention over a bf16 cache of 3 KV heads x 64, one sequence of `ctx`
  tokens in 16-token blocks in random order, 9 query heads. Between two calls 3 MB are read (a
  decode step's int4 weights of one layer), so each layer's KV comes from memory as in a served
  step; `--hot` leaves that out.
- `--op int4_mm`: the INT4 product (group 32) of each layer's qkv, o, gate_up and down weights,
  30 layers' own (53 MB: from memory, as in a served step), at `--tokens` tokens per call, in
  `--rows`-row blocks (PyTorch's AVX2 layout: 32; its AVX512 one: 64).

    .venv/bin/python -m bench.kernel_ab --op attention [--rev HEAD] [--contexts 100,400,1000,2000] [--hot]
    .venv/bin/python -m bench.kernel_ab --op int4_mm [--rev HEAD] [--tokens 1,4,16] [--rows 32]

`--level` builds both for a narrower ISA level than this CPU's (`avx2`: a Zen 3's code; `avx512`:
an Ice Lake's, whose INT4 product multiplies 16-bit integers where avx512-bf16 multiplies bf16).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
from torch.utils.cpp_extension import load_inline

from bench.cpu_kernels import SHAPES
from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu.features import read_cpu_flags

LAYERS, KV_HEADS, DIM, HEADS, SLOTS, BLOCK = 30, 3, 64, 9, 8192, 16
INT4_SHAPES = {name: SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}
INT4_GROUP = 32
KERNEL = "engine/cpu/csrc/cpu_kernels.cpp"
# Where revisions before the .cpp file held the source: a string in the loader module.
OLD_KERNEL = "engine/cpu/kernels.py"
Step = Callable[[], torch.Tensor]  # one call of the kernel on one layer's inputs


def _source_at(rev: str) -> str:
    """The kernel source at a git revision: its .cpp file, else (an older revision) the string in the
    loader module, its constants already substituted (the defines the build passes go unused)."""
    shown = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], capture_output=True, text=True)
    if shown.returncode == 0:
        return shown.stdout
    text = subprocess.run(["git", "show", f"{rev}:{OLD_KERNEL}"], capture_output=True, text=True, check=True).stdout
    scope: dict[str, object] = {"__name__": "kernels_at_rev"}
    exec(compile(text, f"{rev}:{OLD_KERNEL}", "exec"), scope)
    return str(scope["_SOURCE"])


def _build(namespace: str, source: str, level: cpu_kernels.Level) -> object:
    """Build a kernel source for a level with its operators under `namespace`; that namespace's
    operators."""
    renamed = source.replace("TORCH_LIBRARY(kvpilot", f"TORCH_LIBRARY({namespace}").replace(
        "TORCH_LIBRARY_IMPL(kvpilot", f"TORCH_LIBRARY_IMPL({namespace}"
    )
    load_inline(
        namespace,
        cpp_sources=renamed,
        extra_cflags=cpu_kernels.compile_flags(level),
        extra_ldflags=["-fopenmp"],
        build_directory=tempfile.mkdtemp(prefix=f"{namespace}-"),
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)


def _compare(label: str, steps: dict[str, list[Step]], between: Callable[[], object] | None) -> None:
    """Each kernel's outputs checked against the other's, then 12 alternating rounds of a step."""
    first, second = ([layer() for layer in layers] for layers in steps.values())
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(12):
        for name in list(steps) if round_ % 2 else list(steps)[::-1]:
            spent = 0
            for layer in steps[name]:
                if between is not None:
                    between()
                started = time.perf_counter_ns()
                layer()
                spent += time.perf_counter_ns() - started
            times[name].append(spent / 1e6)
    (rev, rev_ms), (_, tree_ms) = ((name, statistics.median(times[name])) for name in steps)
    print(f"{label}: {rev} {rev_ms:.3f} ms/step  tree {tree_ms:.3f} ms/step  tree/{rev} {tree_ms / rev_ms:.2f}")


def _attention(ops: dict[str, object], contexts: list[int], hot: bool) -> None:
    caches = [
        (torch.randn(SLOTS, KV_HEADS, DIM).bfloat16(), torch.randn(SLOTS, KV_HEADS, DIM).bfloat16())
        for _ in range(LAYERS)
    ]
    between = torch.randn(3 * 1024 * 1024 // 4)
    print(f"threads {torch.get_num_threads()}, {'hot' if hot else 'cold'} KV")
    for ctx in contexts:
        blocks = torch.randperm(SLOTS // BLOCK)[: -(-ctx // BLOCK)]
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:ctx][None].contiguous()
        lengths, q = torch.tensor([ctx]), torch.randn(1, HEADS, DIM)
        steps = {
            name: [partial(op.paged_decode_attention, q, k, v, slots, lengths, DIM**-0.5) for k, v in caches]
            for name, op in ops.items()
        }
        _compare(f"ctx {ctx:5d}", steps, None if hot else between.sum)


def _int4_layer(out: int, width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight in PyTorch's CPU int4 layout of `rows`-row blocks, and its scales and zeros."""
    q = torch.randint(0, 16, (out // rows, rows, width), dtype=torch.uint8).permute(0, 2, 1)
    packed = (q[..., : rows // 2] | (q[..., rows // 2 :] << 4)).contiguous().view(out, width // 2)
    scales_zeros = (torch.rand(width // INT4_GROUP, out, 2) * 0.02).to(torch.bfloat16)
    return packed, scales_zeros


def _int4_mm(ops: dict[str, object], tokens: list[int], rows: int) -> None:
    layers = [{name: _int4_layer(*shape, rows) for name, shape in INT4_SHAPES.items()} for _ in range(LAYERS)]
    print(f"threads {torch.get_num_threads()}, {rows}-row blocks, group {INT4_GROUP}")
    for count in tokens:
        inputs = {name: torch.randn(count, width).bfloat16() for name, (_, width) in INT4_SHAPES.items()}
        steps = {
            name: [
                partial(op.int4_mm, inputs[shape], weights[shape][0], INT4_GROUP, weights[shape][1], rows)
                for weights in layers
                for shape in INT4_SHAPES
            ]
            for name, op in ops.items()
        }
        _compare(f"tokens {count:3d}", steps, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=("attention", "int4_mm"), required=True)
    parser.add_argument("--rev", default="HEAD", help="the revision to compare the working tree with")
    parser.add_argument("--contexts", default="100,400,1000,2000", help="attention: tokens of context")
    parser.add_argument("--hot", action="store_true", help="attention: no read between layers (KV stays in cache)")
    parser.add_argument("--tokens", default="1,4,16", help="int4_mm: tokens per call")
    parser.add_argument("--rows", type=int, choices=cpu_kernels.INT4_BLOCK_ROWS, default=32, help="int4_mm")
    runnable = {level.name: level for level in cpu_kernels.runnable_levels(read_cpu_flags())}
    parser.add_argument(
        "--level",
        choices=runnable,
        default=next(iter(runnable)),
        help="the build's ISA level (default: this CPU's widest); a narrower one runs another CPU's code",
    )
    args = parser.parse_args()
    level = runnable[args.level]
    ops = {
        args.rev: _build("kv_rev", _source_at(args.rev), level),
        "tree": _build("kv_tree", cpu_kernels.SOURCE.read_text(), level),
    }
    print(f"level {level.name} ({' '.join(level.cflags)})")
    torch.manual_seed(0)
    if args.op == "attention":
        _attention(ops, [int(c) for c in args.contexts.split(",")], args.hot)
    else:
        _int4_mm(ops, [int(t) for t in args.tokens.split(",")], args.rows)


if __name__ == "__main__":
    main()
