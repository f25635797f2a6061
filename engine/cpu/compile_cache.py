"""A persistent cache of the compiled decode step: torch.compile's artifacts kept between starts.

Compiling the decode step (compiled_decode.py) takes ~30 s on 2 cores, most of it
inductor generating and building C++ kernels; inductor's own cache (its FX graph cache and the built
kernels, under TORCHINDUCTOR_CACHE_DIR) cuts that to the tracing alone when it finds them
(AOTAutograd's cache refuses the step's graph, whose weights are frozen into it). The cache it keeps
by default is in /tmp, lost with a pod, and not safe on a volume that pods share: its temporary
files are named by process id, which containers repeat. So every compile runs on a private inductor
directory of this process, and that directory is shared through a published entry of the cache root:

    <root>/<key>/            one entry per torch build, model shape and kernel path (`key_inputs`)
        manifest.json        what it was built for and every file's sha256; written last
        <inductor's files>
    <root>/.tmp-<random>/    an entry being published (renamed into place once complete)
    <root>/kernels/          not an entry: the C++ kernels engine/cpu/kernels.py builds

A start copies the entry into its private directory, checking every file against the manifest,
and compiles there; when the compile added files (a cold start, or a model or torch change),
the directory is published as the new entry: copied next to it and renamed into place, so a
reader sees a whole entry or none, and two engines publishing at once leave one whole entry.
An entry that is corrupt, from another build, or that inductor fails on is ignored with a
warning and replaced. The files are code this process runs: the root must be writable only by
those trusted to run code in the engine (the pod's own volume).
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import BaseModel, ValidationError
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from transformers import PretrainedConfig

from kvpilot.engine.model.loader import cache_root

log = logging.getLogger(__name__)

OFF = "off"
MANIFEST = "manifest.json"
FORMAT = 1
# Inductor's lock files and its temporary files (".<pid>.<thread>.tmp") are not cache content.
_NOT_CONTENT = ("locks",)

T = TypeVar("T")


class Manifest(BaseModel):
    format: int
    key: dict[str, str]
    files: dict[str, str]  # path within the entry -> sha256


def resolve_root(setting: str | None) -> Path | None:
    """The cache root for the `compile_cache_dir` setting: "off" keeps nothing; None is beside the
    models kvpilot caches ($KVPILOT_CACHE/compiled, ~/.cache/kvpilot/compiled). A pod's model
    volume is mounted read-only, so the operator names a writable folder on it instead."""
    if setting == OFF:
        return None
    if setting is not None:
        return Path(setting).expanduser()
    return cache_root() / "compiled"


def key_inputs(
    model: torch.nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device, quantization: str
) -> dict[str, str]:
    """What the compiled code depends on: the torch and Python builds, the device and the CPU's
    vector ISA, the dtype, the quantization, the model's config (its constants are inlined) and the
    names, shapes and dtypes of its weights (their values are inputs, so fine-tunes share one entry)."""
    tensors = hashlib.sha256()
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        tensors.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    config = hf_config.to_dict()
    for incidental in ("_name_or_path", "transformers_version"):
        config.pop(incidental, None)
    if device.type == "cuda":
        kernels = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
    else:
        kernels = torch.backends.cpu.get_cpu_capability()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "kernels": kernels,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "weights": tensors.hexdigest()[:16],
    }


def entry_name(key: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"torch-{key['torch']}-{digest}"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _content(folder: Path) -> list[Path]:
    return sorted(
        p.relative_to(folder)
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.relative_to(folder).parts[0] not in _NOT_CONTENT
    )


def seed(entry: Path, key: dict[str, str], work: Path) -> bool:
    """Copy the published entry into the empty folder `work`, every file checked against the
    manifest; False (and `work` emptied) when there is none or it is not usable, with a warning."""
    if not (entry / MANIFEST).is_file():
        return False
    try:
        manifest = Manifest.model_validate_json((entry / MANIFEST).read_bytes())
        if manifest.format != FORMAT or manifest.key != key:
            raise ValueError(f"built for {manifest.key}, this engine is {key}")
        for name, digest in manifest.files.items():
            target = work / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"{name!r} is outside the entry")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry / name, target)
            if _sha256(target) != digest:
                raise ValueError(f"{name} does not match its sha256 in the manifest")
    except (OSError, ValueError, ValidationError) as e:
        log.warning("event=compile_cache_ignored entry=%s reason=%r: compiling from scratch", entry, str(e))
        _empty(work)
        return False
    return True


def _empty(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


def publish(work: Path, entry: Path, key: dict[str, str]) -> None:
    """Make `work`'s content the entry: copied beside it with its manifest written last, then
    renamed into place. Whoever renames last wins; a rename that finds another new entry there
    leaves it (it holds the same compile)."""
    tmp = entry.parent / f".tmp-{uuid.uuid4().hex}"
    old = entry.parent / f".old-{uuid.uuid4().hex}"
    try:
        files: dict[str, str] = {}
        for name in _content(work):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / name, tmp / name)
            files[str(name)] = _sha256(tmp / name)
        (tmp / MANIFEST).write_text(Manifest(format=FORMAT, key=key, files=files).model_dump_json(indent=1))
        try:
            entry.rename(old)
        except FileNotFoundError:
            pass
        try:
            tmp.rename(entry)
        except OSError:  # another engine published in between: its entry stays
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def compile_with_cache(compile: Callable[[], T], root: Path | None, key: dict[str, str]) -> tuple[T, str]:
    """`compile()` run on a private inductor cache seeded from `root`'s entry for `key`, and the
    entry's state: "off" (no root), "hit" (nothing new compiled), "miss" (compiled, published) or
    "unwritable" (compiled, the root refused it). A seeded compile that fails is retried from scratch."""
    with tempfile.TemporaryDirectory(prefix="kvpilot-inductor-") as tmp:
        work = Path(tmp)
        entry = root / entry_name(key) if root is not None else None
        seeded = entry is not None and seed(entry, key, work)
        before = _content(work)
        try:
            with temporary_cache_dir(tmp):
                result = compile()
        except Exception as e:
            if not seeded:
                raise
            log.warning("event=compile_cache_ignored entry=%s reason=%r: compiling from scratch", entry, str(e))
            _empty(work)
            with temporary_cache_dir(tmp):
                result = compile()
            before = []
        if entry is None:
            return result, OFF
        if _content(work) == before:
            return result, "hit"
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            publish(work, entry, key)
        except OSError as e:
            log.warning("event=compile_cache_unwritable root=%s reason=%r: the next start compiles again", root, str(e))
            return result, "unwritable"
        return result, "miss"
