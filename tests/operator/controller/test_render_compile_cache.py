"""Issue 21: a CPU pod keeps its built C++ kernels and its compiled decode step on the model.cache
claim, so a new pod starts warm; without a claim they stay on the pod's /tmp emptyDir. A GPU pod
builds neither and gets no cache folder.

The plans are written out (render is a function of spec and plan; the planner's choice of
compile_decode is tests/operator/planning/test_cpu_plan.py's), and the engine's own `serve`
parser reads the rendered arguments.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from kvpilot.engine.cli import build_parser, engine_config_from_args
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render

MODEL = "SmolLM2-135M-Instruct"
HUB = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
PARSER = build_parser("serve")


def spec(model: dict[str, Any], **fields: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {"model": {"name": MODEL, **model}, "accelerator": {"type": "cpu", "profile": "zen5-2c"}, **fields}
    )


def cpu_plan(compile_decode: bool = True) -> Plan:
    return Plan(
        fits=True,
        reason="fits",
        model=MODEL,
        gpu="cpu",
        device_profile="zen5-2c",
        cpus=2,
        compile_decode=compile_decode,
        quantization="none",
        weight_bytes=270_000_000,
        checkpoint_bytes=270_000_000,
        kv_pool_bytes=64 << 20,
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        predicted_ttft_ms=100,
        predicted_tpot_ms=8,
        replicas=1,
        meets_slo=True,
        startup_budget_s=160,
    )


def pod(s: InferenceServiceSpec, p: Plan) -> dict[str, Any]:
    return render.deployment("chat", "ml", "uid", s, p)["spec"]["template"]["spec"]


def served_cache_dir(engine: dict[str, Any], compile_decode: bool = True) -> str | None:
    """The engine's compile_cache_dir as `kvpilot serve` reads the container's arguments."""
    assert engine["command"] == ["kvpilot", "serve"]
    config = engine_config_from_args(PARSER.parse_args(["serve", *engine["args"]]))
    assert config.compile_decode == compile_decode
    return config.compile_cache_dir


def test_with_a_cache_claim_the_compile_cache_is_a_writable_folder_of_it() -> None:
    rendered = pod(spec({"source": HUB, "cache": {"claimName": "models"}}), cpu_plan())
    engine = rendered["containers"][0]
    assert served_cache_dir(engine) == render.COMPILE_CACHE_MOUNT
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    # The folder alone, writable; the model files beside it stay read-only.
    assert mounts[render.COMPILE_CACHE_MOUNT] == {
        "name": render.MODEL_CACHE_VOLUME,
        "mountPath": render.COMPILE_CACHE_MOUNT,
        "subPath": render.COMPILE_CACHE_SUBPATH,
    }
    assert mounts[render.MODEL_CACHE_MOUNT]["readOnly"] is True
    assert not render.COMPILE_CACHE_MOUNT.startswith((render.MODEL_CACHE_MOUNT + "/", "/tmp/"))
    claims = [v for v in rendered["volumes"] if v["name"] == render.MODEL_CACHE_VOLUME]
    assert claims == [{"name": render.MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": "models"}}]
    # The folder is created as the engine's user before the engine starts, before the download too.
    init = rendered["initContainers"]
    assert [c["name"] for c in init] == [render.COMPILE_CACHE_CONTAINER, render.DOWNLOAD_CONTAINER]
    mkdir = init[0]
    assert mkdir["image"] == engine["image"]
    assert mkdir["volumeMounts"] == [{"name": render.MODEL_CACHE_VOLUME, "mountPath": render.MODEL_CACHE_MOUNT}]
    assert mkdir["command"][-1] == f"{render.MODEL_CACHE_MOUNT}/{render.COMPILE_CACHE_SUBPATH}"
    assert "runAsUser" not in mkdir["securityContext"] and rendered["securityContext"]["runAsUser"] == 1000
    assert mkdir["securityContext"]["readOnlyRootFilesystem"] is True
    # Limits equal to requests, as a Guaranteed pod's every container needs.
    assert mkdir["resources"]["requests"] == mkdir["resources"]["limits"]


def test_without_a_claim_the_compile_cache_stays_on_the_pods_tmp() -> None:
    for model in ({"source": HUB}, {}):
        rendered = pod(spec(model), cpu_plan())
        engine = rendered["containers"][0]
        assert served_cache_dir(engine) == render.COMPILE_CACHE_DIR
        assert render.COMPILE_CACHE_DIR.startswith("/tmp/")
        assert {"name": "tmp", "mountPath": "/tmp"} in engine["volumeMounts"]
        assert not any("subPath" in m for m in engine["volumeMounts"])
        assert render.COMPILE_CACHE_CONTAINER not in [c["name"] for c in rendered.get("initContainers", [])]


def test_a_cpu_pod_without_compiled_decoding_keeps_its_kernels_on_the_claim_too() -> None:
    # Every CPU engine builds its C++ kernels (engine/cpu/kernels.py): ~40 s a cold start.
    rendered = pod(spec({"source": HUB, "cache": {"claimName": "models"}}), cpu_plan(compile_decode=False))
    engine = rendered["containers"][0]
    assert served_cache_dir(engine, compile_decode=False) == render.COMPILE_CACHE_MOUNT
    assert [c["name"] for c in rendered["initContainers"]] == [
        render.COMPILE_CACHE_CONTAINER,
        render.DOWNLOAD_CONTAINER,
    ]
    assert any(m.get("subPath") == render.COMPILE_CACHE_SUBPATH for m in engine["volumeMounts"])


def test_a_gpu_pod_gets_no_cache_folder() -> None:
    gpu_spec = InferenceServiceSpec.model_validate(
        {"model": {"name": MODEL, "source": HUB, "cache": {"claimName": "models"}}, "accelerator": {"type": "L4"}}
    )
    gpu_plan = cpu_plan(compile_decode=False).model_copy(update={"gpu": "L4", "cpus": 0, "device_profile": None})
    rendered = pod(gpu_spec, gpu_plan)
    engine = rendered["containers"][0]
    assert "--compile-cache-dir" not in engine["args"]
    assert render.COMPILE_CACHE_CONTAINER not in [c["name"] for c in rendered["initContainers"]]
    assert not any("subPath" in m for m in engine["volumeMounts"])


def test_the_claim_is_mounted_for_the_compile_cache_when_no_download_uses_it() -> None:
    # The claim is for serving.draftModel's download; a plan that runs no draft downloads nothing.
    s = spec(
        {"source": "pvc://weights/smol", "cache": {"claimName": "models"}},
        serving={"draftModel": "hf://HuggingFaceTB/SmolLM2-135M"},
    )
    rendered = pod(s, cpu_plan())
    assert [c["name"] for c in rendered["initContainers"]] == [render.COMPILE_CACHE_CONTAINER]
    volumes = {v["name"]: v for v in rendered["volumes"]}
    assert volumes[render.MODEL_CACHE_VOLUME]["persistentVolumeClaim"] == {"claimName": "models"}
    assert volumes[render.MODEL_VOLUME]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    engine = rendered["containers"][0]
    assert served_cache_dir(engine) == render.COMPILE_CACHE_MOUNT
    assert render.MODEL_CACHE_MOUNT not in {m["mountPath"] for m in engine["volumeMounts"]}


def _run_mkdir(command: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    """The init container's command with the claim's mount path replaced by a local folder."""
    return subprocess.run([*command[:-1], str(folder)], capture_output=True, text=True, timeout=30, check=False)


def test_the_folder_step_creates_the_folder_and_never_blocks_the_pod(tmp_path: Path) -> None:
    mkdir = pod(spec({"source": HUB, "cache": {"claimName": "models"}}), cpu_plan())["initContainers"][0]
    folder = tmp_path / "claim" / render.COMPILE_CACHE_SUBPATH
    assert _run_mkdir(mkdir["command"], folder).returncode == 0 and folder.is_dir()
    assert _run_mkdir(mkdir["command"], folder).returncode == 0  # a later pod finds it there
    # A claim where the folder cannot be made (here a file is in the way; on a cluster, a root the
    # engine's user cannot write): the step says why and exits 0, so the engine still starts.
    (tmp_path / "file").write_text("")
    refused = _run_mkdir(mkdir["command"], tmp_path / "file" / render.COMPILE_CACHE_SUBPATH)
    assert refused.returncode == 0
    assert "builds its CPU kernels at every start" in refused.stderr


def test_a_cpu_pod_with_downloads_is_guaranteed_in_every_container() -> None:
    # Kubernetes counts init containers too: one with requests alone makes the pod Burstable, and
    # the static CPU manager then does not pin the engine's CPUs.
    rendered = pod(spec({"source": HUB, "cache": {"claimName": "models"}}), cpu_plan())
    containers = [*rendered["initContainers"], *rendered["containers"]]
    assert render.DOWNLOAD_CONTAINER in [c["name"] for c in containers]
    for container in containers:
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], container["name"]
        assert set(resources["requests"]) >= {"cpu", "memory"}, container["name"]
    # A GPU replica's download keeps requests alone (its pod is not Guaranteed anyway).
    gpu_spec = InferenceServiceSpec.model_validate(
        {"model": {"name": MODEL, "source": HUB}, "accelerator": {"type": "L4"}}
    )
    gpu_plan = cpu_plan(compile_decode=False).model_copy(update={"gpu": "L4", "cpus": 0, "device_profile": None})
    download = next(c for c in pod(gpu_spec, gpu_plan)["initContainers"] if c["name"] == render.DOWNLOAD_CONTAINER)
    assert "limits" not in download["resources"]
