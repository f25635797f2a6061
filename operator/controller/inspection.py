"""The architecture of a model (or of its draft model) the spec and the catalog do not describe,
learnt from its checkpoint where the engine would load it: a short Job, owned by the
InferenceService, runs `kvpilot inspect-checkpoint` on the model's folder in the operator's default
engine image (which also runs the hf:// downloads). A pvc:// checkpoint's claim is mounted read-only
where the engine mounts it; a path in the engine image is read from that image mounted as an image
volume (Kubernetes 1.35+, or the ImageVolume gate from 1.31), so that an image without kvpilot
(vLLM's, or one built on it) needs no command of ours. The container reports the result, or the
refusal, in its termination message, which the operator reads from the Job's pod.

The Job is named after the service, its UID and what is inspected (model.source or
serving.draftModel, and the image a path is in): a new source or a new image is a new Job, and the
result is kept in `status.inspectedCheckpoint` (the draft's in `inspectedDraftCheckpoint`) with what
it was read from, so that it is not inspected again while they stay the same. A failed Job stays
(the status quotes it) until its ttlSecondsAfterFinished removes it; the next reconcile then starts
a new one: that is the retry's backoff, which also catches a claim whose files were fixed meanwhile.

Pure: observe (controller/reconcile.py) reads the Job and its pods, `result` reads them, and the
Job to create is one of the children `decide` renders."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.inspection import TERMINATION_MESSAGE_PATH, UNSUPPORTED, CheckpointInspection
from kvpilot.operator.api.model_paths import MODEL_MOUNT, source_path
from kvpilot.operator.api.spec import HF_SCHEME, PVC_SCHEME, InferenceServiceSpec
from kvpilot.operator.api.status import InspectedCheckpoint
from kvpilot.operator.controller.checkpoint import Unreadable
from kvpilot.operator.controller.render import container_security, engine_image, pod_security
from kvpilot.operator.planning.model_config import ModelConfig

Manifest = dict[str, Any]

PENDING = "ModelConfigPending"
UNAVAILABLE = "ModelConfigUnavailable"
# Not the engine's app name: the Service and the NetworkPolicy select engine pods by it.
INSPECTION_APP = "kvpilot-checkpoint-inspection"
# The label the Job controller gives its pods (every Kubernetes version; batch.kubernetes.io/job-name
# only from 1.27).
JOB_NAME_LABEL = "job-name"
CONTAINER = "inspect"
# Reading a config.json and a safetensors header: a Python start and little more.
RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}
# A second try for a pod lost with its node; a refusal is the same twice.
BACKOFF_LIMIT = 1
# A claim that cannot be mounted (bound elsewhere, a node lost) fails the Job instead of leaving it
# pending for ever.
DEADLINE_SECONDS = 600
# How long a finished Job stays: a failed one is the retry's backoff (see above); a succeeded one
# has been read by then.
TTL_SECONDS = 300


# Where the Job mounts the engine image whose path it reads.
IMAGE_MOUNT = "/inspected-image"
# What a Job that could not mount an engine image most likely lacked.
IMAGE_VOLUME_NEEDS = (
    "reading a path in the engine image mounts the image as a volume: Kubernetes 1.35+ (or the ImageVolume "
    "feature gate from 1.31) and a container runtime that mounts images (containerd 2.1+, CRI-O 1.31+); "
    "else give model.architecture"
)


class Inspected(NamedTuple):
    """What an inspection Job reads: model.source (or serving.draftModel), and for a path in the engine
    image that image."""

    source: str
    image: str | None = None  # None: a pvc:// claim

    @property
    def key(self) -> str:
        """What names the Job and `status.inspectedCheckpoint.source`: a new image may carry other files
        at the same path, so it is part of what was read."""
        return self.source if self.image is None else f"{self.source} in {self.image}"


def inspected_source(source: str | None, spec: InferenceServiceSpec, default_image: str) -> Inspected | None:
    """What an inspection Job reads for the checkpoint at `source` (checkpoint.model_to_read or
    draft_to_read: None when the spec or the catalog describe it): a claim, or a path in the engine
    image (`default_image`: the operator's, for a spec that names none); None for a hub's, read from
    the hub itself."""
    if source is None or source.startswith(HF_SCHEME):
        return None
    return Inspected(source, None if source.startswith(PVC_SCHEME) else engine_image(spec, default_image))


def job_name(name: str, uid: str, key: str) -> str:
    """`<service>-inspect-<digest>`: the service's name cut so that it stays a label value (the Job
    controller labels its pods with it), the digest of its UID and what is inspected (Inspected.key)
    keeping two services of one long prefix, and two sources, apart."""
    digest = hashlib.sha256(f"{uid}\n{key}".encode()).hexdigest()[:10]
    return f"{name[:42].rstrip('-.')}-inspect-{digest}"


def _model_volume(inspected: Inspected, spec: InferenceServiceSpec) -> tuple[Manifest, Manifest, str]:
    """The model's volume, its mount and the folder to read: the claim read-only at the engine's mount,
    or the engine image at IMAGE_MOUNT (pulled as the engine pod pulls it)."""
    if inspected.image is not None:
        volume = {"name": "model", "image": {"reference": inspected.image, "pullPolicy": spec.image_pull_policy}}
        return volume, {"name": "model", "mountPath": IMAGE_MOUNT, "readOnly": True}, IMAGE_MOUNT + inspected.source
    claim = inspected.source.removeprefix(PVC_SCHEME).partition("/")[0]
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    mount = {"name": "model", "mountPath": f"{MODEL_MOUNT}/{claim}", "readOnly": True}
    return volume, mount, source_path(inspected.source)


def _labels(name: str) -> dict[str, str]:
    return {**names.labels(name), names.APP_NAME_LABEL: INSPECTION_APP}


def job(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, inspected: Inspected, image: str) -> Manifest:
    """The inspection Job of `inspected`: its files read-only (_model_volume), `kvpilot
    inspect-checkpoint` on the model's folder in `image`, as unprivileged as the engine pod."""
    volume, mount, folder = _model_volume(inspected, spec)
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpilot", "inspect-checkpoint"],
        "args": [folder],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": RESOURCES,
        "securityContext": container_security(),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        # A crash before the result is written (an image without the command) says why in its log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [mount, {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        # It reads files, never the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [volume, {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
        **({"imagePullSecrets": [s.model_dump() for s in spec.image_pull_secrets]} if spec.image_pull_secrets else {}),
        **({"nodeSelector": dict(spec.node_selector)} if spec.node_selector else {}),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            **names.child_metadata(name, namespace, uid),
            "name": job_name(name, uid, inspected.key),
            "labels": _labels(name),
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": DEADLINE_SECONDS,
            "ttlSecondsAfterFinished": TTL_SECONDS,
            "template": {"metadata": {"labels": _labels(name)}, "spec": pod_spec},
        },
    }


