"""The shared process, port and polling helpers (e2e/procs.py, e2e/polling.py) that tests/server,
the e2e harness and the benchmarks use: a few seconds, no model, no cluster."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from e2e.polling import poll
from e2e.procs import LOOPBACK, ProcessError, free_port, http_ok, start, start_http


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind((LOOPBACK, port))


def test_poll_returns_the_first_value_other_than_none_or_false() -> None:
    values = iter([None, False, 0, "done"])
    assert poll(lambda: next(values), 5, "a value", interval_s=0.01) == 0  # 0 is a value, only None/False wait


def test_poll_times_out_naming_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the impossible"):
        poll(lambda: False, 0.2, "the impossible", interval_s=0.05)
    assert time.monotonic() - started < 2


def test_poll_propagates_a_failing_check() -> None:
    def check() -> bool:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        poll(check, 5, "never")


def test_http_server_starts_answers_and_stops(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", LOOPBACK, str(port)]
    process = start_http(argv, tmp_path / "http.log", f"http://{LOOPBACK}:{port}/", 30, cwd=tmp_path, interval_s=0.1)
    try:
        assert process.alive()
        assert os.getsid(process.pid) == process.pid, "runs in its own session"
        assert http_ok(f"http://{LOOPBACK}:{port}/")
        assert not http_ok(f"http://{LOOPBACK}:{port}/no-such-file")
    finally:
        code = process.stop(grace_s=10)
    assert code != 0 and not process.alive()  # http.server does not handle SIGTERM: killed by it
    assert not http_ok(f"http://{LOOPBACK}:{port}/")
    assert "GET /" in process.log_text()


def test_early_exit_fails_fast_with_the_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('cannot load the model', flush=True); sys.exit(3)"]
    started = time.monotonic()
    with pytest.raises(ProcessError, match=r"exited with 3[\s\S]*cannot load the model"):
        start_http(argv, tmp_path / "early.log", f"http://{LOOPBACK}:{free_port()}/ready", 60, interval_s=0.1)
    assert time.monotonic() - started < 30


def test_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    argv = [sys.executable, "-c", "import os, time; print('loading', os.getpid(), flush=True); time.sleep(60)"]
    with pytest.raises(ProcessError, match=r"not OK after 3s[\s\S]*loading"):
        start_http(argv, log, f"http://{LOOPBACK}:{free_port()}/ready", 3, interval_s=0.1, grace_s=5)
    pid = int(log.read_text().split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    process = start([sys.executable, "-c", code], log, append=False)
    try:
        poll(lambda: "ready" in process.log_text(), 30, "the SIGTERM handler", interval_s=0.05)
    except BaseException:
        process.stop(grace_s=0)
        raise
    started = time.monotonic()
    assert process.stop(grace_s=0.5) == -9
    assert time.monotonic() - started < 10
