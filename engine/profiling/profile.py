"""`kvpilot profile`: measure the machine it runs on and write its device profile
(kvpilot.engine.contract.device_profile), with a progress line per measurement on stderr.

This module reads the host's facts (CPU model and flags, cores, memory) without torch, so that
`kvpilot --help` stays light; the measurements themselves (kvpilot.engine.profiling.measure) load torch when
the command runs. Torch uses as many threads as the engine would (kvpilot.engine.cpu.threads).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kvpilot.engine.cli import COMMANDS
from kvpilot.engine.contract.device_profile import CPU_FLAGS, DeviceProfile, Matmuls
from kvpilot.engine.cpu.features import read_cpu_flags
from kvpilot.engine.cpu.threads import cpu_threads

MiB = 1 << 20
_CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True)
class Sizes:
    buffer_bytes: int  # the bandwidth buffer: far larger than any cache
    matmul_shape: tuple[int, int]
    matmul_tokens: tuple[int, ...]
    min_seconds: float  # per timed figure
    engine_batches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    engine_steps: int  # timed steps per figure


# Default: about 1.5 minutes on 2 cores. Quick: a few seconds plus the model's loads, for tests.
FULL = Sizes(512 * MiB, (2048, 2048), (1, 8, 32, 128, 512), 0.25, (1, 2, 4, 8, 16), (32, 64, 128, 256, 512), 24)
QUICK = Sizes(128 * MiB, (1024, 1024), (1, 32, 256), 0.02, (1, 2), (32, 64), 4)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def cpu_model(lscpu: str | None = None, cpuinfo: str | None = None) -> str:
    """lscpu's "Model name", else /proc/cpuinfo's "model name" (lscpu also knows ARM parts)."""
    if lscpu is None:
        try:
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        except FileNotFoundError:
            lscpu = ""
    cpuinfo = _read(Path("/proc/cpuinfo")) if cpuinfo is None else cpuinfo
    for text, key in ((lscpu, "Model name"), (cpuinfo, "model name")):
        found = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if found:
            return found.group(1).strip()
    return "unknown"


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Those of CPU_FLAGS that /proc/cpuinfo's first "flags" line lists, in CPU_FLAGS' order."""
    present = read_cpu_flags(cpuinfo)
    return tuple(flag for flag in CPU_FLAGS if flag in present)


def memory_bytes(meminfo: str | None = None, limits: tuple[str, ...] | None = None) -> int:
    """MemTotal, capped by a cgroup memory limit ("max" or a byte count) where there is one."""
    meminfo = _read(Path("/proc/meminfo")) if meminfo is None else meminfo
    found = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.MULTILINE)
    total = int(found.group(1)) * 1024 if found else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = tuple(_read(p) for p in _CGROUP_MEMORY_LIMITS) if limits is None else limits
    return min([total, *(int(v) for v in (s.strip() for s in limits) if v.isdigit())])


def default_name(model: str, cores: int) -> str:
    """ "amd-epyc-2c" for an AMD EPYC with 2 usable cores."""
    return f"{re.sub(r'[^a-z0-9]+', '-', model.lower()).strip('-') or 'cpu'}-{cores}c"


def measure(sizes: Sizes, name: str | None, quick: bool, compiled: bool = False) -> DeviceProfile:
    """This machine's profile, measured now; progress on stderr."""
    import torch

    from kvpilot.engine.profiling import measure as m

    def progress(line: str) -> None:
        print(f"kvpilot profile: {line}", file=sys.stderr, flush=True)

    threads, threads_source = cpu_threads()
    torch.set_num_threads(threads)
    cores, model, load = len(os.sched_getaffinity(0)), cpu_model(), os.getloadavg()
    progress(f"{model}, {cores} CPUs, {threads} torch threads ({threads_source}), load {load[0]:.2f}")
    if load[0] > cores - threads + 0.5:
        # A thread of a parallel matmul that waits for a busy core stalls the others: rates come out low.
        progress("other processes are using these CPUs: the figures may be low; profile an idle machine")
    read, copy = m.memory_bandwidth(sizes.buffer_bytes, sizes.min_seconds)
    progress(
        f"memory bandwidth ({sizes.buffer_bytes // MiB} MiB): {read / 1e9:.1f} GB/s read, {copy / 1e9:.1f} GB/s copy"
    )
    matmuls = {}
    for scheme in m.SCHEMES:
        matmuls[scheme] = m.matmul_profile(scheme, sizes.matmul_shape, sizes.matmul_tokens, sizes.min_seconds)
        rates = ", ".join(f"{p.tokens} tok {p.flop_per_s / 1e9:.1f}" for p in matmuls[scheme].points)
        progress(f"matmul {scheme} {sizes.matmul_shape[0]}x{sizes.matmul_shape[1]}: {rates} GFLOP/s")
    skipped = m.embedded_model_problem()
    if skipped:
        progress(f"engine steps skipped: {skipped}")
    steps = (
        None
        if skipped
        else m.engine_steps(sizes.engine_batches, sizes.prefill_tokens, sizes.engine_steps, progress, compiled)
    )
    return DeviceProfile(
        name=name or default_name(model, cores),
        cpu_model=model,
        cpu_flags=cpu_flags(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cores=cores,
        memory_bytes=memory_bytes(),
        memory_bandwidth_bytes_per_s=read,
        memory_copy_bandwidth_bytes_per_s=copy,
        matmul=Matmuls(**matmuls),
        engine=steps,
        engine_skipped=skipped,
        torch_version=torch.__version__,
        threads=threads,
        threads_source=threads_source,
        load_average=load,
        quick=quick,
        measured_at=datetime.now(UTC),
    )


def _main(args: argparse.Namespace) -> int:
    profile = measure(QUICK if args.quick else FULL, args.name, args.quick, args.compiled)
    if args.output:
        Path(args.output).write_text(profile.to_json())
        print(f"kvpilot profile: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(profile.to_json())
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "profile",
        help=COMMANDS["profile"][1],
        description="Measure this machine (memory bandwidth, fp32/bf16/int8/int4/w8a8 matmul rates through the "
        "engine's kernels, the engine's decode and prefill steps on the embedded model with each scheme) "
        "and print its device profile as JSON. About 1.5 minutes on 2 cores; --quick: rough numbers, for tests.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: rough numbers, for tests")
    parser.add_argument("--output", help="write the JSON to this file instead of stdout")
    parser.add_argument("--name", help="the profile's name (default: from the CPU model and cores)")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also the batch-1 decode step with --compile-decode (its compile first: tens of seconds cold)",
    )
    parser.set_defaults(func=_main)
