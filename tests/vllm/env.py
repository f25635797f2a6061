"""A venv holding vLLM's own parser and config builder, built once into a versioned cache outside
the repository (as e2e/build-binaries.sh does for the Kubernetes binaries).

The venv installs requirements.txt without dependency resolution and sees the project's venv after
its own site-packages (a .pth line), so it costs ~1 GB instead of vLLM's full ~7.6 GB CUDA tree.
The cache key is vLLM's version and a hash of requirements.txt and the Python version; the .pth line
is rewritten on every use, so a checkout in another place (CI's clone) still finds its own venv.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from kvpilot.operator.runtimes.vllm import VLLM_VERSION

REQUIREMENTS = Path(__file__).with_name("requirements.txt")
CACHE_ROOT = Path(
    os.environ.get("KVPILOT_CACHE_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpilot")
)
# vLLM picks its CPU platform by this (no GPU here) and never asks the hub for the synthesized models.
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}


def _key() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()
    return f"{VLLM_VERSION}-{digest[:12]}"


def _site_packages(prefix: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    return prefix / relative


def vllm_python() -> Path:
    """The venv's python, building the venv first when the cache lacks it (a few minutes)."""
    root = CACHE_ROOT / "vllm" / _key()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / ".installed"
        if not done.exists():
            print(f"[vllm-env] installing vLLM {VLLM_VERSION}'s parser and config builder into {root}", file=sys.stderr)
            venv.EnvBuilder(clear=True, with_pip=True).create(root)
            subprocess.run(
                [
                    root / "bin" / "python",
                    "-m",
                    "pip",
                    "install",
                    "--no-deps",
                    "--progress-bar",
                    "off",
                    "-r",
                    REQUIREMENTS,
                ],
                check=True,
            )
            done.touch()
        (_site_packages(root) / "zz_kvpilot_project_venv.pth").write_text(f"{_site_packages(Path(sys.prefix))}\n")
    return root / "bin" / "python"


def run(module: str, stdin: str, timeout_s: float = 1800) -> str:
    """`python -m module` of tests/vllm/ in the vLLM venv, fed `stdin`; its stdout (AssertionError
    with the end of its stderr when it fails)."""
    done = subprocess.run(
        [vllm_python(), "-m", f"tests.vllm.{module}"],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        cwd=Path(__file__).resolve().parents[2],
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"tests.vllm.{module} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout
