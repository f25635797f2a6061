"""Where an engine pod holds each model source's files: the contract between the pod the operator
renders (controller/render.py mounts and downloads them there) and what loads files into a running
engine by path (autoscaling/adapters.py, the LoRA adapters)."""

from __future__ import annotations

from urllib.parse import quote

from kvpilot.operator.api.spec import PVC_SCHEME, HubSource, hub_source

# pvc://claim/path: the claim mounted read-only at /models/<claim>.
MODEL_MOUNT = "/models"
# hf://: the volume the download init containers fill, mounted read-only in the engine.
MODEL_CACHE_MOUNT = "/model-cache"


def hub_model_dir(source: HubSource) -> str:
    """The folder an hf:// download fills and the engine loads: one per repository and revision (a
    shared PVC holds several), the revision quoted so that a branch like refs/pr/1 stays one name."""
    return f"{MODEL_CACHE_MOUNT}/hf/{source.repo}@{quote(source.revision, safe='')}"


def source_path(source: str) -> str:
    """Where a source's files are in the engine container: hf:// in the download cache's folder of
    that repository and revision, pvc://claim/path under the claim's mount, a path in the image (or
    the embedded model's name) as it is."""
    hub = hub_source(source)
    if hub is not None:
        return hub_model_dir(hub)
    if source.startswith(PVC_SCHEME):
        claim, _, path = source.removeprefix(PVC_SCHEME).partition("/")
        return f"{MODEL_MOUNT}/{claim}/{path}".rstrip("/")
    return source
