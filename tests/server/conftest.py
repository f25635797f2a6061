"""Real `kvpilot serve` processes on 127.0.0.1, and the offline engine as the reference."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import LLM

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[2]
# Small pools keep startup and memory low; 128 MiB is 182 blocks of 16 tokens for this model.
KV_BYTES = 128 << 20
STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `condition` until it holds; fail the test with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    api_key: str | None = None
    log_path: Path | None = None
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url, timeout=60)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", timeout=120, **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", timeout=120, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample on /metrics, keyed by (sample name, labels)."""
        text = self.http.get("/metrics").text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        labels = {"model": MODEL, **labels} if not name.startswith("vllm:") else {"model_name": MODEL, **labels}
        return self.metrics()[(name, frozenset(labels.items()))]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.http.close()


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> Server:
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "kvpilot.engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-memory-bytes", str(KV_BYTES), *args]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, port, api_key, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"kvpilot serve exited with {proc.returncode}:\n{server.log()}")
        try:
            return server.http.get("/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, STARTUP_TIMEOUT_S, "/ready", interval=0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The main server: default limits, no API key."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    code = srv.terminate()
    assert code == 0, f"kvpilot serve exited with {code} on SIGTERM:\n{srv.log()}"


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The offline engine in this process: the reference for what the server must answer."""
    return LLM(kv_cache_memory_bytes=KV_BYTES)
