"""bench.plan_accuracy's pure parts: the rate of a planned batch, the argv it serves, the prompts, and in
GPU mode the catalog GPU nvidia-smi names, its spec, plan and served argv (no GPU needed)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import plan_accuracy as pa
from kvpilot.engine.cli import build_parser, engine_config_from_args, server_config_from_args
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.planning import cpus
from kvpilot.operator.planning.device import MiB
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.plan import PlanContext, plan

BUILTIN = cpus.builtin_profiles()["amd-epyc-zen5-2c"]


def planned(scheme: str = "none", mode: str = "off") -> Callable[[float], Plan]:
    def at(rate: float) -> Plan:
        spec = pa.make_spec(scheme, mode, rate, 108, 48, (2000, 100))
        return plan(spec, PlanContext(device_profiles={pa.PROFILE_NAME: BUILTIN}))

    return at


# int4/ngram at 6 too: before the planner counted the engine's acceptance window, verifications of k + 1
# rows in every step made the planned batch fall as the rate rose near SPECULATION_MAX_BATCH, and a
# bisection found a rate but not the least one.
@pytest.mark.parametrize(
    "scheme, mode, target",
    [(scheme, mode, target) for scheme, mode in (("none", "off"), ("int4", "ngram")) for target in (1.0, 3.0, 6.0)],
)
def test_the_rate_found_plans_the_target_batch(scheme: str, mode: str, target: float) -> None:
    at = planned(scheme, mode)
    rate = pa.rate_for_batch(at, target)
    found = at(rate)
    assert found.fits and found.replicas == 1
    # Three significant digits of the rate: the batch within a percent or two of the target.
    assert found.predicted_batch == pytest.approx(target, rel=0.02)
    assert at(rate * 0.9).predicted_batch < target


def test_a_rate_the_replica_cannot_keep_up_with_is_not_taken_for_a_small_batch() -> None:
    at = planned()
    # Far beyond what one replica keeps up with, the plan has no latencies (batch 0): the
    # bisection must treat that as too high, not as a batch below the target.
    assert at(64).predicted_tpot_ms == 0
    rate = pa.rate_for_batch(at, 2.0)
    assert 0 < rate < 64 and at(rate).predicted_tpot_ms > 0


def test_the_served_argv_is_the_plans_with_host_and_port_replaced() -> None:
    at = planned("int4", "ngram")
    found = at(1.0)
    spec = pa.make_spec("int4", "ngram", 1.0, 108, 48, (2000, 100))
    argv = pa.served_argv(spec, found, 4321)
    args = argv[argv.index("serve") + 1 :]
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "4321"
    for flag, value in (
        ("--quantization", "int4"),
        ("--speculative", "ngram"),
        ("--max-num-seqs", str(found.max_num_seqs)),
        ("--kv-cache-memory-bytes", str(found.kv_pool_bytes)),
        ("--device", "cpu"),
    ):
        assert args[args.index(flag) + 1] == value


def test_ratios_and_the_goal() -> None:
    row = pa.ratio_row(20.0, 26.0)
    assert row["ratio"] == pytest.approx(1.3) and row["error_pct"] == pytest.approx(30.0)
    assert pa.within_goal(1.25) and pa.within_goal(0.75) and not pa.within_goal(1.3)


def test_prompts_have_one_length_and_share_no_first_block() -> None:
    prompts = pa.fixed_length_prompts(40)
    assert len({len(p) for p in prompts}) == 1 and len(prompts[0]) > 64
    # The prefix cache hashes 16-token blocks chained from the first: distinct first blocks, no hits.
    assert len({tuple(p[:16]) for p in prompts}) == 40


# GPU mode: a catalog GPU planned from its spec sheet, served with the rendered argv as it is.


def test_the_cpu_stays_the_default() -> None:
    args = pa.build_parser().parse_args([])
    assert args.accelerator == "cpu" and args.threads == 1 and args.schemes == "none,int4"
    spec = pa.make_spec("none", "off", 1.0, 108, 48, (2000, 100))
    assert spec.accelerator.type == "cpu" and spec.accelerator.profile == pa.PROFILE_NAME


@pytest.mark.parametrize(
    "detected, catalog",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla T4", "T4"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_auto_maps_nvidia_smis_name_to_the_catalog(detected: str, catalog: str) -> None:
    assert pa.catalog_gpu("auto", detected) == catalog
    # A name given matches the GPU found whatever its case.
    assert pa.catalog_gpu(catalog.lower(), detected) == catalog


def test_a_gpu_the_catalog_lacks_or_another_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="'NVIDIA H100 PCIe', which the planner's catalog lacks"):
        pa.catalog_gpu("auto", "NVIDIA H100 PCIe")
    # Named, a GPU the catalog lacks is planned as the name says ...
    assert pa.catalog_gpu("H100-80GB", "NVIDIA H100 PCIe") == "H100-80GB"
    # ... but never as another catalog GPU than the one found, nor as a name the catalog lacks.
    with pytest.raises(ValueError, match="this machine's GPU is 'NVIDIA H200' \\(H200 in the catalog\\)"):
        pa.catalog_gpu("H100-80GB", "NVIDIA H200")
    with pytest.raises(ValueError, match="'H300': not cpu, auto or a catalog GPU"):
        pa.catalog_gpu("H300", "NVIDIA H200")


def gpu_plan(gpu: str, scheme: str, mode: str) -> Callable[[float], Plan]:
    def at(rate: float) -> Plan:
        return pa.plan_for(pa.make_spec(scheme, mode, rate, 108, 48, (2000, 100), gpu), None)

    return at


@pytest.mark.parametrize("gpu", ["H200", "H100-80GB", "T4"])
@pytest.mark.parametrize("scheme, mode", [("none", "off"), ("int8", "ngram")])
def test_a_gpu_case_is_one_catalog_gpu_served_with_the_rendered_argv(gpu: str, scheme: str, mode: str) -> None:
    spec = pa.make_spec(scheme, mode, 1.0, 108, 48, (2000, 100), gpu)
    assert spec.accelerator.type == gpu and spec.accelerator.count == 1 and spec.accelerator.profile is None
    assert spec.runtime == "kvpilot"
    rate = pa.rate_for_batch(gpu_plan(gpu, scheme, mode), 3.0)
    spec = pa.make_spec(scheme, mode, rate, 108, 48, (2000, 100), gpu)
    found = pa.plan_for(spec, None)
    assert found.fits and found.gpu == gpu and found.gpu_count == 1 and found.replicas == 1
    assert (found.quantization, found.speculative) == (scheme, mode)
    argv = pa.served_argv(spec, found, 4321)
    parsed = build_parser("serve").parse_args(argv[argv.index("serve") :])
    engine, server = engine_config_from_args(parsed), server_config_from_args(parsed)
    assert (server.host, server.port) == ("127.0.0.1", 4321)
    assert engine.quantization == scheme and engine.speculative == mode
    assert engine.max_num_seqs == found.max_num_seqs and engine.max_num_batched_tokens == found.max_num_batched_tokens
    # Served as a pod on a whole GPU: CUDA by `device: auto`, the KV pool what the engine's profiling
    # step leaves within the utilization of the device's memory (no CPU pool size, no CPU threads).
    assert engine.device == "auto" and engine.kv_cache_memory_bytes is None and engine.cpu_kernels == "auto"
    assert engine.gpu_memory_utilization == found.gpu_memory_utilization == 0.9
    assert engine.dtype == ("float16" if gpu == "T4" else "auto")
    assert "--threads" not in argv and "--device" not in argv
    # What the plan sizes fits the share of the catalog's memory the engine will take.
    assert found.weight_bytes + found.kv_pool_bytes <= 0.9 * GPUS[gpu].memory_bytes


def test_a_gpus_planned_batches_need_rates_far_above_a_cpus() -> None:
    # The planner's H200 steps for the 135M model are about 2 ms (mostly the step's fixed cost):
    # batch 8 is tens of requests/s beyond the 64 req/s a CPU's bisection starts from, so the
    # bisection first doubles its bracket.
    at = gpu_plan("H200", "none", "off")
    rate = pa.rate_for_batch(at, 8.0)
    assert rate > 64
    assert at(rate).predicted_batch == pytest.approx(8.0, rel=0.02)
    assert at(rate * 0.9).predicted_batch < 8.0


def test_the_table_says_which_device_with_a_gpus_small_predictions_legible() -> None:
    def row(predicted: float, observed: float) -> dict[str, float]:
        return pa.ratio_row(predicted, observed)

    record = {
        "accelerator": "H200",
        "scheme": "int8",
        "speculative": "ngram",
        "rate": 386.0,
        "predicted": {"batch": 3.0},
        "observed": {"running_batch_mean": 40.0, "draft_acceptance": 0.25},
        "ttft_p95": row(0.31, 40.0),
        "tpot_p95": row(0.21, 12.5),
        "tpot_mean": row(0.21, 11.0),
        "load_average_start": (0.5, 0.5, 0.5),
        "load_average_end": (0.6, 0.5, 0.5),
        "others_cores": 0.01,
    }
    cpu = {
        **record,
        "accelerator": "cpu",
        "ttft_p95": row(310.0, 400.0),
        "tpot_p95": row(25.0, 30.0),
        "lone_tpot": row(18.0, 22.5),
    }
    lines = pa.markdown_table([record, cpu]).splitlines()
    assert lines[0].startswith("| device | scheme |")
    assert len(lines[0].split("|")) == len(lines[1].split("|")) == len(lines[2].split("|"))
    assert lines[2].startswith("| H200 | int8 | ngram | 386 |")
    assert "| 0.31 / 40.00 | 129.03 |" in lines[2] and "| 0.21 / 12.50 | 59.52 |" in lines[2]
    # A CPU's cells as before: whole milliseconds of TTFT, tenths of TPOT.
    assert "| 310 / 400 | 1.29 | +29 % |" in lines[3] and "| 25.0 / 30.0 | 1.20 | +20 % |" in lines[3]
    # The lone request's probe of the machine's speed, where the run recorded one.
    assert lines[3].endswith("| 18.0 / 22.5 | 1.25 |") and lines[2].endswith("| - | - | - | - |")


def test_without_nvidia_smi_gpu_mode_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    args = pa.build_parser().parse_args(["--accelerator", "auto"])
    with pytest.raises(ValueError, match="no NVIDIA GPU to measure on"):
        pa.device(args, tmp_path)
    args = pa.build_parser().parse_args(["--accelerator", "H200", "--profile", "p.json"])
    with pytest.raises(ValueError, match="--profile is a CPU's"):
        pa.device(args, tmp_path)


def test_nvidia_smi_is_read_for_the_gpu_the_engines_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: an nvidia-smi that prints what the real one prints for these queries (csv,
    # noheader, nounits) and records its arguments.
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/args\n'
        'case "$*" in\n'
        '  *memory.used*) echo "60000" ;;\n'
        '  *) echo "NVIDIA H200, 143771, 570.86.15" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    name, profile, described = pa.device(pa.build_parser().parse_args(["--accelerator", "auto"]), tmp_path)
    assert (name, profile) == ("H200", None)
    assert described["accelerator"]["nvidia_smi"] == {
        "name": "NVIDIA H200",
        "memory_total_mib": 143771.0,
        "driver": "570.86.15",
    }
    assert (tmp_path / "args").read_text().split()[:2] == ["--id", "3"]
    # With the engine ready the GPU holds its KV pool; 60000 MiB is under half of H200's planned pool.
    found = gpu_plan("H200", "none", "off")(100.0)
    assert found.kv_pool_bytes / MiB > 2 * 60000
    with pytest.raises(RuntimeError, match="the engine is not serving from the GPU"):
        pa.gpu_memory_in_use(found)
    assert pa.gpu_memory_in_use(gpu_plan("L4", "none", "off")(10.0)) == 60000.0


def test_a_speculating_case_is_predicted_again_with_the_acceptance_its_engine_reported(tmp_path: Path) -> None:
    settings = pa.Settings("cpu", 1, 108, 48, (2000, 100), 8, 64, 0, 1.0, 20.0, tmp_path)
    assumed = planned("int4", "ngram")(1.0)

    def record(mode: str, acceptance: float | None) -> dict:
        found = {"speculative": mode, "scheme": "int4", "rate": 1.0, "accelerator": "cpu"}
        return found | {"observed": {"draft_acceptance": acceptance, "tpot_ms": {"p95": 30.0}}}

    rejected, kept = record("ngram", 0.0), record("ngram", 0.8)
    for found in (rejected, kept):
        pa.with_observed_acceptance(found, BUILTIN, settings)
    # Drafts never kept: slower than the 0.29 assumed; mostly kept: faster. Ratios against the p95 seen.
    assert rejected["replanned"]["tpot_ms"] > assumed.predicted_tpot_ms > kept["replanned"]["tpot_ms"]
    assert rejected["tpot_p95_replanned"]["ratio"] == pytest.approx(30.0 / rejected["replanned"]["tpot_ms"])
    for nothing_to_replan in (record("off", None), record("ngram", None)):
        pa.with_observed_acceptance(nothing_to_replan, BUILTIN, settings)
        assert "replanned" not in nothing_to_replan
