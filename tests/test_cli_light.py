"""What each side of the `kvpilot` command imports: the engine image needs no operator stack, the
operator image no torch and no engine code beyond its contract (engine/contract/: the flags, the
device profile's schema, the acceptance window the planner runs to predict speculation) and the
dispatcher (engine/__init__.py, engine/cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_imports import modules

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_MODULES = sorted(m for m in modules() if m.startswith("kvpilot.operator"))
# The dispatcher's two files and the whole contract package: what operator/Dockerfile copies.
DISPATCHER = ("kvpilot.engine", "kvpilot.engine.cli")
ENGINE_CONTRACT = {*DISPATCHER, *(m for m in modules() if m.startswith("kvpilot.engine.contract"))}
HEAVY = ("torch", "transformers", "fastapi")


def _imported_after(code: str) -> set[str]:
    """The modules loaded by running `code` in a fresh interpreter at the repository root.

    The root as working directory (first on sys.path under `-c`) also proves that the folder
    operator/ does not shadow the stdlib module `operator`, which nearly everything imports.
    """
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def _top(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in names)


def test_cli_parser_imports_no_heavy_engine_stack() -> None:
    loaded = _imported_after("from kvpilot.engine.cli import build_parser; build_parser()")
    assert not _top(loaded, HEAVY)


def test_serve_parser_imports_no_operator() -> None:
    loaded = _imported_after("from kvpilot.engine.cli import build_parser; build_parser('serve')")
    assert not sorted(m for m in loaded if m.startswith("kvpilot.operator"))
    assert not _top(loaded, ("kopf", "kubernetes"))


def test_download_imports_neither_torch_nor_the_operator() -> None:
    # The engine image runs it as an init container: it starts fast and needs no accelerator.
    loaded = _imported_after("from kvpilot.engine.cli import build_parser; build_parser('download')")
    assert "kvpilot.engine.tools.download" in loaded
    assert not _top(loaded, (*HEAVY, "kopf", "kubernetes"))
    assert not sorted(m for m in loaded if m.startswith("kvpilot.operator"))


def test_operator_imports_only_the_engines_contract() -> None:
    assert {"kvpilot.operator.planning.plan", "kvpilot.operator.controller.handlers"} <= set(OPERATOR_MODULES)
    imports = "; ".join(f"import {m}" for m in OPERATOR_MODULES)
    loaded = _imported_after(f"from kvpilot.engine.cli import build_parser; build_parser('plan'); {imports}")
    assert not _top(loaded, HEAVY)
    assert {m for m in loaded if m.startswith("kvpilot.engine")} <= ENGINE_CONTRACT


def test_operator_image_copies_only_the_contract() -> None:
    # No Docker here: check the Dockerfile's lines against the contract instead. setup.py finds the
    # packages that are there, so the image's wheel holds the operator, the dispatcher and contract/.
    assert {"kvpilot.engine.contract.config", "kvpilot.engine.contract.device_profile"} <= ENGINE_CONTRACT
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    dispatcher = " ".join(
        f"engine/{m.removeprefix('kvpilot.engine').lstrip('.') or '__init__'}.py" for m in sorted(DISPATCHER)
    )
    assert f"COPY {dispatcher} engine/\nCOPY engine/contract engine/contract\n" in dockerfile
    assert "COPY pyproject.toml setup.py README.md ./\n" in dockerfile
    # The engine image installs its dependencies from pyproject.toml in a layer of their own (torch's
    # gigabytes are not rebuilt for a code change), then the package from setup.py.
    engine = (ROOT / "engine" / "Dockerfile").read_text()
    assert "COPY pyproject.toml ./\n" in engine and "COPY setup.py README.md ./\n" in engine


def test_bench_serve_is_a_command_of_the_checkout() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "bench", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    assert "--concurrency" in result.stdout and "--backends" in result.stdout
