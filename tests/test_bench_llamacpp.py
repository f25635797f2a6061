"""The llama.cpp peer of the serving benchmark: where its build is cached, how it is built and how
llama-server is started. Cheap: the build's commands are recorded, not run (a real build takes ~8
minutes on 2 cores), and no llama-server is started."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import tarfile
from pathlib import Path

import pytest

from bench import llamacpp, serve


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVPILOT_CACHE", str(tmp_path))
    return tmp_path


def test_cache_is_versioned_under_kvpilot_cache(cache: Path) -> None:
    assert llamacpp.cache_dir("0.3.36") == cache / "llamacpp" / "0.3.36"
    assert llamacpp.server_binary("0.3.35") == cache / "llamacpp" / "0.3.35" / "bin" / "llama-server"
    assert llamacpp.cache_dir() == cache / "llamacpp" / llamacpp.DEFAULT_VERSION
    for bad in ("", "../x", ".."):
        with pytest.raises(ValueError):
            llamacpp.cache_dir(bad)


def test_configure_builds_the_server_natively_and_downloads_nothing() -> None:
    args = llamacpp.cmake_configure_args(Path("/s"), Path("/b"), "Ninja")
    assert args[:6] == ["-G", "Ninja", "-S", "/s", "-B", "/b"]
    for flag in ("-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert flag in args
    assert "-G" not in llamacpp.cmake_configure_args(Path("/s"), Path("/b"), None)
    assert llamacpp.cmake_build_args(Path("/b"), 2) == ["--build", "/b", "--target", "llama-server", "-j", "2"]


def _fake_sdist(path: Path, version: str) -> None:
    path.parent.mkdir(parents=True)
    with tarfile.open(path, "w:gz") as tar:
        for name in (
            f"llama_cpp_python-{version}/vendor/llama.cpp/CMakeLists.txt",
            f"llama_cpp_python-{version}/setup.py",
        ):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"#\n"))


def test_build_runs_niced_once_and_then_reuses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = "9.9.9"
    root = cache / "llamacpp" / version
    _fake_sdist(root / "sdist" / f"llama_cpp_python-{version}.tar.gz", version)  # present: pip is not called
    commands: list[list[str]] = []

    def fake_run(argv: list[str]) -> None:
        commands.append(argv)
        if "--build" in argv:  # the build step leaves the binary where cmake puts it
            built = root / "build" / "bin" / "llama-server"
            built.parent.mkdir(parents=True, exist_ok=True)
            built.write_text("binary")

    monkeypatch.setattr(llamacpp, "_run", fake_run)
    binary = llamacpp.build(version, jobs=2)

    assert binary == root / "bin" / "llama-server" and binary.read_text() == "binary"
    source = root / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    assert (source / "CMakeLists.txt").is_file()
    assert not (root / "src" / f"llama_cpp_python-{version}" / "setup.py").exists()  # only the vendored sources
    configure, compile_ = commands
    for argv in commands:
        assert argv[:3] == ["nice", "-n", "19"]
    assert ["-S", str(source), "-B", str(root / "build")] == configure[
        configure.index("-S") : configure.index("-S") + 4
    ]
    assert compile_[-4:] == ["--target", "llama-server", "-j", "2"]

    commands.clear()
    assert llamacpp.build(version) == binary
    assert commands == []  # cached: nothing configured or compiled again


def test_an_interrupted_build_is_not_taken_for_a_finished_one(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = "9.9.8"
    root = cache / "llamacpp" / version
    _fake_sdist(root / "sdist" / f"llama_cpp_python-{version}.tar.gz", version)
    (root / "build" / "bin").mkdir(parents=True)  # a build folder without its product: resumed, not reused
    commands: list[list[str]] = []
    monkeypatch.setattr(llamacpp, "_run", commands.append)
    with pytest.raises(RuntimeError, match="without"):
        llamacpp.build(version)
    assert len(commands) == 2 and not llamacpp.server_binary(version).exists()


def test_the_model_is_the_embedded_gguf() -> None:
    gguf = llamacpp.embedded_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"


def _args(*argv: str) -> argparse.Namespace:
    return serve.build_parser().parse_args(list(argv))


def test_llamacpp_backend_command_serves_the_same_model_on_loopback(cache: Path) -> None:
    args = _args("--backends", "kvpilot,llamacpp", "--llamacpp-version", "1.2.3")
    with pytest.raises(ValueError, match="bench.llamacpp build --version 1.2.3"):
        serve.backend_command("llamacpp", 8123, args)
    binary = llamacpp.server_binary("1.2.3")
    binary.parent.mkdir(parents=True)
    binary.write_text("")

    argv, ready = serve.backend_command("llamacpp", 8123, args)

    assert ready == "/health"
    assert argv[0] == str(binary)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("-m") == str(llamacpp.embedded_gguf())
    assert (value("--host"), value("--port")) == ("127.0.0.1", "8123")
    assert (value("-t"), value("-tb"), value("-np")) == ("2", "2", "64")
    assert "-cb" in argv and "--kv-unified" in argv
    assert int(value("-c")) >= 64 * 256  # every slot can hold a benchmark request at once


def test_default_backends_and_the_others_commands_are_unchanged() -> None:
    args = _args("--server-args", "--max-num-seqs 8")
    assert args.backends == "kvpilot,hf"
    argv, ready = serve.backend_command("kvpilot", 8000, args)
    assert ready == "/ready" and argv[-6:] == ["--host", "127.0.0.1", "--port", "8000", "--max-num-seqs", "8"]
    argv, ready = serve.backend_command("hf", 8001, args)
    assert ready == "/health" and argv[-5:] == ["bench.hf_server", "--host", "127.0.0.1", "--port", "8001"]
    with pytest.raises(ValueError, match="unknown backend"):
        serve.backend_command("vllm", 8002, args)


def test_only_chunks_with_text_count_as_tokens() -> None:
    """The same rule for every backend: llama-server's closing chunk (finish reason, no text) and the
    usage chunk are no token arrivals; kvpilot's last token with its finish reason is one."""
    assert serve.carries_tokens({"choices": [{"text": " by", "index": 0, "finish_reason": None}]})
    assert serve.carries_tokens({"choices": [{"text": " radius", "index": 0, "finish_reason": "length"}]})
    assert not serve.carries_tokens(
        {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 5}}
    )
    assert not serve.carries_tokens({"choices": [], "usage": {"completion_tokens": 5}})


