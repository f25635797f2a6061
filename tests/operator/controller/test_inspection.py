"""A pvc:// model, or one at a path in the engine image, that the spec and the catalog do not describe:
its architecture is read from the claim (or the image, mounted as an image volume) by an inspection
Job (controller/inspection.py), whose pod reports it in its termination message."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.inspection import CheckpointInspection
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.controller import inspection, render
from kvpilot.operator.controller.checkpoint import inspect_folder
from kvpilot.operator.controller.handlers import pod_handler
from kvpilot.operator.controller.reconcile import reconcile, retry_reason
from tests.operator.controller.test_reconcile import NOW, FakeCluster, Operator, body, condition

CONFIGS = Path(__file__).parents[1] / "planning" / "hf_configs"
SOURCE = "pvc://models/llama-3.1-8b"
SPEC = {"model": {"name": "my-llama", "source": SOURCE}, "accelerator": {"type": "A100-80GB"}}
IMAGE = "registry.example/kvpilot:1.2.3"


def job_name(source: str = SOURCE) -> str:
    return inspection.job_name("chat", "uid-1", source)


def reported(tmp_path: Path) -> str:
    """What `kvpilot inspect-checkpoint` writes for Llama 3.1 8B's config.json (a folder standing for the claim)."""
    folder = tmp_path / "llama-3.1-8b"
    folder.mkdir()
    shutil.copy(CONFIGS / "meta-llama--Meta-Llama-3.1-8B.json", folder / "config.json")
    found = inspect_folder(folder)
    assert isinstance(found, CheckpointInspection)
    return found.message()


def job_pod(cluster: FakeCluster, exit_code: int, message: str, name: str = "") -> None:
    """The Job's pod, ended as the kubelet reports it."""
    job = cluster.objects[("Job", "ml", name or job_name())]
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{job['metadata']['name']}-x1",
                "namespace": "ml",
                "creationTimestamp": "2025-01-01T00:00:00Z",
                "labels": {
                    **job["spec"]["template"]["metadata"]["labels"],
                    inspection.JOB_NAME_LABEL: name or job_name(),
                },
            },
            "status": {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "containerStatuses": [
                    {"name": "inspect", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
                ],
            },
        }
    )


def test_the_job_reads_the_claim_read_only_as_the_engine_would_and_unprivileged() -> None:
    spec = InferenceServiceSpec.model_validate({**SPEC, "imagePullSecrets": [{"name": "pull"}]})
    job = inspection.job("chat", "ml", "uid-1", spec, inspection.Inspected(SOURCE), IMAGE)
    assert job["metadata"]["name"] == job_name() and len(job_name()) <= 63
    assert job["metadata"]["ownerReferences"] == [names.owner_reference("chat", "uid-1")]
    assert job["metadata"]["labels"][names.INSTANCE_LABEL] == "chat"
    # Not an engine pod: neither the Service nor the NetworkPolicy's engine selector takes it.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert not names.selector_labels("chat").items() <= labels.items()
    assert labels.items() >= names.MANAGED_BY.items()  # its pod's events wake the reconcile
    assert {k: job["spec"][k] for k in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished")} == {
        "backoffLimit": 1,
        "activeDeadlineSeconds": 600,
        "ttlSecondsAfterFinished": 300,
    }
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    command = [*container["command"], *container["args"]]
    assert command == ["kvpilot", "inspect-checkpoint", "/models/models/llama-3.1-8b"]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["securityContext"] == render.container_security()
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "512Mi"}
    assert {"name": "model", "mountPath": "/models/models", "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["imagePullSecrets"] == [{"name": "pull"}]
    # The same mount as the engine pod's.
    deployment = render.deployment("chat", "ml", "uid-1", spec, _fitting_plan(spec))
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "model", "mountPath": "/models/models", "readOnly": True} in engine["volumeMounts"]


def _fitting_plan(spec: InferenceServiceSpec) -> Any:
    from kvpilot.operator.planning.plan import plan

    return plan(spec.model_copy(update={"model": spec.model.model_copy(update={"name": "llama-2-7b"})}))


