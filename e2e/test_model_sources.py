"""A pvc:// model, or one baked into the engine image, that the spec and the catalog do not describe
(or such a draft model), on the real control plane: the operator runs an inspection Job that mounts
the claim, or the image as an image volume (controller/inspection.py), plans from what its pod
reports, and rolls out.

kwok runs no containers: its stages complete a Job's pod by themselves (pod-ready, then pod-complete:
phase Succeeded, exit code 0, no message; kwok v0.8 kustomize/stage/pod/fast). So the test plays the
rest of the kubelet: it runs the same `kvpilot inspect-checkpoint` here on a folder standing for the
claim (or the image; e2e/test_images.py runs the Job's container on a real image volume), and writes
its result into the ended container's termination message, as the kubelet does
from /dev/termination-log."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from kvpilot.operator.api.inspection import CheckpointInspection
from kvpilot.operator.controller import inspection

ApplyISVC = Callable[[str, dict[str, Any]], dict[str, Any]]
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "operator" / "planning" / "hf_configs"
CONFIG = CONFIGS / "Qwen--Qwen3-8B.json"
# The weights' bytes the checkpoint's safetensors index states (about Qwen3-8B's in bf16).
TOTAL_SIZE = 16_381_470_720
CONVERGE_S = 60.0


@pytest.fixture()
def claim(k8s: Cluster, kvpilot: Installation, request: pytest.FixtureRequest) -> Iterator[str]:
    """A claim bound to a volume of its own (no provisioner here), so that both the Job's pod and the
    engine's schedule; kwok mounts nothing."""
    ns = kvpilot.watch_namespaces[0]
    # A claim of its own per test: the one before is still being deleted (its pods end after it).
    claim = "models-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:8]
    volume = f"{ns}-{claim}"
    k8s.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "20Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": "/models"},
                "claimRef": {"namespace": ns, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "20Gi"}},
            },
        },
    )
    yield claim
    k8s.kubectl("delete", "pvc", claim, "-n", ns, "--ignore-not-found", "--wait=false")
    k8s.kubectl("delete", "pv", volume, "--ignore-not-found", "--wait=false")


