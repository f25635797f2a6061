"""How many CPU threads the engine may use: the cores it really has, not the host's.

In a pod, os.cpu_count() is the node's core count while the container gets a CFS quota
(`resources.limits.cpu`); more torch threads than the quota only makes them wait on each other
(an OpenMP thread descheduled by the quota holds up the others at every barrier: two threads
beside a busy process ran slower than one).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def quota_cpus(cpu_max: str | None) -> float | None:
    """CPUs granted by a cgroup v2 `cpu.max` line ("max 100000" or "150000 100000"); None if unlimited."""
    if not cpu_max:
        return None
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_cpus() -> float | None:
    v2 = quota_cpus(_read(_CGROUP_V2_CPU_MAX))
    if v2 is not None:
        return v2
    quota, period = _read(_CGROUP_V1_QUOTA), _read(_CGROUP_V1_PERIOD)
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def cpu_threads(
    affinity: int | None = None, quota: float | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """The thread count for torch and why: OMP_NUM_THREADS if set, else the CPUs this process may
    run on, capped by the cgroup quota (rounded up: a quota of 1.5 CPUs keeps two threads busy)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cpus = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = quota if quota is not None else _cgroup_cpus()
    if quota is not None and math.ceil(quota) < cpus:
        return max(1, math.ceil(quota)), f"cgroup quota of {quota:g} CPUs"
    return max(1, cpus), "CPUs in this process's affinity mask"