def recorded(kept: InspectedCheckpoint | None, inspected: Inspected) -> ModelConfig | None:
    """The config `status.inspectedCheckpoint` holds for `inspected`; None when it holds another's."""
    if kept is None or kept.source != inspected.key or kept.architecture is None:
        return None
    return ModelConfig(kept.architecture, kept.quantization)


def record(inspected: Inspected, config: ModelConfig) -> InspectedCheckpoint:
    return InspectedCheckpoint(source=inspected.key, architecture=config.architecture, quantization=config.quantization)


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    state = next((s.get("state") or {} for s in statuses if s.get("name") == CONTAINER), {})
    return state.get("terminated")


def _finished(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Job's Failed or Complete condition (a Complete one without a result read: an image that
    ended well without writing one)."""
    conditions = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") in ("Failed", "Complete") and c.get("status") == "True"), None)


def result(
    job: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]], namespace: str, name: str, inspected: Inspected
) -> ModelConfig | Unreadable:
    """What the inspection Job `name` of `inspected` found: the config its pod reported, why it could
    not (its refusal, else the Job's own words), or that it has not finished (PENDING)."""
    what, source = f"Job {namespace}/{name}", inspected.key
    if job is None:
        return Unreadable(PENDING, f"{what} is created to read {source}'s config.json")
    ordered = sorted(pods, key=lambda p: str(p["metadata"].get("creationTimestamp") or ""))
    ended = [t for p in ordered if (t := _terminated(p)) is not None]
    for terminated in ended:
        if terminated.get("exitCode") == 0 and terminated.get("message"):
            try:
                found = CheckpointInspection.model_validate_json(terminated["message"])
            except ValidationError as error:
                return Unreadable(UNAVAILABLE, f"{source}: {what} reported what does not parse: {error}")
            return ModelConfig(found.architecture, found.quantization)
    finished = _finished(job)
    if finished is None:
        phase = str((ordered[-1].get("status") or {}).get("phase")) if ordered else "not created yet"
        return Unreadable(PENDING, f"{what} reads {source}'s config.json (its pod: {phase})")
    said = str(ended[-1].get("message") or "").strip() if ended else ""
    if said.startswith(UNSUPPORTED):
        return Unreadable(UNSUPPORTED, f"{source}: {said.removeprefix(UNSUPPORTED).lstrip(': ')}")
    why = said or str(finished.get("message") or finished.get("reason") or "it ended without a result")
    # No container ended: the pod never started, which for an image is most often its volume.
    hint = f"; {IMAGE_VOLUME_NEEDS}" if inspected.image is not None and not ended else ""
    return Unreadable(
        UNAVAILABLE,
        f"{source}: {what} failed: {why}{hint} (a new one runs once it is removed, {TTL_SECONDS} s after)",
    )
