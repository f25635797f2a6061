"""bench.serve_as: an engine started behind it sees the CPU without the hidden flags."""

from __future__ import annotations

import pytest

from bench import serve_as
from kvpilot.engine.cpu import features as cpu_features
from kvpilot.engine.worker import model_runner

ZEN5 = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni\n"


def test_hiding_drops_only_the_hidden_flags() -> None:
    read = serve_as.hiding(cpu_features.read_cpu_flags, frozenset({"avx512_bf16", "amx_bf16"}))
    flags = read(ZEN5)
    assert "avx512_bf16" not in flags and {"avx512_vnni", "avx512f"} <= flags
    assert cpu_features.kernel_path(flags).name == "vnni"


def test_install_reaches_the_model_runners_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda cpuinfo=None: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(model_runner, "read_cpu_flags", cpu_features.read_cpu_flags)
    serve_as.install(frozenset({"avx512_bf16"}))
    assert model_runner.read_cpu_flags() == frozenset({"avx2"})
    assert cpu_features.read_cpu_flags() == frozenset({"avx2"})
    assert cpu_features.choose_kernel_path("auto").name == "fp32"
