"""Which CPU kernels the engine runs, from the CPU's instruction-set flags. Torch-free.

Three paths, chosen at start-up from /proc/cpuinfo (or forced by `cpu_kernels`):

- bf16: the CPU has bf16 arithmetic (AVX512-BF16, AMX-BF16). Activations and weights compute in
  bf16 (dtype auto), half the bytes of fp32 to read and native products; W8A8 multiplies int8 x
  int8 (oneDNN).
- vnni: int8 dot products (AVX512-VNNI, AVX-VNNI, AMX-INT8) but no bf16, whose conversions would
  be emulated: activations stay fp32 (dtype auto), and the integer kernels are the fast path: W8A8
  multiplies int8 x int8 in int32.
- fp32: neither (an AVX2-only x86, a CPU whose flags are not x86's). Activations fp32; W8A8
  computes its integer products with the fp32 GEMM, the portable choice (on an x86 limited to
  AVX2, oneDNN's int8 GEMM would gain from 16 tokens on: bench/history/2026-12-01-cpu-kernel-paths-w8a8.md,
  "W8A8 without integer dot products").

Weight-only INT8/INT4 run PyTorch's packed kernels on every path (their activations cast to bf16),
except the decode-sized steps that the engine's C++ kernels serve where the CPU has their ISA
(engine/cpu/kernels.py, from AVX2 on: bf16 dot products with AVX512-BF16, integer ones of
16-bit activations elsewhere).
On an x86 CPU (AVX2 or newer) full-precision weights are served from oneDNN's blocked layout, fp32
ones always and bf16 ones where the CPU has bf16 arithmetic (engine/cpu/onednn_linear.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

KERNEL_PATHS = ("bf16", "vnni", "fp32")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
X86_VECTOR_FLAGS = frozenset({"avx2", "avx512f"})
CPUINFO = "/proc/cpuinfo"


class KernelPath(NamedTuple):
    name: str  # one of KERNEL_PATHS
    reason: str  # why: the flags that decided, or the override
    # Weight dtypes ("float32", "bfloat16") served from oneDNN's blocked layout: the CPU's, whatever
    # the path (a path forced for a test does not change what the CPU runs well).
    onednn_dtypes: tuple[str, ...] = ()

    @property
    def bf16(self) -> bool:
        """Whether activations compute in bf16 when the dtype is auto."""
        return self.name == "bf16"

    @property
    def integer_kernels(self) -> bool:
        """Whether W8A8 multiplies with the int8 GEMM (else with the fp32 one)."""
        return self.name != "fp32"


def read_cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first "flags" line (none where there is no such file)."""
    if cpuinfo is None:
        try:
            with open(CPUINFO) as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    found = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(found.group(1).split()) if found else frozenset()


def onednn_dtypes(flags: frozenset[str]) -> tuple[str, ...]:
    """The weight dtypes oneDNN's packed kernels serve well on a CPU with these flags."""
    if not flags & X86_VECTOR_FLAGS:
        return ()
    return ("float32", "bfloat16") if flags & BF16_FLAGS else ("float32",)


def kernel_path(flags: frozenset[str]) -> KernelPath:
    """The fastest path these flags allow."""
    packed = onednn_dtypes(flags)
    bf16 = sorted(flags & BF16_FLAGS)
    if bf16:
        return KernelPath("bf16", f"cpu flags {','.join(bf16)}", packed)
    dot = sorted(flags & INT8_DOT_FLAGS)
    if dot:
        return KernelPath("vnni", f"cpu flags {','.join(dot)}, no bf16", packed)
    return KernelPath("fp32", "no bf16 or int8 dot-product cpu flags", packed)


def choose_kernel_path(override: str, flags: frozenset[str] | None = None) -> KernelPath:
    """`override` (a path, or auto: from `flags`, default this CPU's) -> the path the engine runs."""
    flags = read_cpu_flags() if flags is None else flags
    if override == "auto":
        return kernel_path(flags)
    if override not in KERNEL_PATHS:
        raise ValueError(f"unknown cpu kernel path {override!r}; known: auto, {', '.join(KERNEL_PATHS)}")
    return KernelPath(override, "forced by cpu_kernels", onednn_dtypes(flags))
