"""One linear layer per kernel the engine can route a CPU matmul to, at several tokens per step.

For each weight shape (the embedded model's four body layers and a 2048x2048 one) and token count:
the weight-only packed kernels (INT8, INT4 group 32) against the same weight dequantized into a
bf16 GEMM (their dense routes, INT8_DENSE_TOKENS / INT4_DENSE_TOKENS), W8A8's int8 x int8 GEMM
(activation quantization included) on fp32 and bf16 activations, and the bf16 / fp32 GEMMs, on the
plain weight (`F.linear`) and on the weight packed in oneDNN's layout (engine/cpu/onednn_linear.py,
where the engine serves unquantized layers on x86), and kvpilot's own INT8 / INT4 matmuls
(engine/cpu/kernels.py) where this CPU runs them. Times in ms, the fastest of repeated calls
(kvpilot.engine.profiling.measure.call_seconds). `--copies N` rotates each call over N copies of the weight,
so that a decode-sized call reads it from memory as a model's step does (one copy stays in cache).

    .venv/bin/python -m bench.cpu_kernels [--tokens 1,16,64,256] [--min-seconds 0.2] [--threads N]
        [--shapes qkv,lm_head] [--kernels "bf16 GEMM,bf16 GEMM packed"] [--copies 8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu import onednn_linear
from kvpilot.engine.cpu.compile_cache import resolve_root
from kvpilot.engine.cpu.features import onednn_dtypes, read_cpu_flags
from kvpilot.engine.cpu.threads import cpu_threads
from kvpilot.engine.model.quantization import Int4WeightOnly, Int8Dynamic, Int8WeightOnly, cpu_int4_layout
from kvpilot.engine.profiling.measure import call_seconds

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
    "square": (2048, 2048),
}


def _kernels(
    weight: torch.Tensor, ours: frozenset[str], packed_dtypes: tuple[str, ...]
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Kernel name -> x (fp32) -> y, each on its own copy of the weight in its serving form; `ours`:
    the schemes whose kvpilot matmul this CPU runs; `packed_dtypes`: the dtypes oneDNN packs here."""
    int8, int4, w8a8 = nn.Module(), nn.Module(), nn.Module()
    Int8WeightOnly().quantize(int8, weight)
    Int4WeightOnly(32).quantize(int4, weight)
    Int8Dynamic(True).quantize(w8a8, weight)
    bf16, aten = weight.bfloat16(), torch.ops.aten
    packed = {dtype: onednn_linear.pack(weight.to(getattr(torch, dtype))) for dtype in packed_dtypes}
    kernels = {
        "int8 packed": lambda x: aten._weight_int8pack_mm(x.bfloat16(), int8.qweight, int8.scales),
        "int8 kvpilot": lambda x: cpu_kernels.int8_mm(x.bfloat16(), int8.qweight, int8.scales),
        "int8 dense": lambda x: nn.functional.linear(x.bfloat16(), Int8WeightOnly._weight(int8, torch.bfloat16)),
        "int4 packed": lambda x: aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), int4.qweight, 32, int4.scales_and_zeros
        ),
        "int4 kvpilot": lambda x: cpu_kernels.int4_mm(
            x.bfloat16(), int4.qweight, 32, int4.scales_and_zeros, cpu_int4_layout().rows
        ),
        "int4 dense": lambda x: nn.functional.linear(x.bfloat16(), Int4WeightOnly(32)._weight(int4, torch.bfloat16)),
        "w8a8 (fp32 act.)": lambda x: Int8Dynamic(True).matmul(w8a8, x),
        "w8a8 (bf16 act.)": lambda x: Int8Dynamic(True).matmul(w8a8, x.bfloat16()),
        "bf16 GEMM": lambda x: nn.functional.linear(x.bfloat16(), bf16),
        "bf16 GEMM packed": lambda x: onednn_linear.linear(x.bfloat16(), packed["bfloat16"], None),
        "fp32 GEMM": lambda x: nn.functional.linear(x, weight),
        "fp32 GEMM packed": lambda x: onednn_linear.linear(x, packed["float32"], None),
    }
    runs = {"int8 kvpilot": "int8" in ours, "int4 kvpilot": "int4" in ours}
    runs |= {"bf16 GEMM packed": "bfloat16" in packed, "fp32 GEMM packed": "float32" in packed}
    return {name: call for name, call in kernels.items() if runs.get(name, True)}


def _rotating(calls: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One call per copy of the weight in turn."""
    turn = [0]

    def call(x: torch.Tensor) -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(calls)
        return calls[turn[0]](x)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,128,256,512,1024")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,square", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--kernels", help="a comma-separated subset of the kernels' names (default: all)")
    parser.add_argument("--min-seconds", type=float, default=0.2)
    parser.add_argument("--threads", type=int, help="torch threads (default: as the engine would use)")
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight the calls rotate over")
    args = parser.parse_args()
    threads, why = (args.threads, "--threads") if args.threads else cpu_threads()
    torch.set_num_threads(threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    flags = read_cpu_flags()
    cpu_kernels.load(resolve_root(None), flags)
    ours = cpu_kernels.matmul_schemes(flags)
    packed_dtypes = onednn_dtypes(flags) if onednn_linear.available() else ()
    print(f"torch {torch.__version__}, {threads} threads ({why}), {args.copies} copies, ms per call (fastest)")
    for name in args.shapes.split(","):
        out_features, in_features = SHAPES[name]
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
        print(f"\n{name} {out_features}x{in_features}\n")
        print("| kernel | " + " | ".join(str(n) for n in tokens) + " |")
        print("|---|" + "---:|" * len(tokens))
        copies = [_kernels(weight, ours, packed_dtypes) for _ in range(args.copies)]
        names = args.kernels.split(",") if args.kernels else list(copies[0])
        kernels = {name: _rotating([c[name] for c in copies]) for name in names if name in copies[0]}
        with torch.inference_mode():
            for kernel, call in kernels.items():
                times = []
                for n in tokens:
                    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(n))
                    times.append(min(call_seconds(lambda x=x, call=call: call(x), args.min_seconds)) * 1e3)
                print(f"| {kernel} | " + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
