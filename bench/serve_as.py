"""`kvpilot serve` as on a CPU without some of this one's flags: the kernel path, the dtype and the
C++ kernels' ISA level follow the reduced flags, so another CPU type's code is served and timed
here (bench/history/2026-12-02-serving-cpu-decode.md, "The Ice Lake path on a Zen 5"). Hiding
avx512_bf16 and amx_bf16 on a CPU with AVX512-VNNI gives an Ice Lake's engine: the vnni path (fp32
activations) and the avx512 level (INT4 as 16-bit integer products).

    .venv/bin/python -m bench.serve_as --hide avx512_bf16,amx_bf16 -- --quantization int4 --compile-decode --port 8124
    .venv/bin/kvpilot bench serve --base-url http://127.0.0.1:8124 --backends kvpilot ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvpilot.engine.cpu import features as cpu_features
from kvpilot.engine.worker import model_runner


def hiding(read: Callable[..., frozenset[str]], hidden: frozenset[str]) -> Callable[..., frozenset[str]]:
    """`read` (cpu_features.read_cpu_flags) without the `hidden` flags."""

    def read_without(cpuinfo: str | None = None) -> frozenset[str]:
        return read(cpuinfo) - hidden

    return read_without


def install(hidden: frozenset[str]) -> None:
    """Every engine this process starts reads the CPU's flags without `hidden`."""
    reduced = hiding(cpu_features.read_cpu_flags, hidden)
    cpu_features.read_cpu_flags = reduced
    model_runner.read_cpu_flags = reduced  # imported by name there


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_as", description=__doc__.splitlines()[0])
    parser.add_argument("--hide", required=True, help="comma-separated /proc/cpuinfo flags the engine must not see")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the flags of kvpilot serve")
    args = parser.parse_args(argv)
    install(frozenset(flag.strip() for flag in args.hide.split(",") if flag.strip()))
    from kvpilot.engine.cli import main as kvpilot

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    sys.argv = ["kvpilot", "serve", *serve_args]
    kvpilot()


if __name__ == "__main__":
    main()