def test_a_long_service_name_still_makes_a_label_value() -> None:
    name = inspection.job_name("a" * 63, "uid-1", SOURCE)
    assert len(name) <= 63 and name != inspection.job_name("a" * 63, "uid-2", SOURCE)


def test_pending_then_succeeded_then_planned_and_not_inspected_again(tmp_path: Path) -> None:
    cluster = FakeCluster()
    pending = reconcile(body(SPEC), cluster, NOW, default_image=IMAGE)
    ready = condition(pending, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelConfigPending")
    assert f"Job ml/{job_name()}" in ready["message"] and SOURCE in ready["message"]
    assert retry_reason(InferenceServiceStatus.model_validate(pending)) is not None  # looked at again
    assert ("Job", "ml", job_name()) in cluster.objects and "Deployment" not in cluster.kinds()
    assert cluster.objects[("Job", "ml", job_name())]["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    # Reconciled again while it runs: the Job is neither made again nor rewritten.
    applies = cluster.applies
    again = reconcile(body(SPEC, status=pending), cluster, NOW, default_image=IMAGE)
    assert condition(again, "Ready")["reason"] == "ModelConfigPending" and cluster.applies == applies

    result = reported(tmp_path)
    job_pod(cluster, 0, result)
    planned = reconcile(body(SPEC, status=again), cluster, NOW, default_image=IMAGE)
    assert condition(planned, "Planned")["status"] == "True"
    assert "Deployment" in cluster.kinds()
    assert planned["inspectedCheckpoint"]["source"] == SOURCE
    recorded = {k: v for k, v in planned["inspectedCheckpoint"].items() if k != "source"}
    assert CheckpointInspection.model_validate(recorded) == CheckpointInspection.model_validate_json(result)
    assert planned["plan"]["reasons"]["model"].startswith("the checkpoint's config.json of /")

    # The Job and its pod removed (ttlSecondsAfterFinished): the status's record is planned from.
    for key in [k for k in cluster.objects if k[0] in ("Job", "Pod")]:
        del cluster.objects[key]
    kept = reconcile(body(SPEC, status=planned), cluster, NOW, default_image=IMAGE)
    assert "Job" not in cluster.kinds() and condition(kept, "Planned")["status"] == "True"
    assert kept["inspectedCheckpoint"] == planned["inspectedCheckpoint"]

    # Another source is another checkpoint: inspected afresh, the running Deployment kept meanwhile.
    moved = {**SPEC, "model": {**SPEC["model"], "source": "pvc://models/other"}}
    changed = reconcile(body(moved, generation=2, status=kept), cluster, NOW, default_image=IMAGE)
    assert condition(changed, "Planned")["reason"] == "ModelConfigPending"
    assert ("Job", "ml", job_name("pvc://models/other")) in cluster.objects
    assert "inspectedCheckpoint" not in changed and "Deployment" in cluster.kinds()


@pytest.mark.parametrize(
    "message, reason",
    [
        (
            "UnsupportedArchitecture: /models/models/llama-3.1-8b: FooForCausalLM is not an architecture",
            "UnsupportedArchitecture",
        ),
        ("/models/models/llama-3.1-8b: [Errno 2] No such file or directory: 'config.json'", "ModelConfigUnavailable"),
    ],
)
def test_a_failed_inspection_is_not_ready_with_its_message_and_runs_again_once_removed(
    message: str, reason: str
) -> None:
    cluster = FakeCluster()
    pending = reconcile(body(SPEC), cluster, NOW)
    job_pod(cluster, 1, message)
    cluster.objects[("Job", "ml", job_name())]["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
    }
    failed = reconcile(body(SPEC, status=pending), cluster, NOW)
    ready = condition(failed, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert SOURCE in ready["message"] and message.removeprefix("UnsupportedArchitecture: ") in ready["message"]
    # Kept while the failed Job stays (its message is the status's); a new one once it is removed.
    applies = cluster.applies
    reconcile(body(SPEC, status=failed), cluster, NOW)
    assert cluster.applies == applies
    del cluster.objects[("Job", "ml", job_name())]
    retried = reconcile(body(SPEC, status=failed), cluster, NOW)
    assert condition(retried, "Ready")["reason"] == "ModelConfigPending"
    assert ("Job", "ml", job_name()) in cluster.objects


def test_a_job_that_ends_without_a_result_or_reports_nonsense_is_unavailable() -> None:
    cluster = FakeCluster()
    pending = reconcile(body(SPEC), cluster, NOW)
    cluster.objects[("Job", "ml", job_name())]["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too long"}]
    }
    timed_out = condition(reconcile(body(SPEC, status=pending), cluster, NOW), "Ready")
    assert timed_out["reason"] == "ModelConfigUnavailable" and "too long" in timed_out["message"]
    job_pod(cluster, 0, json.dumps({"architecture": {"layers": 1}}))
    nonsense = condition(reconcile(body(SPEC, status=pending), cluster, NOW), "Ready")
    assert nonsense["reason"] == "ModelConfigUnavailable" and "does not parse" in nonsense["message"]


def test_a_same_named_job_of_someone_else_is_neither_read_nor_taken_over(tmp_path: Path) -> None:
    cluster = FakeCluster()
    foreign = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job_name(), "namespace": "ml"}}
    cluster.put(foreign)
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ml", "labels": {inspection.JOB_NAME_LABEL: job_name()}},
            "status": {
                "containerStatuses": [
                    {"name": "inspect", "state": {"terminated": {"exitCode": 0, "message": reported(tmp_path)}}}
                ]
            },
        }
    )
    status = reconcile(body(SPEC), cluster, NOW)
    assert condition(status, "Ready")["reason"] == "NameConflict" and "inspectedCheckpoint" not in status
    assert cluster.objects[("Job", "ml", job_name())] == {
        **foreign,
        "metadata": {**foreign["metadata"], "generation": 1, "resourceVersion": "101"},
    }


