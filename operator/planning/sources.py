"""model.source where the spec leaves it unset and the runtime loads only the files the pod has
(vLLM, offline in the pod; our engine, which carries only its embedded model): the Hub repository
model.name stands for, downloaded by the init container like any hf:// source, as `vllm serve
org/repo` would fetch it. The reconciler and the CLI both read specs through `with_model_source`,
so the plan (a download's bytes and time), the pod and `kvpilot render` agree."""

from __future__ import annotations

from kvpilot.operator.api.spec import HF_SCHEME, InferenceServiceSpec
from kvpilot.operator.planning.models import hub_repo
from kvpilot.operator.runtimes import RUNTIMES

MODEL_SOURCE_REQUIRED = "ModelSourceRequired"


def _needs_files(spec: InferenceServiceSpec) -> bool:
    """Whether the pod must be given the model's files: no model.source, and model.name is no model
    the runtime's image carries."""
    builtin = {name.lower() for name in RUNTIMES[spec.runtime].builtin_models}
    return spec.model.source is None and spec.model.name.lower() not in builtin


def with_model_source(spec: InferenceServiceSpec) -> InferenceServiceSpec:
    """`spec` with model.source set to hf://<repo> where the runtime needs files and model.name
    stands for a Hub repository (hub_repo); else `spec` as it is."""
    if not _needs_files(spec):
        return spec
    repo = hub_repo(spec.model.name)
    if repo is None:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"source": HF_SCHEME + repo})})


def missing_source(spec: InferenceServiceSpec) -> str | None:
    """Why the runtime would start with nothing to load (a spec read through with_model_source):
    model.source unset and model.name no repository; None when it has files."""
    if not _needs_files(spec):
        return None
    return (
        f"runtime {spec.runtime} loads the files the pod has, and model.name {spec.model.name!r} is neither a "
        "catalog model nor a Hub repository (org/repo): set model.source (hf://org/repo, pvc://claim/path, or a "
        "path in spec.image)"
    )
