"""CPU facts the engine sizes itself by: threads from the cgroup quota, bf16 from the CPU flags."""

from __future__ import annotations

from kvpilot.engine.config import cpu_has_native_bf16
from kvpilot.engine.worker.cpu import cpu_threads, quota_cpus


def test_cgroup_v2_quota_is_read():
    assert quota_cpus("max 100000\n") is None
    assert quota_cpus("150000 100000\n") == 1.5
    assert quota_cpus("") is None


def test_threads_follow_the_quota_not_the_host():
    assert cpu_threads(affinity=64, quota=2.0, env={}) == (2, "cgroup quota of 2 CPUs")
    assert cpu_threads(affinity=64, quota=1.5, env={})[0] == 2  # a fractional quota keeps the next thread busy
    assert cpu_threads(affinity=64, quota=0.5, env={})[0] == 1
    assert cpu_threads(affinity=4, quota=None, env={}) == (4, "CPUs in this process's affinity mask")
    assert cpu_threads(affinity=4, quota=16.0, env={})[0] == 4
    assert cpu_threads(affinity=64, quota=2.0, env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")


def test_native_bf16_from_cpu_flags():
    assert cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_has_native_bf16("flags\t: fpu amx_bf16 amx_tile\n")
    assert not cpu_has_native_bf16("flags\t: fpu sse avx2 avx512f\n")
    assert not cpu_has_native_bf16("")