def test_the_spec_s_architecture_or_the_catalog_need_no_inspection() -> None:
    for spec in (
        {**SPEC, "model": {"name": "llama-2-7b", "source": SOURCE}},
        {
            **SPEC,
            "model": {
                **SPEC["model"],
                "architecture": {
                    "layers": 32,
                    "hiddenSize": 4096,
                    "attentionHeads": 32,
                    "kvHeads": 8,
                    "vocabSize": 32000,
                    "parameters": 8000000000,
                    "maxContext": 8192,
                },
            },
        },
    ):
        cluster = FakeCluster()
        reconcile(body(spec), cluster, NOW)
        assert "Job" not in cluster.kinds()


def test_the_job_s_pod_events_reconcile_its_service(tmp_path: Path) -> None:
    cluster = FakeCluster()
    cluster.put(body(SPEC))
    operator = Operator(cluster)
    reconcile(body(SPEC), cluster, NOW)
    job_pod(cluster, 0, reported(tmp_path))
    pod = copy.deepcopy(next(o for (kind, _, _), o in cluster.objects.items() if kind == "Pod"))
    # An ended pod whose Ready condition was never turned off (kwok leaves it True; a kubelet turns it
    # False with reason PodCompleted) still has something to say: it is not an engine pod gone ready.
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert operator.event(pod_handler, body=pod) == [("ml", "chat")]
    status = cluster.objects[("InferenceService", "ml", "chat")]["status"]
    assert status["inspectedCheckpoint"]["source"] == SOURCE and "Deployment" in cluster.kinds()


BAKED = "/srv/models/qwen3-8b"
VLLM_IMAGE = "registry.example/vllm-with-qwen:1"
BAKED_SPEC = {
    "model": {"name": "my-qwen", "source": BAKED},
    "runtime": "vllm",
    "image": VLLM_IMAGE,
    "imagePullPolicy": "Always",
    "imagePullSecrets": [{"name": "pull"}],
    "accelerator": {"type": "L4"},
}


