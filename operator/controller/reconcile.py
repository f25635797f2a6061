"""One reconciliation of an InferenceService: observe, decide, apply, report.

`observe` reads everything the decision needs (the nodes' GPUs when the plan chooses among them,
the CPU profile ConfigMaps the specs name, the API-key Secret, a model's config.json from the Hub or
from its claim's inspection Job and that Job's pods); `decide` is pure: it plans (the spec, else the
last good plan's) and renders the children (an inspection Job among them while one is needed);
`apply` converges them; the status is built from the decision and what the children are afterwards.

Level-triggered and idempotent: it derives everything from the object as it is now (and the
status it wrote last), so create, update, resume and every child event run the same function, a
child deleted by hand comes back on the event of its deletion, and a restarted operator converges
on the objects it already made. Decisions are made here; the `Cluster` adapter does the I/O.

- Only children this InferenceService owns (a controller owner reference with its UID) are ever
  written. A same-named object of anyone else is left exactly as it is, nothing is written, and
  the status says `NameConflict`.
- A child whose rendering has not changed is not written at all, so a reconcile of a converged
  service costs reads only.
- A spec that stops planning keeps the Deployment of the last plan that fit running; only a spec
  that never planned has no Deployment. Nothing here deletes anything. `status.lastGoodPlan`
  keeps what that plan was made from (the PLANNED fields), so its Deployment is rendered from them
  meanwhile (with the rest of the current spec: replicas, env, placement): deleted by hand, it
  comes back.
- The GPU chosen for an unset `accelerator.type` is kept (in `status.lastGoodPlan`) while the spec
  stays the same in what a plan depends on, so a new node type does not re-plan (and roll) every
  service, and a scale (the autoscaler and the gateway write `spec.replicas`, which bumps the
  generation) applies its replicas to the same plan even when no node has a GPU left; a change
  of what a plan depends on plans afresh.
- A write the API server refuses (say a quantity it cannot parse) becomes `ApplyFailed` with the
  API server's message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from datetime import datetime
from typing import Any, NamedTuple

from pydantic import ValidationError

from kvpilot.engine.contract.device_profile import DeviceProfile
from kvpilot.operator.api import names
from kvpilot.operator.api.names import API_VERSION, GROUP, KIND
from kvpilot.operator.api.plan import MixedPlan, Plan
from kvpilot.operator.api.spec import ANY_GPU, CPU_TYPE, HF_SCHEME, InferenceServiceSpec
from kvpilot.operator.api.status import (
    InferenceServiceStatus,
    InspectedCheckpoint,
    KeptCheckpoint,
    LastGoodPlan,
    status_of,
)
from kvpilot.operator.controller import correction, inspection, render, status
from kvpilot.operator.controller.checkpoint import (
    Unreadable,
    as_draft,
    draft_to_read,
    model_to_read,
    read_checkpoint,
    with_checkpoint,
)
from kvpilot.operator.controller.variant_events import variant_events, variant_replicas
from kvpilot.operator.hub.client import HubClient
from kvpilot.operator.kube.cluster import Cluster, Manifest, WriteConflict, WriteRefused, describe
from kvpilot.operator.kube.events import iso, seconds_of
from kvpilot.operator.kube.indexes import pooled
from kvpilot.operator.kube.merge_patch import merge_patch
from kvpilot.operator.planning import cpus
from kvpilot.operator.planning.context import Correction
from kvpilot.operator.planning.model_config import ModelConfig
from kvpilot.operator.planning.plan import PlanContext, plan
from kvpilot.operator.planning.reasons import failed_plan
from kvpilot.operator.planning.sources import MODEL_SOURCE_REQUIRED, missing_source, with_model_source
from kvpilot.operator.planning.variants import as_one_plan, plan_variants, requested
from kvpilot.operator.runtimes import RUNTIMES

# The hash of the rendered manifest, on each child: unchanged hash (and no field of ours edited by
# hand) means nothing to write.
RENDERED_HASH = f"{GROUP}/rendered-hash"
# Reasons of a status that no event will change: the reconcile is retried after a delay instead;
# those BACKED_OFF wait longer after each failure in a row (the Hub refusing or unreachable).
# A pending inspection Job is looked at again too, should its pod's events be missed.
RETRIED = ("NameConflict", "ApplyFailed", "NoGPUType", "ModelConfigUnavailable", inspection.PENDING)
BACKED_OFF = ("ModelConfigUnavailable",)


def _invalid(body: Mapping[str, Any], error: ValidationError) -> Plan:
    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    return Plan(
        fits=False,
        failure="InvalidSpec",
        reason=f"invalid spec: {problems}",
        model=str(body.get("spec", {}).get("model", {}).get("name", "")),
    )


def controller_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The owner reference with controller: true, None when nothing controls `obj`."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((dict(r) for r in refs if r.get("controller")), None)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    controller = controller_of(obj)
    return controller is not None and controller.get("uid") == uid


def _owner_words(obj: Mapping[str, Any]) -> str:
    controller = controller_of(obj)
    if controller is None:
        return "no controller (no controller owner reference)"
    return (
        f"{controller.get('kind')} {controller.get('name')} "
        f"(apiVersion {controller.get('apiVersion')}, uid {controller.get('uid')})"
    )


def stamped(manifest: Manifest) -> Manifest:
    """`manifest` with the hash of its content in the RENDERED_HASH annotation."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]
    metadata = manifest["metadata"]
    return {
        **manifest,
        "metadata": {**metadata, "annotations": {**metadata.get("annotations", {}), RENDERED_HASH: digest}},
    }


