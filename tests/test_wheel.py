"""The wheel is what the images install (`pip install .` in engine/Dockerfile and operator/Dockerfile):
built and installed here the same way, not editable, it ships every module of both halves and the
kernels' C++ source, each module imports from the installed copy, and the `kvpilot` command runs
from it.

Every other test runs on the editable install, which finds modules in the checkout whether or not
the wheel would ship them. The throwaway environment has only the wheel of its own; the
dependencies come from this environment's site-packages, added as a plain path (its .pth files,
the editable install's finder among them, are not run), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpilot.engine.cpu.features import read_cpu_flags
from tests.test_imports import PACKAGES, modules

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", *PACKAGES)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the bin folder of an environment where it is installed)."""
    work = tmp_path_factory.mktemp("wheel")
    # What engine/Dockerfile copies, and nothing else (a build/ folder left in the checkout would
    # be packed too).
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (work / "dist").glob("kvpilot-*.whl")
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (purelib,) = env.glob("lib/python3.*/site-packages")
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert install.returncode == 0, install.stderr
    return wheel, env / "bin"


def run(bin_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A command of the throwaway environment, away from the checkout (so it is not on sys.path)."""
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=bin_dir.parent)


def test_the_wheel_ships_every_module_of_both_halves(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        shipped = {
            name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            for name in archive.namelist()
            if name.endswith(".py")
        }
    assert set(modules()) - shipped == set()


def test_the_wheel_ships_the_cpu_kernels_source(installed: tuple[Path, Path]) -> None:
    """The kernels' C++ is package data: an engine with no library cached or prebuilt builds it from
    the installed copy, and `kvpilot build-kernels` in engine/Dockerfile builds from it too."""
    from kvpilot.engine.cpu import kernels as cpu_kernels

    wheel, _ = installed
    sources = sorted(cpu_kernels.SOURCE.parent.iterdir())
    assert cpu_kernels.SOURCE in sources
    with zipfile.ZipFile(wheel) as archive:
        for source in sources:
            shipped = archive.read(f"kvpilot/engine/cpu/csrc/{source.name}")
            assert shipped == source.read_bytes(), source.name


def test_every_module_imports_from_the_installed_wheel(installed: tuple[Path, Path]) -> None:
    _, bin_dir = installed
    script = (
        "import importlib, json, sys\n"
        "where = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
        "print(json.dumps(where))"
    )
    result = run(bin_dir, "python", "-c", script, *sorted(modules()))
    assert result.returncode == 0, result.stderr
    where = json.loads(result.stdout.splitlines()[-1])
    outside = {m: f for m, f in where.items() if not f.startswith(str(bin_dir.parent))}
    assert not outside, f"imported from outside the installed wheel: {outside}"


def test_the_kvpilot_command_runs_from_the_wheel(installed: tuple[Path, Path]) -> None:
    _, bin_dir = installed
    serve = run(bin_dir, "kvpilot", "serve", "--help")
    assert serve.returncode == 0, serve.stderr
    assert "--max-num-seqs" in serve.stdout
    plan = run(bin_dir, "kvpilot", "plan", "--model", "llama-3-8b", "--gpu", "L4", "--json")
    assert plan.returncode == 0, plan.stderr
    result = json.loads(plan.stdout)
    assert result["fits"] and result["gpu"] == "L4" and result["max_num_seqs"] > 0
    # The built-in CPU profiles are package data: a wheel without them would plan no CPU.
    cpu = run(bin_dir, "kvpilot", "plan", "--model", "SmolLM2-135M-Instruct", "--device-profile", "amd-epyc-zen5-2c")
    assert cpu.returncode == 0, cpu.stderr + cpu.stdout
    assert "amd-epyc-zen5-2c" in cpu.stdout


def test_the_engine_image_ships_the_kernels_of_every_level(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """engine/Dockerfile's build step, run from the wheel: the C++ kernels of every ISA level, built
    here whatever this CPU runs, into the image's $KVPILOT_CACHE/kernels; an engine started with an
    empty compile cache then serves on its level's library from there, with no compiler run."""
    from kvpilot.engine.cpu import kernels as cpu_kernels
    from kvpilot.engine.model.loader import cache_root

    _, bin_dir = installed
    step = "kvpilot build-kernels --levels all"
    assert f"&& {step} \\\n" in (ROOT / "engine" / "Dockerfile").read_text()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models")  # the converted model, not converted again
    env = {**os.environ, "KVPILOT_CACHE": str(cache)}
    built = subprocess.run([str(bin_dir / "kvpilot"), *step.split()[1:]], env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    shipped = {path.name for path in (cache / cpu_kernels.KERNELS).iterdir()}
    assert shipped == {f"{cpu_kernels.library_name(level)}.so" for level in cpu_kernels.BUILDABLE}
    started = subprocess.run(
        [
            str(bin_dir / "kvpilot"),
            "-v",
            "generate",
            "--max-tokens",
            "4",
            "--compile-cache-dir",
            str(tmp_path / "empty"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=bin_dir.parent,
    )
    assert started.returncode == 0, started.stderr
    level = cpu_kernels.level_for(read_cpu_flags())
    assert f"event=cpu_kernels source=prebuilt level={level.name}" in started.stderr
    assert "[4 tokens" in started.stdout
