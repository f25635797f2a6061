"""Real `kvpilot serve` processes on 127.0.0.1, and the offline engine as the reference."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.polling import poll
from e2e.procs import LOOPBACK, Process, free_port, serve_argv, start_http
from kvpilot.engine import LLM

__all__ = ["DTYPE", "KV_BYTES", "MODEL", "REPO", "Server", "free_port", "start_server", "wait_until"]

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[2]
# Small pools keep startup and memory low; 128 MiB is 182 blocks of 16 tokens for this model.
KV_BYTES = 128 << 20
# The server is compared with the offline engine token for token, and both with HF's fp32 model.
DTYPE = "float32"
STARTUP_TIMEOUT_S = 90.0


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `condition` until it holds; fail the test with `what` at the deadline."""
    try:
        poll(condition, timeout, what, interval_s=interval)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None


@dataclass
class Server:
    """A `kvpilot serve` child process (the shared e2e.procs.Process) and clients for it."""

    process: Process
    port: int
    api_key: str | None = None
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        # Direct: never through a proxy from the environment, only loopback is dialled.
        self.http = httpx.Client(base_url=self.base_url, timeout=60, trust_env=False)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.popen

    @property
    def log_path(self) -> Path:
        return self.process.log

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("http_client", openai.DefaultHttpxClient(trust_env=False))
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", timeout=120, **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("http_client", openai.DefaultAsyncHttpxClient(trust_env=False))
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", timeout=120, **kwargs
        )

    def log(self) -> str:
        return self.process.log_text()

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample on /metrics, keyed by (sample name, labels)."""
        text = self.http.get("/metrics").text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        labels = {"model": MODEL, **labels} if not name.startswith("vllm:") else {"model_name": MODEL, **labels}
        return self.metrics()[(name, frozenset(labels.items()))]

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; the exit status (0: drained and exited cleanly)."""
        try:
            return self.process.stop(grace_s=timeout)
        finally:
            self.http.close()


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> Server:
    """`kvpilot serve` on a free loopback port with a small KV pool, once it answers /ready."""
    port = free_port()
    cmd = serve_argv(port, "--kv-cache-memory-bytes", str(KV_BYTES), "--dtype", DTYPE, *args)
    process = start_http(
        cmd,
        tmp_path / f"serve-{port}.log",
        f"http://{LOOPBACK}:{port}/ready",
        STARTUP_TIMEOUT_S,
        {**os.environ, **(env or {})},
        cwd=REPO,
        interval_s=0.2,
    )
    return Server(process, port, api_key)


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
    return LLM(kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE)
