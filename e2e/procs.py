"""Local processes the harness runs beside the cluster: the operator and `kvpilot serve` engines.

Each writes to its own log file and runs in its own session, so a terminal's Ctrl-C reaches the
test runner (whose teardown stops them) rather than racing it. `Process` stops what this Python
process started; `e2e.cluster.stop_pids` stops by PID what an earlier process started (the demo).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


# Never through an HTTP proxy from the environment: only loopback is ever dialled.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ProcessError(RuntimeError):
    """A local process exited early or did not come up in time."""


def kvpilot_executable() -> str:
    """The `kvpilot` console script of the environment running this code."""
    return str(Path(sys.executable).with_name("kvpilot"))


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

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return f"(no log at {self.log})"

    def wait_http_ok(self, url: str, timeout_s: float) -> None:
        """Poll `url` until it answers 200; fail fast, with the log, if the process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ProcessError(f"{self.argv[1:3]} exited with {self.popen.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with _DIRECT.open(url, timeout=2) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ProcessError(f"{url} not OK after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM (graceful: kopf leaves its peering record, engines drain), then SIGKILL."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start(argv: Sequence[str], log: Path, env: Mapping[str, str]) -> Process:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    return Process(argv=list(argv), log=log, popen=popen)
