"""The architecture of a pvc:// model the spec and the catalog do not describe, learnt from its
checkpoint on the claim: a short Job, owned by the InferenceService, mounts the claim read-only where
the engine would and runs `kvpilot inspect-checkpoint` on the model's folder (in the operator's
default engine image, which also runs the hf:// downloads); the container reports the result, or the
refusal, in its termination message, which the operator reads from the Job's pod.

The Job is named after the service, its UID and model.source: a new source is a new Job, and the
result is kept in `status.inspectedCheckpoint` with the source it was read from, so that it is not
inspected again while model.source stays the same. A failed Job stays (the status quotes it) until
its ttlSecondsAfterFinished removes it; the next reconcile then starts a new one: that is the retry's
backoff, which also catches a claim whose files were fixed meanwhile.

Pure: observe (controller/reconcile.py) reads the Job and its pods, `result` reads them, and the
Job to create is one of the children `decide` renders."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from kvpilot.operator.api import names
from kvpilot.operator.api.inspection import TERMINATION_MESSAGE_PATH, UNSUPPORTED, CheckpointInspection
from kvpilot.operator.api.model_paths import MODEL_MOUNT, source_path
from kvpilot.operator.api.spec import PVC_SCHEME, InferenceServiceSpec
from kvpilot.operator.api.status import InspectedCheckpoint
from kvpilot.operator.controller.checkpoint import Unreadable, described
from kvpilot.operator.controller.render import container_security, pod_security
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


def inspected_source(spec: InferenceServiceSpec) -> str | None:
    """The pvc:// model.source whose checkpoint gives the architecture: None when the spec (its
    model.architecture) or the catalog give it, or the model is not on a claim."""
    source = spec.model.source
    return source if not described(spec) and source is not None and source.startswith(PVC_SCHEME) else None


def job_name(name: str, uid: str, source: str) -> str:
    """`<service>-inspect-<digest>`: the service's name cut so that it stays a label value (the Job
    controller labels its pods with it), the digest of its UID and the source keeping two services
    of one long prefix, and two sources, apart."""
    digest = hashlib.sha256(f"{uid}\n{source}".encode()).hexdigest()[:10]
    return f"{name[:42].rstrip('-.')}-inspect-{digest}"


def _labels(name: str) -> dict[str, str]:
    return {**names.labels(name), names.APP_NAME_LABEL: INSPECTION_APP}


def job(name: str, namespace: str, uid: str, spec: InferenceServiceSpec, source: str, image: str) -> Manifest:
    """The inspection Job of `source` (pvc://claim/path): the claim read-only at the engine's mount,
    `kvpilot inspect-checkpoint` on the model's folder, as unprivileged as the engine pod."""
    claim = source.removeprefix(PVC_SCHEME).partition("/")[0]
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpilot", "inspect-checkpoint"],
        "args": [source_path(source)],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": RESOURCES,
        "securityContext": container_security(),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        # A crash before the result is written (an image without the command) says why in its log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "model", "mountPath": f"{MODEL_MOUNT}/{claim}", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        # It reads files, never the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
        ],
        **({"imagePullSecrets": [s.model_dump() for s in spec.image_pull_secrets]} if spec.image_pull_secrets else {}),
        **({"nodeSelector": dict(spec.node_selector)} if spec.node_selector else {}),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            **names.child_metadata(name, namespace, uid),
            "name": job_name(name, uid, source),
            "labels": _labels(name),
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": DEADLINE_SECONDS,
            "ttlSecondsAfterFinished": TTL_SECONDS,
            "template": {"metadata": {"labels": _labels(name)}, "spec": pod_spec},
        },
    }


def recorded(inspected: InspectedCheckpoint | None, source: str) -> ModelConfig | None:
    """The config `status.inspectedCheckpoint` holds for `source`; None when it holds another's."""
    if inspected is None or inspected.source != source or inspected.architecture is None:
        return None
    return ModelConfig(inspected.architecture, inspected.quantization)


def record(source: str, config: ModelConfig) -> InspectedCheckpoint:
    return InspectedCheckpoint(source=source, architecture=config.architecture, quantization=config.quantization)


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
    job: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]], namespace: str, name: str, source: str
) -> ModelConfig | Unreadable:
    """What the inspection Job `name` of `source` found: the config its pod reported, why it could
    not (its refusal, else the Job's own words), or that it has not finished (PENDING)."""
    what = f"Job {namespace}/{name}"
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
    return Unreadable(
        UNAVAILABLE, f"{source}: {what} failed: {why} (a new one runs once it is removed, {TTL_SECONDS} s after)"
    )
