"""Local processes: the servers that tests/server, the e2e harness and the benchmarks start.

One implementation for all of them (the operator, `kvpilot serve` engines, the HF baseline):

- `free_port()`: a free TCP port on 127.0.0.1;
- `start(argv, log, ...)`: a child process whose output goes to its own log file, in its own
  session, so a terminal's Ctrl-C reaches the runner (whose teardown stops the child) rather than
  racing it;
- `start_http(argv, log, ready_url, ...)`: the same, then wait until `ready_url` answers 200;
  fail fast with the log's tail when the process exits first, and stop it when it does not come up;
- `Process.stop()`: SIGTERM (graceful: kopf leaves its peering record, engines drain), then
  SIGKILL after a grace period, by PID.

Readiness is checked with direct HTTP, never through a proxy from the environment: only loopback
is ever dialled. `Process` stops what this Python process started; `e2e.cluster.stop_pids` stops
by PID what an earlier process started (the demo).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.polling import poll

LOOPBACK = "127.0.0.1"

# Never through an HTTP proxy from the environment: only loopback is ever dialled.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ProcessError(RuntimeError):
    """A local process exited early or did not come up in time."""


def kvpilot_executable() -> str:
    """The `kvpilot` console script of the environment running this code."""
    return str(Path(sys.executable).with_name("kvpilot"))


def serve_argv(port: int, *args: str) -> list[str]:
    """`kvpilot serve` on LOOPBACK:`port` with `args`, run by this interpreter as a module (as the
    tests and benchmarks start it: no console script needed)."""
    return [sys.executable, "-m", "kvpilot.engine.cli", "serve", "--host", LOOPBACK, "--port", str(port), *args]


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when `url` answers 200 to a direct GET; False on any other status or transport error."""
    with contextlib.suppress(urllib.error.URLError, OSError):
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status == 200
    return False


@dataclass
class Process:
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def marker(self) -> str:
        """A substring of /proc/<pid>/cmdline that identifies this process (see stop_pids)."""
        return " ".join(self.argv)

    @property
    def name(self) -> str:
        """The command, short: program and first arguments (`python -m kvpilot.engine.cli serve`)."""
        return " ".join([Path(self.argv[0]).name, *self.argv[1:4]])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")
        return ""

    def log_tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return f"(no log at {self.log})"
        return "\n".join(self.log_text().splitlines()[-lines:])

    def raise_if_exited(self) -> None:
        """ProcessError with the log's tail when the process has exited."""
        if not self.alive():
            raise ProcessError(f"{self.name} exited with {self.popen.returncode} (log {self.log}):\n{self.log_tail()}")

    def wait_http_ok(self, url: str, timeout_s: float, interval_s: float = 0.5) -> None:
        """Poll `url` until it answers 200; fail fast, with the log, if the process exits."""

        def ready() -> bool:
            self.raise_if_exited()
            return http_ok(url)

        try:
            poll(ready, timeout_s, f"{url} to answer 200", interval_s)
        except TimeoutError:
            raise ProcessError(f"{url} not OK after {timeout_s:g}s (log {self.log}):\n{self.log_tail()}") from None

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; return the exit status (negative: the signal)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start(
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    cwd: Path | str | None = None,
    append: bool = True,
) -> Process:
    """Start `argv` with stdout and stderr into `log` (appended to, or truncated when not `append`),
    stdin from /dev/null, in its own session. `env` replaces the environment (None: inherit it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Process(argv=list(argv), log=log, popen=popen)


def start_http(
    argv: Sequence[str],
    log: Path,
    ready_url: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    *,
    cwd: Path | str | None = None,
    append: bool = True,
    interval_s: float = 0.5,
    grace_s: float = 20.0,
) -> Process:
    """`start`, then wait until `ready_url` answers 200. When the process exits first or does not
    come up within `timeout_s` (or the wait is interrupted), it is stopped and ProcessError (or the
    interruption) propagates."""
    process = start(argv, log, env, cwd=cwd, append=append)
    try:
        process.wait_http_ok(ready_url, timeout_s, interval_s)
    except BaseException:
        process.stop(grace_s)
        raise
    return process


def memory_kib(pid: int) -> dict[str, int]:
    """Resident (VmRSS) and peak resident (VmHWM) memory of process `pid`, in KiB (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}
