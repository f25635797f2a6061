"""The CPU device profile: its schema (round trip, what it refuses), the host facts it reads, and
`kvpilot profile --quick` run as the installed command on this machine, its file read back the way
the operator reads it (torch-free)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpilot.engine.contract.device_profile import (
    PROFILE_VERSION,
    DeviceProfile,
    load_device_profile,
    parse_device_profile,
)
from kvpilot.engine.cpu.features import kernel_path, read_cpu_flags
from kvpilot.engine.profiling import measure
from kvpilot.engine.profiling.profile import cpu_flags, cpu_model, default_name, memory_bytes

KVPILOT = Path(sys.executable).parent / "kvpilot"


def _matmul(kernel: str, rates: list[tuple[int, float]]) -> dict[str, Any]:
    return {
        "kernel": kernel,
        "weight_shape": [2048, 2048],
        "points": [{"tokens": t, "flop_per_s": r} for t, r in rates],
    }


def _scheme(quantization: str, weight_bytes: int, batch_one: float) -> dict[str, Any]:
    return {
        "quantization": quantization,
        "weight_bytes": weight_bytes,
        "decode": [
            {"batch": 1, "context_tokens": 70.0, "seconds": batch_one},
            {"batch": 4, "context_tokens": 90.0, "seconds": batch_one * 1.6},
        ],
        "prefill": [{"tokens": 64, "seconds": 0.05}, {"tokens": 256, "seconds": 0.16}],
    }


def profile_data() -> dict[str, Any]:
    return {
        "version": 2,
        "name": "amd-epyc-2c",
        "cpu_model": "AMD EPYC",
        "cpu_flags": ["avx2", "avx512f", "avx512_bf16"],
        "torch_cpu_capability": "AVX512",
        "cores": 2,
        "memory_bytes": 24 << 30,
        "memory_bandwidth_bytes_per_s": 5.4e10,
        "memory_copy_bandwidth_bytes_per_s": 4.9e10,
        "matmul": {
            "fp32": _matmul("aten.linear", [(1, 4e10), (256, 2.1e11)]),
            "bf16": _matmul("aten.linear", [(1, 8e10), (256, 9.7e11)]),
            "int8": _matmul("aten._weight_int8pack_mm", [(1, 1.3e11)]),
            "int4": None,
        },
        "engine": {
            "model": "SmolLM2-135M-Instruct",
            "dtype": "bfloat16",
            "schemes": [_scheme("none", 269030272, 0.0118), _scheme("int4", 120000000, 0.0102)],
            "long_context": {"batch": 4, "context_tokens": 540.0, "seconds": 0.031},
        },
        "engine_skipped": None,
        "torch_version": "2.15.0",
        "threads": 2,
        "threads_source": "CPUs in this process's affinity mask",
        "load_average": [1.5, 1.6, 1.5],
        "quick": True,
        "measured_at": "2026-12-01T15:36:35.990635Z",
    }


def test_a_profile_round_trips_through_json() -> None:
    profile = DeviceProfile.model_validate(profile_data())
    again = parse_device_profile(profile.to_json(), "round trip")
    assert again == profile
    assert again.version == PROFILE_VERSION
    assert again.matmul.bf16.peak_flop_per_s == 9.7e11
    assert again.matmul.int4 is None and again.engine is not None
    with_w8a8 = profile_data()
    with_w8a8["matmul"]["w8a8"] = _matmul("torch._int_mm", [(1, 1.6e11), (64, 1.1e12)])
    assert parse_device_profile(json.dumps(with_w8a8), "w8a8").matmul.w8a8.peak_flop_per_s == 1.1e12
    assert again.engine.scheme("int4").decode[1].batch == 4
    assert again.engine.scheme("int8") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_bandwidth_bytes_per_s": -1.0}, "memory_bandwidth_bytes_per_s: Input should be greater than 0"),
        ({"version": 1}, "version: device profile version 1 is not one this build reads (2): measure it again"),
        ({"cpu_flags": ["avx2", "sse9"]}, "unknown CPU flags ['sse9']"),
        ({"cores": 0}, "cores: Input should be greater than or equal to 1"),
        ({"engine": None}, "exactly one of engine"),
        ({"engine_skipped": "no model"}, "exactly one of engine"),
        ({"measured_at": "2026-12-01T15:36:35"}, "measured_at: measured_at needs a time zone"),
        ({"bandwidth": 5e10}, "bandwidth: Extra inputs are not permitted"),
    ],
)
def test_nonsense_is_refused_with_the_field_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="device profile node-a.json is not valid") as err:
        parse_device_profile(json.dumps(profile_data() | change), "node-a.json")
    assert message in str(err.value)


def test_matmul_points_and_engine_steps_must_be_ordered() -> None:
    data = profile_data()
    data["matmul"]["fp32"]["points"].reverse()
    with pytest.raises(ValueError, match=r"matmul.fp32.points: points' tokens must strictly increase"):
        parse_device_profile(json.dumps(data), "f")
    data = profile_data()
    data["engine"]["schemes"][0]["decode"].reverse()
    with pytest.raises(ValueError, match=r"engine.schemes.0.decode: decode steps' batches must start at 1"):
        parse_device_profile(json.dumps(data), "f")
    data = profile_data()
    data["engine"]["schemes"][1]["prefill"].reverse()
    with pytest.raises(ValueError, match=r"engine.schemes.1.prefill: prefill steps' tokens must strictly increase"):
        parse_device_profile(json.dumps(data), "f")
    data = profile_data()
    data["engine"]["schemes"].reverse()
    with pytest.raises(ValueError, match=r"engine.schemes: schemes must start with 'none'"):
        parse_device_profile(json.dumps(data), "f")


def test_a_step_measured_faster_than_a_smaller_one_is_named() -> None:
    assert measure.falling_steps([(1, 0.020), (2, 0.0195), (4, 0.023)], "batch") == []  # within 5 %
    assert measure.falling_steps([(2, 0.017), (1, 0.020), (4, 0.023)], "batch") == [
        "batch 2 17.0 ms, below batch 1 20.0 ms"
    ]


def test_a_missing_or_broken_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read device profile .*missing.json"):
        load_device_profile(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="device profile .*broken.json is not valid: profile: Invalid JSON"):
        load_device_profile(tmp_path / "broken.json")


def test_host_facts_are_read_from_lscpu_cpuinfo_and_cgroups() -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 amx_bf16 avx512f\n"
    assert cpu_model(lscpu="Architecture: x86_64\nModel name:   AMD EPYC 9R14\n", cpuinfo=cpuinfo) == "AMD EPYC 9R14"
    assert cpu_model(lscpu="", cpuinfo=cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(lscpu="", cpuinfo="") == "unknown"
    assert cpu_flags(cpuinfo) == ("avx2", "avx512f", "amx_bf16")
    meminfo = "MemTotal:       24683584 kB\nMemFree: 1 kB\n"
    assert memory_bytes(meminfo, limits=("max\n", "")) == 24683584 * 1024
    assert memory_bytes(meminfo, limits=("4294967296\n", "")) == 4 << 30
    assert default_name("Intel(R) Xeon(R) Platinum 8480+", 8) == "intel-r-xeon-r-platinum-8480-8c"


def _lscpu_model() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the file `kvpilot profile --quick --compiled --output` wrote on this machine, its stderr)."""
    path = tmp_path_factory.mktemp("profile") / "this-machine.json"
    result = subprocess.run(
        [str(KVPILOT), "profile", "--quick", "--compiled", "--output", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # the JSON went to the file, the progress to stderr
    return path, result.stderr


def test_profile_quick_measures_this_machine(measured: tuple[Path, str]) -> None:
    path, stderr = measured
    profile = load_device_profile(path)
    assert profile.quick and profile.cores == len(os.sched_getaffinity(0))
    assert profile.cpu_model == _lscpu_model()
    assert 1e9 < profile.memory_bandwidth_bytes_per_s < 2e12
    assert 1e9 < profile.memory_copy_bandwidth_bytes_per_s < 2e12
    for scheme in ("fp32", "bf16", "int8", "int4", "w8a8"):
        matmul = getattr(profile.matmul, scheme)
        assert matmul is not None and len(matmul.points) == 3
        # Above 1e8 FLOP/s, and under 10 TFLOP/s per core (beyond any CPU's peak).
        assert 1e8 < matmul.peak_flop_per_s < 1e13 * profile.cores, scheme
    assert profile.engine is not None and profile.engine_skipped is None
    steps = profile.engine
    assert [s.quantization for s in steps.schemes] == ["none", "int8", "int4", "w8a8"]
    for scheme in steps.schemes:
        assert [s.batch for s in scheme.decode] == [1, 2]
        assert [s.tokens for s in scheme.prefill] == [32, 64]
        assert all(1e-4 < s.seconds < 5 for s in (*scheme.decode, *scheme.prefill))
        # Decode steps run past 64-token prompts.
        assert all(64 < s.context_tokens < 200 for s in scheme.decode)
    # Quantized weights are smaller than the dense ones.
    assert steps.scheme("int4").weight_bytes < steps.scheme("int8").weight_bytes < steps.schemes[0].weight_bytes
    assert steps.long_context.batch == 2 and steps.long_context.context_tokens > 1024
    assert profile.engine.compiled_step_s is not None and 1e-4 < profile.engine.compiled_step_s < 5
    # The compiled step is the none batch-1 step times the ratio timed side by side.
    ratio = re.search(r"ms eager in alternating rounds: x([0-9.]+)", stderr)
    assert ratio is not None, stderr
    expected = float(ratio.group(1)) * steps.schemes[0].decode[0].seconds
    assert profile.engine.compiled_step_s == pytest.approx(expected, rel=0.01)
    assert profile.memory_bytes <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # A progress line per measurement.
    assert "kvpilot profile: memory bandwidth" in stderr and stderr.count("kvpilot profile: engine steps,") == 4
    assert "engine decode step, batch 2 at" in stderr
    assert "engine decode step, batch 1, compiled" in stderr
    assert stderr.count("kvpilot profile: matmul") == 5
    # W8A8 is measured with this CPU's kernel path: the integer GEMM where it has one.
    path = kernel_path(read_cpu_flags())
    assert ("torch._int_mm" in profile.matmul.w8a8.kernel) == path.integer_kernels
    assert f"({path.name} kernel path)" in profile.matmul.w8a8.kernel


def test_the_operator_side_loads_it_without_torch(measured: tuple[Path, str]) -> None:
    path, _ = measured
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from kvpilot.engine.contract.device_profile import load_device_profile\n"
        "profile = load_device_profile(sys.argv[1])\n"
        "measure = 'kvpilot.engine.profiling.measure'\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'transformers' or m == measure]\n"
        "print(profile.name, profile.cores, profile.matmul.bf16.peak_flop_per_s)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    name, cores, bf16 = result.stdout.split()
    assert int(cores) == len(os.sched_getaffinity(0)) and float(bf16) > 1e8 and name


def test_profile_is_a_kvpilot_command() -> None:
    result = subprocess.run([str(KVPILOT), "profile", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--quick" in result.stdout and "--output" in result.stdout
    listed = subprocess.run([str(KVPILOT), "--help"], capture_output=True, text=True)
    assert "profile" in listed.stdout
