"""A model's architecture from its checkpoint on the Hub (its config.json, and its safetensors'
bytes), for a spec that gives none and names no catalog model, and the same for its draft model
(serving.draftModel): what the reconciler (with the service's token and endpoint) and `kvpilot plan`
(with HF_TOKEN and HF_ENDPOINT) read alike. A checkpoint on a claim or in the engine image is read
the same way from its folder (inspect_folder), by the inspection Job the operator runs (`kvpilot
inspect-checkpoint`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from kvpilot.operator.api.inspection import UNSUPPORTED, CheckpointInspection
from kvpilot.operator.api.spec import InferenceServiceSpec, hub_source
from kvpilot.operator.hub.client import HubClient, HubError
from kvpilot.operator.hub.safetensors import CheckpointWeights, local_weights
from kvpilot.operator.planning.choices import drafted_source, given_draft_architecture
from kvpilot.operator.planning.model_config import ModelConfig, read_config
from kvpilot.operator.planning.models import find_model


class Unreadable(NamedTuple):
    failure: str  # ModelConfigUnavailable (retried) or UnsupportedArchitecture
    message: str


def described(spec: InferenceServiceSpec) -> bool:
    """Whether the spec (model.architecture) or the catalog give the architecture: no checkpoint's
    config.json is read then, on the Hub or on a claim."""
    return spec.model.architecture is not None or find_model(spec.model.name) is not None


def model_to_read(spec: InferenceServiceSpec) -> str | None:
    """model.source when its checkpoint's config.json gives the architecture (the spec and the
    catalog do not), else None."""
    return None if described(spec) else spec.model.source


def draft_to_read(spec: InferenceServiceSpec) -> str | None:
    """serving.draftModel when a plan may run it and its checkpoint's config.json gives its
    architecture (serving.draftModelArchitecture and the catalog do not), else None."""
    source = drafted_source(spec)
    return source if source is not None and given_draft_architecture(spec) is None else None


def as_draft(read: ModelConfig | Unreadable | None) -> ModelConfig | Unreadable | None:
    """A draft's read, its refusal saying whose checkpoint it is."""
    return read._replace(message=f"serving.draftModel: {read.message}") if isinstance(read, Unreadable) else read


def read_checkpoint(
    source: str | None, hub: HubClient, token: str | None, endpoint: str | None, note: str = ""
) -> ModelConfig | Unreadable | None:
    """The config of `source`'s repository (model_to_read, draft_to_read), with its weights' bytes where
    it stores them as safetensors (None: not on a hub), or why it cannot be had (`note` is added to a
    refusal: how the token was found)."""
    repository = hub_source(source)
    if repository is None:
        return None
    try:
        config = hub.config(repository.repo, repository.revision, token, endpoint)
        read = read_config(config, f"config.json of {source}")
        if isinstance(read, str):
            return Unreadable("UnsupportedArchitecture", f"{source}: {read}")
        weights = hub.weights(repository.repo, repository.revision, token, read.architecture.layers, endpoint)
    except HubError as error:
        return Unreadable("ModelConfigUnavailable", f"{source}: {error.message}{note}")
    return with_weights(read, weights)


def with_weights(read: ModelConfig, weights: CheckpointWeights | None) -> ModelConfig:
    """`read` with its checkpoint's safetensors bytes (None: stored otherwise, not known)."""
    if weights is None:
        return read
    update = {"checkpoint_bytes": weights.total, "mtp_bytes": weights.mtp or None}
    return read._replace(architecture=read.architecture.model_copy(update=update))


def read_local(config_file: Path, source: str) -> ModelConfig | Unreadable:
    """A config.json on disk read as the Hub's is (read_config; `source` says where it is), with the
    bytes of the safetensors weights beside it, or why it cannot be read."""
    folder = config_file.parent
    try:
        config = json.loads(config_file.read_text())
        if not isinstance(config, dict):
            return Unreadable("ModelConfigUnavailable", f"{config_file} is not a JSON object")
        read = read_config(config, source)
        if isinstance(read, str):
            return Unreadable(UNSUPPORTED, f"{folder}: {read}")
        return with_weights(read, local_weights(folder, read.architecture.layers))
    except (OSError, ValueError) as error:
        return Unreadable("ModelConfigUnavailable", f"{folder}: {error}")


def inspect_folder(folder: Path) -> CheckpointInspection | Unreadable:
    """A checkpoint folder read (read_local): what `kvpilot inspect-checkpoint` reports from a claim,
    or why it cannot."""
    read = read_local(folder / "config.json", f"config.json of {folder}")
    if isinstance(read, Unreadable):
        return read
    return CheckpointInspection(architecture=read.architecture, quantization=read.quantization)


def with_checkpoint(spec: InferenceServiceSpec, checkpoint: ModelConfig | None) -> InferenceServiceSpec:
    """`spec` with the scheme its checkpoint is stored in, when the spec names none: planned and
    served as stored, as if the spec said so."""
    if checkpoint is None or not checkpoint.quantization or spec.model.quantization is not None:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"quantization": checkpoint.quantization})})
