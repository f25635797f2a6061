"""CPU facts the engine sizes itself by: threads from the cgroup quota (kernels from the flags: test_cpu_features)."""

from __future__ import annotations

from kvpilot.engine.cpu.threads import cpu_threads, quota_cpus


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
