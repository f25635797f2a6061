"""The engine pods of a service with spec.adapters: both runtimes get the plan's adapter slots under
vLLM's flag names (`--enable-lora --max-loras --max-lora-rank --max-cpu-loras`), vLLM its runtime LoRA
updating, and no adapter source on the command line (the operator loads adapters through the running
engines' API, so that adding one restarts no pod); the pod has each adapter's files where that load
looks for them. Our engine parses the flags with its own parser; vLLM's
parser checks them in test_vllm_contract.py."""

from __future__ import annotations

from itertools import product
from typing import Any

import pytest

from kvpilot.engine.cli import build_parser, engine_config_from_args
from kvpilot.operator.api.model_paths import source_path
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.plan import plan

ADAPTERS = [
    {"name": "sql", "source": "hf://org/sql-lora", "rank": 8},
    {"name": "support", "source": "pvc://adapters/support", "rank": 32},
    {"name": "legal", "source": "/adapters/legal"},
]
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras")


def _planned(runtime: str, adapters: list[dict[str, Any]], **sections: Any) -> tuple[InferenceServiceSpec, Plan]:
    spec = InferenceServiceSpec.model_validate(
        {
            "runtime": runtime,
            "model": {"name": "llama-3-8b", "source": "hf://meta-llama/Meta-Llama-3-8B-Instruct"},
            "accelerator": {"type": "L40S"},
            "adapters": adapters,
            **sections,
        }
    )
    result = plan(spec)
    assert result.fits, result.reason
    return spec, result


def _container(spec: InferenceServiceSpec, result: Plan) -> dict[str, Any]:
    return render.deployment("svc", "ns", "uid", spec, result)["spec"]["template"]["spec"]["containers"][0]


def _no_adapter_source(container: dict[str, Any]) -> None:
    rendered = " ".join(container["args"])
    assert not any(a["source"] in rendered or a["name"] in container["args"] for a in ADAPTERS), rendered


def test_vllm_gets_the_slots_and_runtime_lora_updating() -> None:
    spec, result = _planned("vllm", ADAPTERS)
    assert result.lora is not None
    container = _container(spec, result)
    assert container["args"][-4:] == ["--enable-lora", "--max-loras=4", "--max-lora-rank=32", "--max-cpu-loras=16"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]
    _no_adapter_source(container)
    # Without adapters: no LoRA flag, so the slots cost nothing.
    bare = _container(*_planned("vllm", []))
    assert not any(arg.startswith(LORA_FLAGS) for arg in bare["args"]), bare["args"]
    # Nor the variable: the pods of a service without adapters are as an older operator rendered them.
    assert all(e["name"] != "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in bare["env"])


def test_our_engine_parses_the_slots_with_its_own_parser() -> None:
    spec, result = _planned("kvpilot", ADAPTERS)
    container = _container(spec, result)
    assert container["command"] == ["kvpilot", "serve"]
    engine = engine_config_from_args(build_parser("serve").parse_args(["serve", *container["args"]]))
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 4, 32, 16)
    _no_adapter_source(container)
    bare = _container(*_planned("kvpilot", []))
    assert not any(arg in LORA_FLAGS for arg in bare["args"]), bare["args"]


@pytest.mark.parametrize("runtime", ["kvpilot", "vllm"])
def test_every_plan_with_adapters_renders_on_every_gpu(runtime: str) -> None:
    # Every GPU, each speculative choice the runtime runs beside adapters, one adapter and more than the
    # slots: a pod that renders (our engine's config accepts it) with the plan's slots.
    many = [{"name": f"a{i}", "source": f"/adapters/a{i}", "rank": 16} for i in range(9)]
    rendered = 0
    for gpu, speculative, adapters in product(GPUS, ("auto", "off", "ngram"), ([ADAPTERS[0]], many)):
        spec = InferenceServiceSpec.model_validate(
            {
                "runtime": runtime,
                "model": {"name": "llama-3.2-1b"},
                "accelerator": {"type": gpu},
                "serving": {"speculative": speculative},
                "adapters": adapters,
            }
        )
        result = plan(spec)
        if not result.fits:
            continue
        assert result.lora is not None
        args = " ".join(_container(spec, result)["args"])
        slots = str(result.lora.max_loras)
        assert f"--max-loras={slots}" in args or f"--max-loras {slots}" in args, args
        rendered += 1
    assert rendered >= len(GPUS) * 4


@pytest.mark.parametrize("runtime", ["vllm", "kvpilot"])
def test_the_pod_has_each_adapter_s_files_where_the_operator_loads_them_from(runtime: str) -> None:
    """An hf:// adapter is downloaded into the cache beside the model before the engine starts, a
    pvc:// one's claim is mounted read-only, a path in the image needs nothing; the engine container
    sees each at source_path, the path the adapter sync loads it from."""
    spec, result = _planned(runtime, ADAPTERS)
    pod = render.deployment("svc", "ns", "uid", spec, result)["spec"]["template"]["spec"]
    downloads = {c["name"]: c["args"] for c in pod["initContainers"] if c["command"] == ["kvpilot", "download"]}
    assert downloads["download-adapter-0"][0] == "org/sql-lora"
    assert source_path(ADAPTERS[0]["source"]) in downloads["download-adapter-0"]
    assert len(downloads) == 2  # the model's and the hf:// adapter's
    claims = {
        v["persistentVolumeClaim"]["claimName"]: v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    }
    assert claims == {"adapters": "adapter-1"}
    (engine,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    for adapter in ADAPTERS[:2]:
        path = source_path(adapter["source"])
        assert any(path.startswith(mount) and m["readOnly"] for mount, m in mounts.items()), (path, mounts)
    # The cache the downloads fill is sized for the adapter too (at most one slot's bytes).
    bare_spec, bare = _planned(runtime, ADAPTERS[1:])
    with_hf, without = render.download_disk_bytes(spec, result)[0], render.download_disk_bytes(bare_spec, bare)[0]
    assert with_hf > without


@pytest.mark.parametrize("runtime", ["vllm", "kvpilot"])
def test_adding_or_removing_an_adapter_in_the_image_or_a_mounted_claim_rolls_no_pod(runtime: str) -> None:
    """The adapters are loaded through the running engines' API: the pod template (flags, volumes,
    init containers) stays as it is while adapters come and go within max_lora_rank and the cached
    count, so the Deployment rolls no pod."""
    one = ADAPTERS[1:2]  # pvc://adapters/support, rank 32
    more = [
        *one,
        {"name": "legal", "source": "/adapters/legal", "rank": 8},
        {"name": "ops", "source": "pvc://adapters/ops"},
    ]
    templates = [
        render.deployment("svc", "ns", "uid", *_planned(runtime, adapters))["spec"]["template"]
        for adapters in (one, more, more[:2])
    ]
    assert templates[0] == templates[1] == templates[2]


@pytest.mark.parametrize("runtime", ["vllm", "kvpilot"])
def test_a_pod_with_adapters_waits_for_them_before_it_is_ready(runtime: str) -> None:
    """The readiness gate the adapter sync sets (a pod started later is out of the Service until
    it holds the adapters); a service without adapters has none, or no one would ever set it."""
    with_adapters = render.deployment("svc", "ns", "uid", *_planned(runtime, ADAPTERS[:1]))
    without = render.deployment("svc", "ns", "uid", *_planned(runtime, []))
    gates = with_adapters["spec"]["template"]["spec"]["readinessGates"]
    assert gates == [{"conditionType": "kvpilot.dev/adapters-loaded"}]
    assert "readinessGates" not in without["spec"]["template"]["spec"]