def _contains(actual: Any, wanted: Any) -> bool:
    """Every field of `wanted` has its value in `actual` (which may carry more: defaults, status,
    other managers' fields). Empty wanted values match absent ones, as the API server omits them."""
    if isinstance(wanted, Mapping):
        actual = actual if isinstance(actual, Mapping) else {}
        return all(_contains(actual.get(key), value) for key, value in wanted.items())
    if isinstance(wanted, list):
        actual = actual if isinstance(actual, list) else []
        return len(actual) == len(wanted) and all(map(_contains, actual, wanted))
    if actual is None:
        return wanted in ({}, [], None)
    return bool(actual == wanted)


def unchanged(existing: Mapping[str, Any], manifest: Manifest) -> bool:
    """Writing `manifest` (stamped) over `existing` would change nothing of ours."""
    annotations = (existing.get("metadata") or {}).get("annotations") or {}
    return annotations.get(RENDERED_HASH) == manifest["metadata"]["annotations"][RENDERED_HASH] and _contains(
        existing, manifest
    )


# The children rendered from the owner's name, namespace and UID alone (not its spec or plan).
_SPEC_FREE = {"Service": render.service, "PodDisruptionBudget": render.pod_disruption_budget}


def as_rendered(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    """`child` is a Service or PDB of the InferenceService `owner` (its controller reference)
    whose fields of ours are as the owner would render them: an event of it has nothing to
    reconcile (reading the owner would tell)."""
    rendering = _SPEC_FREE.get(str(child.get("kind")))
    if rendering is None:
        return False
    return unchanged(child, stamped(rendering(owner["name"], child["metadata"]["namespace"], owner["uid"])))


# The spec fields a plan depends on, and the image, which belongs to the runtime the plan chose.
# Not `replicas` (a scale keeps the plan), nor where and how the pods run (env, placement, labels:
# often the bulk of a spec), which the Deployment takes from the spec as it is even while the spec
# does not plan.
PLANNED = ("model", "runtime", "accelerator", "serving", "slo", "load", "autoscaling", "image")


def planned_fields(spec: InferenceServiceSpec) -> dict[str, Any]:
    """What a plan depends on (PLANNED), without defaults (short in the status, and an operator
    with a new default does not count as a change)."""
    return spec.model_dump(mode="json", by_alias=True, include=set(PLANNED), exclude_defaults=True)


def _planned_part(kept_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The PLANNED fields of a `lastGoodPlan.spec` (an older operator kept the whole spec)."""
    return {key: value for key, value in kept_spec.items() if key in PLANNED}


def last_good(
    planned: dict[str, Any],
    gpu: str,
    gpu_reason: str | None,
    checkpoint: ModelConfig | None = None,
    draft: ModelConfig | None = None,
) -> LastGoodPlan:
    """`status.lastGoodPlan` for a plan that fits: the spec it was made for (`planned_fields`),
    the GPU chosen (and why), and the model's and the draft's configs as read from their checkpoints,
    all that rendering its Deployment again needs (the Hub may be down by then)."""
    return LastGoodPlan(
        gpu=gpu,
        spec=planned,
        gpu_reason=gpu_reason or None,
        checkpoint=_held(checkpoint),
        draft_checkpoint=_held(draft),
    )


def _held(config: ModelConfig | None) -> KeptCheckpoint | None:
    if config is None:
        return None
    return KeptCheckpoint(architecture=config.architecture, quantization=config.quantization or None)


def _config(held: KeptCheckpoint | None) -> ModelConfig | None:
    """The config a `status.lastGoodPlan` checkpoint holds, None without one."""
    if held is None or held.architecture is None:
        return None
    return ModelConfig(held.architecture, held.quantization)


def _kept(old: InferenceServiceStatus, planned: dict[str, Any] | None, generation: int) -> LastGoodPlan | None:
    """`status.lastGoodPlan`; for a status written before it existed (by an older operator), the
    plan that status holds when it fit and was made for this generation, so that an upgrade does
    not re-plan (and roll onto another GPU type) every service."""
    # One with no field set records no plan: the status's plan is tried instead.
    if old.last_good_plan and old.last_good_plan.dump():
        return old.last_good_plan
    previous = old.plan
    if planned is None or old.observed_generation != generation or previous is None or not previous.fits:
        return None
    return last_good(planned, previous.gpu, (previous.reasons or {}).get("gpu")) if previous.gpu else None


def _profile_name(spec: InferenceServiceSpec) -> str | None:
    """The CPU device profile `spec` names when it is not built in: a ConfigMap to read."""
    name = spec.accelerator.profile
    if spec.accelerator.type != CPU_TYPE or name is None or name in cpus.builtin_profiles():
        return None
    return name


def device_profiles(
    specs: Sequence[InferenceServiceSpec], cluster: Cluster, operator_namespace: str | None
) -> dict[str, DeviceProfile | str]:
    """The CPU device profiles the specs name, when not built in: their ConfigMaps in the operator's
    namespace (read at every reconcile of the service: nothing watches them), or why one cannot be
    read. Empty for every other spec, which costs no request."""
    found: dict[str, DeviceProfile | str] = {}
    for name in {n for n in map(_profile_name, specs) if n is not None}:
        if operator_namespace is None:
            found[name] = f"accelerator.profile {name!r}: the operator does not know its namespace (KVPILOT_NAMESPACE)"
            continue
        configmap = cluster.get("v1", "ConfigMap", operator_namespace, name)
        if configmap is None:
            continue
        try:
            found[name] = cpus.configmap_profile(configmap)
        except ValueError as error:
            found[name] = str(error)
    return found


def _kept_spec(kept: LastGoodPlan | None, spec: InferenceServiceSpec) -> InferenceServiceSpec | None:
    """The spec to render the Deployment from while `spec` does not plan: the planned fields of
    `status.lastGoodPlan`, the rest (replicas, env, placement) of `spec`. None without a last good
    plan (or one this operator cannot read any more)."""
    if kept is None or not kept.spec or not kept.gpu:
        return None
    current = spec.model_dump(mode="json", by_alias=True, exclude=set(PLANNED), exclude_defaults=True)
    try:
        return with_model_source(InferenceServiceSpec.model_validate({**current, **_planned_part(kept.spec)}))
    except ValidationError:
        return None


def _last_good_serving(
    kept: LastGoodPlan | None, spec: InferenceServiceSpec, profiles: Mapping[str, DeviceProfile | str]
) -> tuple[InferenceServiceSpec, Plan] | None:
    """The kept spec (_kept_spec) and its plan, on the GPU it chose; None when it does not plan."""
    kept_spec = _kept_spec(kept, spec)
    if kept is None or kept_spec is None:
        return None
    checkpoint = _config(kept.checkpoint)
    kept_spec = with_checkpoint(kept_spec, checkpoint)
    context = PlanContext(
        available_gpus=(str(kept.gpu),),
        device_profiles=profiles,
        checkpoint=checkpoint.architecture if checkpoint else None,
        draft_checkpoint=_config(kept.draft_checkpoint),
    )
    result = plan(kept_spec, context)
    return (kept_spec, result) if result.fits else None


def _kept_gpu(spec: InferenceServiceSpec, planned: dict[str, Any], kept: LastGoodPlan | None) -> str | None:
    """The GPU of the last plan that fit, when it was made for this spec (replicas aside) and
    the spec does not name a type."""
    if spec.accelerator.type:
        return None
    # Compared as this operator reads it: a plan kept before it defaulted model.source is the same plan.
    kept_spec = _kept_spec(kept, spec)
    if kept is None or kept_spec is None or planned_fields(kept_spec) != planned:
        return None
    return kept.gpu


def _reads_nodes(spec: InferenceServiceSpec, planned: dict[str, Any], kept: LastGoodPlan | None) -> bool:
    """The nodes are read when they choose the GPU type, or bound the tensor-parallel size the
    planner picks (a runtime with more than one, no accelerator.count)."""
    splits = spec.accelerator.count is None and len(RUNTIMES[spec.runtime].capabilities.tensor_parallel_sizes) > 1
    return (_kept_gpu(spec, planned, kept) is None and not spec.accelerator.type) or splits


def _plan(spec: InferenceServiceSpec, planned: dict[str, Any], observed: Observed, context: PlanContext) -> Plan:
    """The plan of `spec`: on the GPU the last good plan chose while the spec is the same, else on
    the spec's GPU type or the nodes'."""
    kept = observed.kept
    gpu = _kept_gpu(spec, planned, kept)
    available = (gpu,) if gpu is not None else () if spec.accelerator.type else tuple(observed.nodes)
    result = plan(spec, replace(context, available_gpus=available))
    why = kept.gpu_reason if kept else None
    if gpu is None or not result.fits or not why:
        return result
    return result.model_copy(update={"reasons": {**result.reasons, "gpu": why}})


class _ApiKey(NamedTuple):
    sha256: str | None = None  # of the key the engines run with
    secret: Manifest | None = None  # the Secret to create, with a new random key
    blocked: tuple[str, str] | None = None  # (reason, message): no key to run with


def _api_key(secret: Manifest | None, name: str, namespace: str, uid: str) -> _ApiKey:
    """The service's API key: the key in its Secret (`secret`, as observed), or a new random one and
    the Secret to create for it (once: afterwards the key is the Secret's, which an admin may rotate)."""
    secret_name = names.api_key_secret(name)
    if secret is None:
        key = secrets.token_urlsafe(32)
        return _ApiKey(_sha256(key), render.api_key_secret_manifest(name, namespace, uid, key))
    if not owned_by(secret, uid):
        return _ApiKey(
            blocked=(
                "NameConflict",
                f"Secret {namespace}/{secret_name} exists and is controlled by {_owner_words(secret)}: it is "
                "left alone and nothing is rolled out; delete or rename it, or set auth.apiKey: false",
            )
        )
    key = _secret_text(secret, names.API_KEY_SECRET_KEY)
    if not key:
        return _ApiKey(
            blocked=(
                "InvalidApiKeySecret",
                f"Secret {namespace}/{secret_name} holds no {names.API_KEY_SECRET_KEY} (UTF-8 text): put the key "
                "there, or delete the Secret for a new one",
            )
        )
    return _ApiKey(_sha256(key))


def _secret_text(secret: Mapping[str, Any], key: str) -> str:
    """The UTF-8 text under `key` of a Secret's data; empty when absent or not base64 UTF-8."""
    try:
        return base64.b64decode((secret.get("data") or {}).get(key) or "", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _hub_token(cluster: Cluster, namespace: str, spec: InferenceServiceSpec) -> tuple[str | None, str]:
    """The hub token of model.tokenSecret, and what to add to a refusal when it could not be read."""
    ref = spec.model.token_secret
    if ref is None:
        return None, ""
    token = _secret_text(cluster.get("v1", "Secret", namespace, ref.name) or {}, ref.key).strip()
    if not token:
        return None, f" (asked without a token: Secret {namespace}/{ref.name} holds no {ref.key})"
    return token, ""


def _hub_checkpoint(
    source: str | None, spec: InferenceServiceSpec, cluster: Cluster, namespace: str, hub: HubClient | None
) -> ModelConfig | Unreadable | None:
    """The config.json of `source` when it is on a hub (controller/checkpoint.py), with the service's
    token, at the service's HF_ENDPOINT (its env, as its downloads use) or the operator's."""
    if source is None or not source.startswith(HF_SCHEME):
        return None
    if hub is None:
        return Unreadable("ModelConfigUnavailable", "this operator reads no Hub")
    token, note = _hub_token(cluster, namespace, spec)
    endpoint = next((e.get("value") for e in spec.env if e.get("name") == "HF_ENDPOINT" and e.get("value")), None)
    return read_checkpoint(source, hub, token, endpoint, note)


def _inspection(
    inspected: inspection.Inspected | None,
    recorded: InspectedCheckpoint | None,
    cluster: Cluster,
    body: Mapping[str, Any],
) -> ModelConfig | Unreadable | None:
    """The config of a checkpoint on a claim or in the engine image (controller/inspection.py): as the
    status `recorded` it for this source and image, else as its inspection Job found it (a Job of
    someone else's is not read: the create of ours reports the conflict)."""
    if inspected is None:
        return None
    kept = inspection.recorded(recorded, inspected)
    if kept is not None:
        return kept
    name, namespace, uid = body["metadata"]["name"], body["metadata"]["namespace"], body["metadata"]["uid"]
    job_name = inspection.job_name(name, uid, inspected.key)
    job = cluster.get("batch/v1", "Job", namespace, job_name)
    if job is not None and not owned_by(job, uid):
        job = None
    pods = cluster.list_pods(namespace, {inspection.JOB_NAME_LABEL: job_name}) if job is not None else []
    return inspection.result(job, pods, namespace, job_name, inspected)


class Observed(NamedTuple):
    """What one reconcile read of the cluster: all that `decide` needs."""

    body: Mapping[str, Any]  # the InferenceService
    spec: InferenceServiceSpec | ValidationError  # the error: the spec is invalid
    kept: LastGoodPlan | None  # status.lastGoodPlan
    nodes: dict[str, int]  # GPU product -> most GPUs one node carries; empty when not read
    profiles: dict[str, DeviceProfile | str]  # the CPU profiles the spec and the kept spec name
    api_key_secret: Manifest | None  # the service's API-key Secret, when the operator makes the key
    # The model's config.json read from the Hub (or from its claim or image by an inspection Job),
    # when neither the spec nor the catalog give its architecture; Unreadable says why it could not
    # be had (or that the Job has not finished).
    checkpoint: ModelConfig | Unreadable | None = None
    # serving.draftModel's, the same way, when the plan may run it and nothing else describes it.
    draft_checkpoint: ModelConfig | Unreadable | None = None


def _valid_spec(body: Mapping[str, Any]) -> InferenceServiceSpec | ValidationError:
    try:
        return with_model_source(InferenceServiceSpec.model_validate(body.get("spec", {})))
    except ValidationError as error:
        return error


def observe(
    body: Mapping[str, Any],
    cluster: Cluster,
    operator_namespace: str | None,
    hub: HubClient | None = None,
    default_image: str = render.DEFAULT_ENGINE_IMAGE,
) -> Observed:
    """Read what deciding about `body` needs, and nothing a decision will not use: a healthy
    service with a GPU type and its own key costs one read (its Secret)."""
    metadata, old = body["metadata"], status_of(body)
    generation = int(metadata.get("generation", 0))
    spec = _valid_spec(body)
    if isinstance(spec, ValidationError):
        return Observed(body, spec, _kept(old, None, generation), {}, {}, None)
    planned = planned_fields(spec)
    kept = _kept(old, planned, generation)
    kept_spec = _kept_spec(kept, spec)
    nodes = cluster.gpu_nodes() if _reads_nodes(spec, planned, kept) else {}
    profiles = device_profiles([spec, *([kept_spec] if kept_spec else [])], cluster, operator_namespace)
    secret = None
    if render.operator_api_key(spec):
        secret = cluster.get("v1", "Secret", metadata["namespace"], names.api_key_secret(metadata["name"]))
    checkpoint, draft = (
        _hub_checkpoint(source, spec, cluster, metadata["namespace"], hub)
        or _inspection(inspection.inspected_source(source, spec, default_image), recorded, cluster, body)
        for source, recorded in (
            (model_to_read(spec), old.inspected_checkpoint),
            (draft_to_read(spec), old.inspected_draft_checkpoint),
        )
    )
    return Observed(body, spec, kept, nodes, profiles, secret, checkpoint, as_draft(draft))


class Decision(NamedTuple):
    """What a reconcile does and reports, decided from an Observed alone."""

    spec: InferenceServiceSpec | None
    result: Plan  # the spec's plan (or why it has none); a mixed pool's: its first variant's
    wanted: list[Manifest]  # the children to converge, stamped (with a new key's Secret)
    key: _ApiKey
    last_good: LastGoodPlan | None  # status.lastGoodPlan to write
    correction: dict[str, Any] | None  # status.correction, which `result` was planned with
    mixed: MixedPlan | None = None  # accelerator.variants: a plan per GPU type
    inspected: InspectedCheckpoint | None = None  # status.inspectedCheckpoint to write
    inspected_draft: InspectedCheckpoint | None = None  # status.inspectedDraftCheckpoint to write


def _mixed_plan(
    spec: InferenceServiceSpec,
    observed: Observed,
    context: PlanContext,
    gpu_prices: Mapping[str, float],
    capacity_classes: Mapping[str, Mapping[str, str]],
) -> tuple[MixedPlan, Plan]:
    """A mixed pool's plan (accelerator.variants), and the Plan the status shows for it: its first
    variant's (the cheapest per request per second) with the pool's reason and replicas, or why no
    variant can serve the model."""
    mixed = plan_variants(spec, requested(spec, observed.nodes), context, gpu_prices, capacity_classes)
    return mixed, as_one_plan(spec, mixed)


def _inspecting(
    source: str | None,
    read: ModelConfig | Unreadable | None,
    observed: Observed,
    spec: InferenceServiceSpec,
    default_image: str,
) -> tuple[list[Manifest], InspectedCheckpoint | None]:
    """The inspection Job of the checkpoint at `source` (on a claim or in the engine image) while it has
    not finished (made in the operator's image: it runs `kvpilot inspect-checkpoint`, whichever runtime
    the spec runs), and the record of what one found, for the status."""
    inspected = inspection.inspected_source(source, spec, default_image)
    if inspected is None:
        return [], None
    if isinstance(read, ModelConfig):
        return [], inspection.record(inspected, read)
    if isinstance(read, Unreadable) and read.failure == inspection.PENDING:
        metadata = observed.body["metadata"]
        name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
        return [inspection.job(name, namespace, uid, spec, inspected, default_image)], None
    return [], None


def _planned(
    spec: InferenceServiceSpec,
    observed: Observed,
    corrected: Correction | None,
    gpu_prices: Mapping[str, float],
    capacity_classes: Mapping[str, Mapping[str, str]],
) -> tuple[InferenceServiceSpec, Plan, MixedPlan | None]:
    """The spec as planned (with its checkpoint's stored scheme), its plan (or why there is none:
    a checkpoint not read, a source missing) and a mixed pool's plan."""
    checkpoint, draft = observed.checkpoint, observed.draft_checkpoint
    unreadable = next((c for c in (checkpoint, draft) if isinstance(c, Unreadable)), None)
    if unreadable is not None:
        return spec, failed_plan(spec, unreadable.failure, unreadable.message), None
    missing = missing_source(spec)
    if missing is not None:
        return spec, failed_plan(spec, MODEL_SOURCE_REQUIRED, missing), None
    # What the kept GPU is compared with: the spec as written, before its checkpoint's scheme.
    planned, read = planned_fields(spec), checkpoint if isinstance(checkpoint, ModelConfig) else None
    context = PlanContext(
        gpus_per_node=observed.nodes,
        device_profiles=observed.profiles,
        correction=correction.factors(corrected),
        checkpoint=read.architecture if read else None,
        draft_checkpoint=draft if isinstance(draft, ModelConfig) else None,
    )
    spec = with_checkpoint(spec, read)
    if spec.accelerator.variants:
        mixed, result = _mixed_plan(spec, observed, context, gpu_prices, capacity_classes)
        return spec, result, mixed
    return spec, _plan(spec, planned, observed, context), None


def decide(
    observed: Observed,
    default_image: str,
    operator_namespace: str | None,
    gpu_prices: Mapping[str, float] | None = None,
    room: Mapping[str, int] | None = None,
    capacity_classes: Mapping[str, Mapping[str, str]] | None = None,
) -> Decision:
    """Plan the spec and render the children (pure). A spec that does not plan keeps the last
    good plan's Deployment (rendered with the rest of the spec as it is now; a mixed pool's stay
    as they are); an invalid one renders nothing; a key that cannot be had (a foreign or empty
    Secret) blocks the rollout. `gpu_prices`: US dollars per GPU-hour (the operator's
    --gpu-price, TYPE or TYPE@CLASS), which rank a mixed pool's variants; `room`: the replicas a
    variant's full nodes hold (`still_full`); `capacity_classes`: the operator's (--capacity-class),
    each with the node labels its variants' pods select."""
    body, spec, kept = observed.body, observed.spec, observed.kept
    if isinstance(spec, ValidationError):
        return Decision(None, _invalid(body, spec), [], _ApiKey(), kept, None)
    spec = with_model_source(spec)  # observe's already is; a snapshot's may not be
    metadata = body["metadata"]
    name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
    planned = planned_fields(spec)
    corrected = correction.correction(status_of(body), spec)
    spec, result, mixed = _planned(spec, observed, corrected, gpu_prices or {}, capacity_classes or {})
    key = _api_key(observed.api_key_secret, name, namespace, uid) if render.operator_api_key(spec) else _ApiKey()
    serving = (spec, result) if result.fits or mixed else _last_good_serving(kept, spec, observed.profiles)
    children = render.children(
        name,
        namespace,
        uid,
        *(serving or (spec, result)),
        default_image=default_image,
        api_key_sha256=key.sha256,
        operator_namespace=operator_namespace,
        mixed=mixed,
        room=room,
    )
    jobs, inspected = _inspecting(model_to_read(spec), observed.checkpoint, observed, spec, default_image)
    draft_jobs, inspected_draft = _inspecting(
        draft_to_read(spec), observed.draft_checkpoint, observed, spec, default_image
    )
    wanted = [stamped(m) for m in [*children, *jobs, *draft_jobs, *([key.secret] if key.secret else [])]]
    good = kept
    if result.fits:
        read = [c if isinstance(c, ModelConfig) else None for c in (observed.checkpoint, observed.draft_checkpoint)]
        good = last_good(planned, str(result.gpu), result.reasons.get("gpu"), *read)
    return Decision(spec, result, wanted, key, good, corrected, mixed, inspected, inspected_draft)


def reconcile(
    body: Mapping[str, Any],
    cluster: Cluster,
    now: datetime,
    *,
    default_image: str = render.DEFAULT_ENGINE_IMAGE,
    operator_namespace: str | None = None,
    hub: HubClient | None = None,
    gpu_prices: Mapping[str, float] | None = None,
    capacity_classes: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """Converge the children of `body` and return the status to write; `default_image` is the
    engine image for specs that do not set one, `operator_namespace` where the operator and the
    gateway run (the engines' NetworkPolicy lets their pods in), `hub` where configs are read,
    `gpu_prices` what a GPU-hour of each type costs and `capacity_classes` the node classes a mixed
    pool's variants may name (decide)."""
    metadata = body["metadata"]
    name, namespace, uid = metadata["name"], metadata["namespace"], metadata["uid"]
    old = status_of(body)
    full = still_full(old, now)
    room = {gpu: held for gpu, (held, _) in full.items()}
    observed = observe(body, cluster, operator_namespace, hub, default_image)
    decision = decide(observed, default_image, operator_namespace, gpu_prices, room, capacity_classes)
    key = decision.key
    wanted = [*decision.wanted, *_retired(cluster, decision, old, name, namespace, uid)]
    found = _read(cluster, wanted, decision, old, name, namespace)
    before = variant_replicas(found.values())
    # Without its key the service's pods would serve open (or with someone else's): nothing rolls out.
    blocked = key.blocked or _converge(cluster, wanted, found, uid)
    owned = [d for (kind, _), d in found.items() if kind == "Deployment" and d is not None and owned_by(d, uid)]
    deployment = pooled(owned)
    # Pods are read only while some are not ready, to say why; a healthy service costs no list.
    pods: list[dict[str, Any]] = []
    if deployment is not None and _not_all_ready(deployment):
        pods = cluster.list_pods(namespace, names.selector_labels(name))
    by_name = {d["metadata"]["name"]: d for d in owned}
    full = {**full, **found_full(decision.mixed, pods, now)}
    _post(cluster, variant_events(body, decision.mixed, before, variant_replicas(owned), full, now.timestamp()))
    return status.build(
        name=name,
        namespace=namespace,
        generation=int(metadata.get("generation", 0)),
        plan=decision.result,
        spec=decision.spec,
        deployment=deployment,
        old=old,
        now=now,
        blocked=blocked,
        pods=pods,
        last_good=decision.last_good,
        # A new key counts once its Secret is made.
        api_key=(key.sha256, names.api_key_secret(name))
        if key.sha256 and (key.secret is None or found.get(("Secret", names.api_key_secret(name))))
        else None,
        correction=decision.correction,
        variants=_variant_rows(decision, old, name, by_name, full),
        inspected=decision.inspected,
        inspected_draft=decision.inspected_draft,
        gpu_prices=gpu_prices,
    )


def _post(cluster: Cluster, events: Sequence[Manifest]) -> None:
    """Post `events`; one the API server refuses is lost, not retried: an Event is news about a
    change that happened, and the status says the same."""
    for event in events:
        with suppress(WriteRefused, WriteConflict):
            cluster.post_event(event)


def _variant_rows(
    decision: Decision,
    old: InferenceServiceStatus,
    name: str,
    deployments: Mapping[str, Mapping[str, Any]],
    full: Mapping[str, tuple[int, str]],
) -> list[dict[str, Any]] | None:
    """status.variants: the pool's types as planned, or, while the spec does not plan (invalid, or
    nothing fits), as they were: nothing that runs changed, and a type dropped from the spec in that
    interlude is still known to be retired once it plans again."""
    rows = status.variant_rows(decision.mixed, name, deployments, full)
    if rows is None and not decision.result.fits:
        return [row.model_dump(mode="json", by_alias=True, exclude_none=True) for row in old.variants or []] or None
    return rows


# A GPU type found full is given only the replicas its nodes held for this long; then its next
# replicas try its nodes again (a node may have been added or freed meanwhile).
FULL_RETRY_SECONDS = 300


def still_full(old: InferenceServiceStatus, now: datetime) -> dict[str, tuple[int, str]]:
    """The variants of a mixed pool found full less than FULL_RETRY_SECONDS ago: (the replicas
    their nodes held, since when), by Variant.key (a spot class's nodes fill apart from the type's
    on-demand ones)."""
    full = {}
    for row in old.variants or []:
        if row.gpu and row.schedulable_replicas is not None and row.full_since:
            if now.timestamp() - seconds_of(row.full_since) < FULL_RETRY_SECONDS:
                full[row.key] = (row.schedulable_replicas, row.full_since)
    return full


def found_full(mixed: MixedPlan | None, pods: Sequence[Mapping[str, Any]], now: datetime) -> dict[str, tuple[int, str]]:
    """The variants of a mixed pool whose pods no node can take: (the replicas the nodes hold,
    now), by Variant.key. Held is what the scheduler placed (a node named), not the replicas less the
    pods found unschedulable: a pod it has not tried yet is neither, and counting it as placed
    held the type above what its nodes take. Their next reconcile gives the rest to the next type."""
    if mixed is None or not mixed.fits:
        return {}
    stuck = {id(p) for p in status.unschedulable(pods)}
    full = {}
    for v in mixed.variants:
        mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(names.VARIANT_LABEL) == v.label]
        if any(id(p) in stuck for p in mine):
            placed = sum(
                1 for p in mine if (p.get("spec") or {}).get("nodeName") and not p["metadata"].get("deletionTimestamp")
            )
            full[v.key] = (placed, iso(now.timestamp()))
    return full


def full_retry_in(state: InferenceServiceStatus, now: datetime, any_gpu: bool = False) -> float | None:
    """Seconds until the reconcile must come back by itself, since nothing the operator watches
    changes meanwhile: when the first GPU type held full is tried again (another service freeing
    that type's GPUs), and, for a pool over every type the nodes carry (`any_gpu`: a variant of type
    *), when the nodes are read again (a node pool added or gone)."""
    waits = [
        FULL_RETRY_SECONDS - (now.timestamp() - seconds_of(row.full_since))
        for row in state.variants or []
        if row.full_since
    ]
    if any_gpu:
        waits.append(FULL_RETRY_SECONDS)
    return max(1.0, min(waits)) if waits else None


def _read(
    cluster: Cluster,
    wanted: Sequence[Manifest],
    decision: Decision,
    old: InferenceServiceStatus,
    name: str,
    namespace: str,
) -> dict[tuple[str, str], Manifest | None]:
    """What is there of the wanted children, and of the Deployments the status reads besides them:
    a single type's (also while its spec does not plan) and a mixed pool's as the status lists them
    (kept as they are while its spec does not plan)."""
    found = {_key(m): cluster.get(m["apiVersion"], m["kind"], namespace, m["metadata"]["name"]) for m in wanted}
    listed = [v.deployment for v in old.variants or [] if v.deployment] if decision.mixed is not None else [name]
    for deployment in listed:
        if ("Deployment", deployment) not in found:
            found["Deployment", deployment] = cluster.get("apps/v1", "Deployment", namespace, deployment)
    return found


def _key(manifest: Manifest) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def _retired(
    cluster: Cluster, decision: Decision, old: InferenceServiceStatus, name: str, namespace: str, uid: str
) -> list[Manifest]:
    """The service's Deployments its plan no longer has, scaled to zero: a GPU type dropped from
    accelerator.variants, the one Deployment of a service that became a mixed pool, or a pool's of
    one that no longer is. Only once the new plan fits (a spec that does not plan keeps what runs);
    kept at zero, not deleted: the owner reference removes them with the service."""
    if not decision.result.fits:
        return []
    kept = {m["metadata"]["name"] for m in decision.wanted if m["kind"] == "Deployment"}
    before = {v.deployment for v in old.variants or [] if v.deployment} | ({name} if decision.mixed else set())
    retired = []
    for stale in sorted(before - kept):
        existing = cluster.get("apps/v1", "Deployment", namespace, stale)
        if existing is None or not owned_by(existing, uid) or not (existing.get("spec") or {}).get("replicas"):
            continue
        meta = existing["metadata"]
        manifest = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "ownerReferences") if k in meta},
            "spec": {**existing["spec"], "replicas": 0},
        }
        retired.append(stamped(manifest))
    return retired


def _converge(
    cluster: Cluster, wanted: list[Manifest], found: dict[tuple[str, str], Manifest | None], uid: str
) -> tuple[str, str] | None:
    """Create or update each wanted child (`found` records what is there afterwards), unless one of
    them belongs to someone else; (reason, message) when the children could not all be written."""
    foreign = [
        f"{describe(m)} exists and is controlled by {_owner_words(found[_key(m)] or {})}"
        for m in wanted
        if found[_key(m)] is not None and not owned_by(found[_key(m)], uid)
    ]
    if foreign:
        return (
            "NameConflict",
            "; ".join(foreign) + ": it is left alone and nothing is "
            "rolled out; delete or rename it, or rename this InferenceService",
        )
    refused = []
    for manifest in wanted:
        existing = found[_key(manifest)]
        try:
            if existing is None:
                found[_key(manifest)] = cluster.create(manifest)
            elif not unchanged(existing, manifest):
                found[_key(manifest)] = cluster.update(manifest, existing["metadata"]["resourceVersion"])
        except WriteRefused as error:
            refused.append(f"{error.what}: {error.message}")
    return ("ApplyFailed", "the API server refused " + "; ".join(refused)) if refused else None


def _not_all_ready(deployment: Mapping[str, Any]) -> bool:
    wanted = int((deployment.get("spec") or {}).get("replicas") or 0)
    return int((deployment.get("status") or {}).get("readyReplicas") or 0) < wanted


class Refreshed(NamedTuple):
    version: str  # the object's resourceVersion afterwards
    status: InferenceServiceStatus  # the status it now has
    any_gpu: bool = False  # its spec has a variant of type *: its GPU types are the nodes' (full_retry_in)


def refresh(
    cluster: Cluster,
    namespace: str,
    name: str,
    now: datetime,
    *,
    default_image: str = render.DEFAULT_ENGINE_IMAGE,
    operator_namespace: str | None = None,
    known: Mapping[str, Any] | None = None,
    hub: HubClient | None = None,
    gpu_prices: Mapping[str, float] | None = None,
    capacity_classes: Mapping[str, Mapping[str, str]] | None = None,
) -> Refreshed | None:
    """Reconcile the InferenceService `namespace/name` and write its status if it changed (for
    events of its children); `known` is the object as the caller knows it is now (else it is
    read). None when there is nothing to reconcile: it is gone or being deleted."""
    body = known if known is not None else cluster.get(API_VERSION, KIND, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    new = reconcile(
        body,
        cluster,
        now,
        default_image=default_image,
        operator_namespace=operator_namespace,
        hub=hub,
        gpu_prices=gpu_prices,
        capacity_classes=capacity_classes,
    )
    # A merge patch is a diff against the status as stored, not as the types read it.
    patch = merge_patch(body.get("status") or {}, new)
    # What was written, read back as the status's readers read it.
    written = InferenceServiceStatus.model_validate(new)
    variants = ((body.get("spec") or {}).get("accelerator") or {}).get("variants") or []
    any_gpu = any(isinstance(v, Mapping) and v.get("type") == ANY_GPU for v in variants)
    if patch:
        return Refreshed(cluster.patch_status(API_VERSION, KIND, namespace, name, patch), written, any_gpu)
    return Refreshed(str(body["metadata"]["resourceVersion"]), written, any_gpu)


def retry_reason(status: InferenceServiceStatus) -> tuple[str, str] | None:
    """(reason, message) when a reconcile that wrote `status` must run again later by itself:
    nothing watched will change when the way is clear (an object of someone else in the way, a
    write the API server refused, no GPU node yet)."""
    for condition in (status.condition("Ready"), status.condition("Planned")):
        if condition is not None and condition.reason in RETRIED:
            return condition.reason, condition.message or ""
    return None
