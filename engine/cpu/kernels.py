"""CPU kernels in C++ for the steps a decode spends most in: attention over the paged KV cache
where it lies, and the weight-only INT4 and INT8 matmuls of a few tokens.

Attention. The portable path (attention.py) gathers a decode's context out of the cache into an
fp32 copy and runs SDPA over that copy: per cached token and layer it reads the bf16 row, writes
it twice as wide and reads it again, which made most of a compiled single-sequence step's growth
with the context. This kernel reads each K
and V row once, in the cache's dtype, by slot, and keeps the softmax in fp32: the context is cut
into chunks that the threads share (any number of sequences and KV heads keeps both cores busy;
a short context is cut finer), and the chunks' partial softmax sums are merged per query head as
flash-decoding does. Within a chunk the rows are widened to fp32 once for all the KV head's query
heads, scores are taken 16 (AVX512) or 8 (AVX2) keys at a time, one lane-sum for all their dot products, and the
value sums stay in registers over the chunk's rows (measured: bench/history/2026-12-02-serving-cpu-decode.md,
"Decode attention").

Matmuls. PyTorch's packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) read
a decode step's weights at about half the memory bandwidth of 2 Zen 5 cores; these read the same
buffers (PyTorch's CPU int4 layout, the int8 weight and its scales: nothing is repacked, so the
dense route of quantization.py is unchanged). INT4 where the CPU has AVX512-BF16 (and ATen's
64-row layout) turns each 4-bit value into the bf16 of q - 8 by a table lookup and multiplies with
bf16 dot products: exact products, fp32 sums, at about all of the bandwidth. Elsewhere (AVX2,
AVX512 without bf16) INT4 multiplies in integers as llama.cpp's Q4 x Q8 does, with each token's
group of inputs as 16-bit integers (two int8 halves) instead of 8-bit ones: its rounding, 2^-15
of the group's largest input, is below the bf16 rounding PyTorch's kernel applies, and integer
products need no conversion of the weights to floats (measured on an AVX2 Zen 3:
bench/history/2026-12-02-serving-cpu-decode.md, "INT4 on AVX2"). INT8 converts to fp32 and
multiplies there with AVX512; with AVX2 only it multiplies in integers as INT4 does (16-bit
activations per block of 32 inputs).

The library is built for a level of the x86-64 ISA (AVX512 with BF16, AVX512, AVX2, baseline),
the widest the CPU runs, and registers the operators `kvpilot::paged_decode_attention`,
`kvpilot::int4_mm` and `kvpilot::int8_mm`, so a compiled graph calls them like ATen kernels. An
engine takes it from the compile cache root's `kernels/` folder, else from the libraries an image
ships prebuilt for every level (`kvpilot build-kernels --levels all` into $KVPILOT_CACHE/kernels),
else builds it at start-up (~40 s on 2 cores) with the compiler torch.compile's CPU kernels use
and keeps it in the compile cache root. Each file is named by a hash of its source (csrc/
cpu_kernels.cpp), torch's version, the architecture, the level and the compiler's flags.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

ATTENTION = "kvpilot::paged_decode_attention"
INT4_MM = "kvpilot::int4_mm"
INT8_MM = "kvpilot::int8_mm"
# The blocks of PyTorch's CPU int4 layout (rows i and i + rows / 2 in one byte) that int4_mm reads:
# ATen writes 32-row blocks where it runs AVX2, 64-row ones where it runs AVX512.
INT4_BLOCK_ROWS = (32, 64)
# int4_mm's groups of input columns are multiples of this (ATen's are 32 to 256).
INT4_GROUP_COLUMNS = 32
# The folder of the compile cache root that holds built libraries, one file per CPU type.
KERNELS = "kernels"
# Context tokens per work item at most: small enough that one sequence's context splits over the
# threads, large enough that the merge and the per-item buffers stay cheap.
_CHUNK = 128

# The C++ source, package data (setup.py). The constants it shares with this module reach it as
# defines rather than by editing its text, so the file compiles as it is read and the compiler's
# messages point at its own lines.
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_DEFINES = (f"-DKVPILOT_CHUNK={_CHUNK}", f"-DKVPILOT_INT4_GROUP_COLUMNS={INT4_GROUP_COLUMNS}")


class Level(NamedTuple):
    """One build of the library: the CPU flags (as /proc/cpuinfo names them) its code may use, each
    enabled by its own compiler switch, and the at::vec implementation it is built with."""

    name: str
    needs: frozenset[str]
    vector_isa: str | None  # None: at::vec's portable scalar one

    @property
    def cflags(self) -> list[str]:
        switches = [f"-m{flag.replace('_', '')}" for flag in sorted(self.needs)]  # avx512_bf16 -> -mavx512bf16
        isa = [f"-DCPU_CAPABILITY={self.vector_isa}", f"-DCPU_CAPABILITY_{self.vector_isa}"]
        return switches + (isa if self.vector_isa else ["-DCPU_CAPABILITY=DEFAULT"])


_AVX2 = frozenset({"avx2", "fma", "f16c"})
# What ATen's AVX512 vectors use (as inductor requires for its own AVX512 kernels).
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BASELINE = Level("baseline", frozenset(), None)
# Widest first: a CPU runs the first whose flags it has. Builds by level, not for the build
# machine's own CPU (-march=native), so an image can ship one library per level, built on any
# x86-64, and a node of any CPU type starts without a compiler run (`kvpilot build-kernels`).
LEVELS = (
    Level("avx512-bf16", _AVX512 | {"avx512_bf16"}, "AVX512"),
    Level("avx512", _AVX512, "AVX512"),
    Level("avx2", _AVX2, "AVX2"),
    BASELINE,
)
# Elsewhere (aarch64) the compiler's defaults for the machine are the one level.
BUILDABLE = LEVELS if platform.machine().lower() in ("x86_64", "amd64") else (BASELINE,)

_loaded = False


def runnable_levels(cpu_flags: frozenset[str], levels: Sequence[Level] = BUILDABLE) -> tuple[Level, ...]:
    """The `levels` (this machine's architecture's by default) a CPU of these flags runs, widest first."""
    return tuple(level for level in levels if level.needs <= cpu_flags)


def level_for(cpu_flags: frozenset[str], levels: Sequence[Level] = BUILDABLE) -> Level:
    """The widest of `levels` a CPU of these flags runs (the baseline needs none)."""
    return runnable_levels(cpu_flags, levels)[0]


def compile_flags(level: Level) -> list[str]:
    """The compiler's flags for the library of `level`, the shared constants' defines among them."""
    return ["-O3", "-fopenmp", *level.cflags, *_DEFINES]


def library_name(level: Level) -> str:
    """The built library's file name: its source, torch's version, the machine's architecture, the
    level and the compiler's flags decide it."""
    parts = [SOURCE.read_text(), torch.__version__, platform.machine(), level.name, *compile_flags(level)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"kvpilot_cpu_kernels_{digest}"


def load(root: Path | None, cpu_flags: frozenset[str], prebuilt: Path | None = None) -> None:
    """Register the operators from the library of this CPU's level: the one in `root`'s kernels/
    folder, else the one an image ships in `prebuilt`, else built into `root`; raises on failure."""
    global _loaded
    if _loaded:
        return
    level = level_for(cpu_flags)
    name = f"{library_name(level)}.so"
    cache = root / KERNELS if root is not None else None
    places = [(source, folder / name) for source, folder in (("cache", cache), ("prebuilt", prebuilt)) if folder]
    found = [(source, path) for source, path in places if path.is_file()]
    if found:
        source, path = found[0]
        torch.ops.load_library(str(path))
    elif not has_compiler():
        where = f"none cached at {' or '.join(str(path) for _, path in places)}" if places else "no cache"
        raise RuntimeError(f"no C++ compiler to build the library (g++ or clang++ on PATH, or $CXX) and {where}")
    elif cache is not None:
        source, path = "built", build(level, cache)
        torch.ops.load_library(str(path))
    else:  # nowhere to keep it: loaded from a folder removed once the library is mapped
        with tempfile.TemporaryDirectory(prefix="kvpilot-kernels-") as folder:
            source, path = "built", build(level, Path(folder))
            torch.ops.load_library(str(path))
    log.info("event=cpu_kernels source=%s level=%s vector_isa=%s path=%s", source, level.name, level.vector_isa, path)
    torch.library.register_fake(ATTENTION)(_fake_attention)
    torch.library.register_fake(INT4_MM)(_fake_int4_mm)
    torch.library.register_fake(INT8_MM)(_fake_int8_mm)
    _loaded = True


def has_compiler() -> bool:
    """Whether a C++ compiler is on PATH for the library and torch.compile's CPU kernels."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++"))


def int4_activations(cpu_flags: frozenset[str], block_rows: int, levels: Sequence[Level] = BUILDABLE) -> str:
    """What int4_mm multiplies the weights with on a CPU of these flags, for PyTorch's layout of
    `block_rows`: the bf16 activations (bf16 dot products) with AVX512-BF16 on 64-row blocks, else
    16-bit integers per group of inputs (integer products)."""
    return "bf16" if "avx512_bf16" in level_for(cpu_flags, levels).needs and block_rows == 64 else "int16"


def matmul_schemes(cpu_flags: frozenset[str], levels: Sequence[Level] = BUILDABLE) -> frozenset[str]:
    """The weight-only schemes whose matmul the library of this CPU's level (of `levels`) runs: both
    from AVX2 on."""
    return frozenset({"int8", "int4"}) if "avx2" in level_for(cpu_flags, levels).needs else frozenset()


def build(level: Level, folder: Path) -> Path:
    """Build the library of `level` into `folder` without loading it (a level wider than this CPU
    is built here for an image, never run): in a directory of its own, published by rename, so an
    engine reading the folder finds a whole library or none."""
    # torch's own builder behind load_inline, which would also load the library.
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    name = library_name(level)
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    # torch's builder runs `ninja` from PATH: the one pip installed beside this Python comes first.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        _write_ninja_file_and_build_library(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=compile_flags(level),
            extra_cuda_cflags=[],
            extra_sycl_cflags=[],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[],
            build_directory=str(work),
            verbose=False,
            with_cuda=False,
            with_sycl=False,
        )
        os.replace(work / f"{name}.so", folder / f"{name}.so")
    finally:
        os.environ["PATH"] = path
        shutil.rmtree(work, ignore_errors=True)
    return folder / f"{name}.so"


def _fake_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


def _fake_int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor, rows: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_zeros.shape[1])


def _fake_int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per sequence over its cached context. q: [sequences, heads, dim]
    fp32; caches [slots, kv_heads, dim]; slots [sequences, width] (padded); lengths [sequences]:
    how many of a row's slots are its context. Returns [sequences, heads, dim] fp32."""
    return torch.ops.kvpilot.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, slots, lengths, q.shape[-1] ** -0.5
    )


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor, rows: int) -> torch.Tensor:
    """`_weight_int4pack_mm_for_cpu`'s product from its buffers: x [tokens, in] bf16, the weight
    packed in blocks of `rows` (INT4_BLOCK_ROWS; byte i of a block's column holds rows i and
    i + rows / 2) of an output width that is a multiple of `rows`, a group a multiple of
    INT4_GROUP_COLUMNS; [tokens, out] bf16."""
    return torch.ops.kvpilot.int4_mm(x.contiguous(), packed, group, scales_zeros, rows)


def int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`_weight_int8pack_mm`'s product: x [tokens, in] bf16, weight [out, in] int8, scales [out]
    bf16; [tokens, out] bf16."""
    return torch.ops.kvpilot.int8_mm(x, weight, scales)