def test_a_request_whose_connection_closed_unanswered_is_sent_once_more() -> None:
    """llama-server now and then closes a connection without answering; the benchmark sends that
    request again once (as the openai client does) and counts it, but never a second time."""

    async def scenario(unanswered: int) -> serve.RequestResult:
        import httpx

        connections = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            await reader.readexactly(length)
            if connections <= unanswered:
                writer.close()
                return
            events = b"".join(
                b"data: " + json.dumps(chunk).encode() + b"\n\n"
                for chunk in (
                    {"choices": [{"text": " a", "index": 0}]},
                    {"choices": [{"text": " b", "index": 0}]},
                    {"choices": [], "usage": {"completion_tokens": 2}},
                )
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(events), events)
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(timeout=10, trust_env=False) as client:
            return await serve._one(client, f"http://127.0.0.1:{port}/v1/completions", "m", serve.WorkItem([5, 6], 2))

    once = asyncio.run(scenario(unanswered=1))
    assert once.ok and once.resent == 1 and once.output_tokens == 2 and len(once.itl) == 1
    assert asyncio.run(scenario(unanswered=0)).resent == 0
    twice = asyncio.run(scenario(unanswered=2))
    assert not twice.ok and "RemoteProtocolError" in twice.error
    summary = serve.summarize(1.0, [once, twice], 1.0, 1.0, 1.0)
    assert summary["resent"] == 1 and summary["failed"] == 1
