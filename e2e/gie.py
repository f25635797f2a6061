"""The Gateway API Inference Extension's CRDs as its published Go module ships them.

The module is downloaded once through the Go module proxy (`go mod download`, which checks it against
the checksum database) into kvpilot's Go module cache, the one e2e/build-binaries.sh fills, and its
hash is checked against the pin below. Later runs read the cached copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

MODULE = "sigs.k8s.io/gateway-api-inference-extension"
VERSION = "v1.3.0"
# go.sum's hash of the module at VERSION: anything else the proxy or the cache holds fails loudly.
SUM = "h1:Ng2Qs1Oum4WycuWyi3rOkAC7pZ2aDqgN2ku6Lr/mryQ="
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


class GIEError(RuntimeError):
    """The extension's module could not be downloaded, or is not the pinned one."""


def _go() -> str:
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK):
        raise GIEError("no Go toolchain found (set GO=/path/to/go): the e2e tests fetch the extension's CRDs with it")
    return go


def _cache_root() -> Path:
    """build-binaries.sh's cache root, so both share one Go module cache."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or Path(xdg) / "kvpilot")


def module_dir(timeout_s: float = 600.0) -> Path:
    """The extracted module at VERSION, downloaded first if the cache lacks it."""
    go_dir = _cache_root() / "go"
    env = {
        **os.environ,
        "GOPATH": str(go_dir),
        "GOMODCACHE": str(go_dir / "mod"),
        "GOTOOLCHAIN": "local",
        # Outside any module: `go mod download` fetches the one module, with no build flags.
        "GOFLAGS": "",
        "GO111MODULE": "on",
    }
    argv = [_go(), "mod", "download", "-json", f"{MODULE}@{VERSION}"]
    go_dir.mkdir(parents=True, exist_ok=True)
    try:
        # In the cache, which holds no go.mod: the download changes no module's go.sum.
        proc = subprocess.run(argv, cwd=go_dir, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise GIEError(f"timed out after {timeout_s:.0f}s: {' '.join(argv)}") from exc
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError:
        info = {}
    if proc.returncode != 0 or "Error" in info or not info.get("Dir"):
        detail = info.get("Error") or proc.stderr.strip() or proc.stdout.strip()
        raise GIEError(f"exit {proc.returncode}: {' '.join(argv)}: {detail}")
    if info.get("Sum") != SUM:
        raise GIEError(f"{MODULE}@{VERSION} has hash {info.get('Sum')}, not the pinned {SUM}")
    return Path(info["Dir"])


def inference_pool_crd() -> dict[str, Any]:
    """The InferencePool CRD (inference.networking.k8s.io) of the pinned release."""
    crd: dict[str, Any] = yaml.safe_load((module_dir() / INFERENCE_POOL_CRD).read_text())
    return crd