def _inspected_here(tmp_path: Path, config: Path) -> str:
    """What the Job's container reports for the checkpoint: `kvpilot inspect-checkpoint` run on a
    folder holding `config` (a config.json) and a safetensors index."""
    folder = tmp_path / config.stem
    folder.mkdir()
    shutil.copy(config, folder / "config.json")
    index = {"metadata": {"total_size": TOTAL_SIZE}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    log = tmp_path / "termination-log"
    command = [sys.executable, "-m", "kvpilot.engine.cli", "inspect-checkpoint", str(folder), "--termination-log"]
    subprocess.run([*command, str(log)], check=True, cwd=ROOT, capture_output=True, text=True)
    return log.read_text()


def _job_pod(k8s: Cluster, ns: str, job: str) -> dict[str, Any]:
    """The Job's pod once kwok has ended it (Succeeded)."""

    def ended() -> dict[str, Any] | None:
        pods = k8s.kubectl_json("get", "pods", "-n", ns, "-l", f"{inspection.JOB_NAME_LABEL}={job}")["items"]
        return next((p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"), None)

    return poll(ended, CONVERGE_S, f"the pod of Job {ns}/{job} Succeeded")


def _report(k8s: Cluster, ns: str, job: str, tmp_path: Path, config: Path = CONFIG) -> str:
    """Write what the Job's container reports for `config` into its ended pod's termination message
    (kwok ended it without one), as the kubelet would have read it; the result."""
    pod = _job_pod(k8s, ns, job)
    result = _inspected_here(tmp_path, config)
    patch = [{"op": "add", "path": "/status/containerStatuses/0/state/terminated/message", "value": result}]
    k8s.kubectl(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=json",
        "-p",
        json.dumps(patch),
    )
    return result


def test_a_pvc_model_is_planned_from_the_config_json_its_inspection_job_reports(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: ApplyISVC,
    claim: str,
    tmp_path: Path,
) -> None:
    ns, name, source = kvpilot.watch_namespaces[0], "pvc-qwen3", f"pvc://{claim}/qwen3-8b"
    # vLLM: our engine loads Llama-family classes only, and Qwen3 is refused for it (UnsupportedByRuntime).
    spec = {"model": {"name": "my-qwen3", "source": source}, "runtime": "vllm", "accelerator": {"type": "L4"}}
    apply_isvc(name, {**spec, "replicas": 1})
    pending = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S)
    job = inspection.job_name(name, pending["metadata"]["uid"], source)
    assert kvis.condition(pending, "Planned")["reason"] in ("ModelConfigPending", "ModelConfigUnavailable")

    manifest = k8s.kubectl_json("get", "job", job, "-n", ns)
    (owner,) = manifest["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", pending["metadata"]["uid"], True)
    pod_spec = manifest["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["args"] == [f"/models/{claim}/qwen3-8b"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in pod_spec["volumes"]

    result = _report(k8s, ns, job, tmp_path)
    ready = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    inspected = ready["status"]["inspectedCheckpoint"]
    assert inspected["source"] == source
    recorded = CheckpointInspection.model_validate({k: v for k, v in inspected.items() if k != "source"})
    assert recorded == CheckpointInspection.model_validate_json(result)
    assert inspected["architecture"]["checkpointBytes"] == TOTAL_SIZE
    assert ready["status"]["plan"]["reasons"]["model"].startswith("the checkpoint's config.json of /")
    (engine,) = kvis.running_pods(k8s, ns, name)
    assert {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in engine["spec"][
        "volumes"
    ]
    # Read once: no second Job or pod for the same source.
    pods = k8s.kubectl_json("get", "pods", "-n", ns, "-l", f"{inspection.JOB_NAME_LABEL}={job}")["items"]
    assert len(pods) == 1

    # Another source is another checkpoint: a new Job, the running Deployment kept meanwhile.
    other = f"pvc://{claim}/other"
    kvis.patch_spec(k8s, ns, name, {"model": {"name": "my-qwen3", "source": other}})
    replanned = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S, generation=2)
    assert "inspectedCheckpoint" not in replanned["status"]
    poll(
        lambda: (
            k8s.kubectl(
                "get", "job", inspection.job_name(name, pending["metadata"]["uid"], other), "-n", ns, check=False
            ).returncode
            == 0
        ),
        CONVERGE_S,
        "the new source's inspection Job",
    )


def test_a_model_baked_into_the_engine_image_is_planned_from_that_image(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: ApplyISVC, tmp_path: Path
) -> None:
    ns, name = kvpilot.watch_namespaces[0], "baked-qwen3"
    image, path = "registry.example/vllm-qwen3:1", "/srv/models/qwen3-8b"
    spec = {"model": {"name": "my-qwen3", "source": path}, "runtime": "vllm", "image": image}
    apply_isvc(name, {**spec, "accelerator": {"type": "L4"}, "replicas": 1})
    pending = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S)
    key = f"{path} in {image}"
    job = inspection.job_name(name, pending["metadata"]["uid"], key)

    # The API server keeps the image volume (on by default from 1.35) as the operator rendered it.
    pod_spec = k8s.kubectl_json("get", "job", job, "-n", ns)["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["args"] == [f"/inspected-image{path}"]
    assert {"name": "model", "image": {"reference": image, "pullPolicy": "IfNotPresent"}} in pod_spec["volumes"]

    _report(k8s, ns, job, tmp_path)
    ready = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    assert ready["status"]["inspectedCheckpoint"]["source"] == key
    assert ready["status"]["inspectedCheckpoint"]["architecture"]["checkpointBytes"] == TOTAL_SIZE
    (engine,) = kvis.running_pods(k8s, ns, name)
    assert engine["spec"]["containers"][0]["image"] == image

    # Another image may bake other files at the same path: read afresh.
    kvis.patch_spec(k8s, ns, name, {"image": "registry.example/vllm-qwen3:2"})
    replanned = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S, generation=2)
    assert "inspectedCheckpoint" not in replanned["status"]
    moved = inspection.job_name(name, pending["metadata"]["uid"], f"{path} in registry.example/vllm-qwen3:2")
    poll(
        lambda: k8s.kubectl("get", "job", moved, "-n", ns, check=False).returncode == 0,
        CONVERGE_S,
        "the new image's inspection Job",
    )


def test_a_draft_model_on_a_claim_is_planned_from_the_config_json_its_own_job_reports(
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    apply_isvc: ApplyISVC,
    claim: str,
    tmp_path: Path,
) -> None:
    ns, name, draft = kvpilot.watch_namespaces[0], "drafted-llama", f"pvc://{claim}/llama-3.2-3b"
    serving = {"speculative": "draft", "draftModel": draft}
    apply_isvc(
        name,
        {
            "model": {"name": "llama-3-8b"},
            "runtime": "vllm",
            "accelerator": {"type": "H100-80GB", "count": 1},
            "serving": serving,
            "replicas": 1,
        },
    )
    pending = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=CONVERGE_S)
    assert kvis.condition(pending, "Planned")["message"].startswith("serving.draftModel: ")
    job = inspection.job_name(name, pending["metadata"]["uid"], draft)
    pod_spec = k8s.kubectl_json("get", "job", job, "-n", ns)["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["args"] == [f"/models/{claim}/llama-3.2-3b"]

    _report(k8s, ns, job, tmp_path, CONFIGS / "meta-llama--Llama-3.2-3B.json")
    ready = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=CONVERGE_S)
    # The real API server keeps the draft's record and the plan's copy (the CRD's schema has both).
    status = ready["status"]
    assert status["inspectedDraftCheckpoint"]["source"] == draft and "inspectedCheckpoint" not in status
    assert status["inspectedDraftCheckpoint"]["architecture"]["checkpointBytes"] == TOTAL_SIZE
    assert status["lastGoodPlan"]["draftCheckpoint"]["architecture"]["layers"] == 28
    assert status["plan"]["speculative"] == "draft"
    (engine,) = kvis.running_pods(k8s, ns, name)
    args = engine["spec"]["containers"][0]["args"]
    speculative = json.loads(next(a for a in args if a.startswith("--speculative-config=")).partition("=")[2])
    assert speculative["model"] == f"/models/{claim}/llama-3.2-3b"