def test_a_path_in_the_engine_image_is_read_from_that_image_mounted_as_a_volume() -> None:
    spec = InferenceServiceSpec.model_validate(BAKED_SPEC)
    inspected = inspection.inspected_source(spec.model.source, spec, IMAGE)
    assert inspected == inspection.Inspected(BAKED, VLLM_IMAGE)
    assert inspected.key == f"{BAKED} in {VLLM_IMAGE}"
    job = inspection.job("chat", "ml", "uid-1", spec, inspected, IMAGE)
    assert job["metadata"]["name"] == inspection.job_name("chat", "uid-1", inspected.key)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # kvpilot's command in the operator's image: vLLM's image has none of ours, and needs none.
    assert container["image"] == IMAGE
    assert [*container["command"], *container["args"]] == ["kvpilot", "inspect-checkpoint", f"/inspected-image{BAKED}"]
    assert {"name": "model", "mountPath": "/inspected-image", "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "image": {"reference": VLLM_IMAGE, "pullPolicy": "Always"}} in pod["volumes"]
    assert pod["imagePullSecrets"] == [{"name": "pull"}]  # the image volume is pulled with them too
    assert (
        pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"] == render.container_security()
    )
    # Without spec.image, the image the engine pod would run: the runtime's, else the operator's.
    for runtime, image in (("vllm", render.RUNTIMES["vllm"].image), ("kvpilot", IMAGE)):
        unpinned = spec.model_copy(update={"image": None, "runtime": runtime})
        assert inspection.inspected_source(unpinned.model.source, unpinned, IMAGE) == inspection.Inspected(BAKED, image)
        assert image == render.engine_image(unpinned, IMAGE)


def test_a_baked_model_is_planned_from_its_image_and_inspected_again_when_the_image_changes(tmp_path: Path) -> None:
    cluster = FakeCluster()
    key = f"{BAKED} in {VLLM_IMAGE}"
    pending = reconcile(body(BAKED_SPEC), cluster, NOW, default_image=IMAGE)
    ready = condition(pending, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelConfigPending") and key in ready["message"]
    job_pod(cluster, 0, reported(tmp_path), name=job_name(key))
    planned = reconcile(body(BAKED_SPEC, status=pending), cluster, NOW, default_image=IMAGE)
    assert condition(planned, "Planned")["status"] == "True" and "Deployment" in cluster.kinds()
    assert planned["inspectedCheckpoint"]["source"] == key
    engine = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"] == VLLM_IMAGE

    # A new image may bake other files at the same path: read afresh, the Deployment kept meanwhile.
    moved = {**BAKED_SPEC, "image": "registry.example/vllm-with-qwen:2"}
    changed = reconcile(body(moved, generation=2, status=planned), cluster, NOW, default_image=IMAGE)
    assert condition(changed, "Planned")["reason"] == "ModelConfigPending"
    assert ("Job", "ml", job_name(f"{BAKED} in registry.example/vllm-with-qwen:2")) in cluster.objects
    assert "inspectedCheckpoint" not in changed and "Deployment" in cluster.kinds()


def test_an_image_volume_the_cluster_cannot_mount_fails_with_what_it_needs() -> None:
    cluster = FakeCluster()
    key = f"{BAKED} in {VLLM_IMAGE}"
    pending = reconcile(body(BAKED_SPEC), cluster, NOW, default_image=IMAGE)
    # No pod ever ran (the volume dropped by an older API server, or a runtime that mounts no image).
    cluster.objects[("Job", "ml", job_name(key))]["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too long"}]
    }
    ready = condition(reconcile(body(BAKED_SPEC, status=pending), cluster, NOW, default_image=IMAGE), "Ready")
    assert ready["reason"] == "ModelConfigUnavailable"
    assert "too long" in ready["message"] and inspection.IMAGE_VOLUME_NEEDS in ready["message"]
    assert "model.architecture" in ready["message"]
    # A claim's Job that timed out is not an image volume's problem.
    claim = reconcile(body(SPEC), (other := FakeCluster()), NOW)
    other.objects[("Job", "ml", job_name())]["status"] = cluster.objects[("Job", "ml", job_name(key))]["status"]
    said = condition(reconcile(body(SPEC, status=claim), other, NOW), "Ready")["message"]
    assert "too long" in said and inspection.IMAGE_VOLUME_NEEDS not in said
