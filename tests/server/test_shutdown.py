"""SIGTERM: readiness turns false, new work is refused, in-flight requests finish, exit 0."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import openai
import pytest

from e2e.procs import serve_argv
from tests.server.conftest import MODEL, REPO, free_port, start_server, wait_until


def test_sigterm_drains_in_flight_requests(tmp_path) -> None:
    # The key comes from the environment here (the flag is covered in test_limits).
    server = start_server(tmp_path, "--grace-period", "60", env={"KVPILOT_API_KEY": "k"}, api_key="k")
    try:
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer k"}, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
                first = json.loads(next(events))
                server.proc.send_signal(signal.SIGTERM)
                wait_until(lambda: server.http.get("/ready").status_code == 503, 10, "readiness to turn false")
                assert server.http.get("/ready").json() == {"status": "draining"}
                assert server.http.get("/health").status_code == 200
                with pytest.raises(openai.InternalServerError) as refused:
                    server.client(max_retries=0).completions.create(model=MODEL, prompt="new work", max_tokens=2)
                assert refused.value.status_code == 503
                rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [first] + [json.loads(e) for e in rest[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 12, "every token of the in-flight request was generated"
        assert server.proc.wait(timeout=30) == 0, server.log()
        assert "event=drain_done" in server.log()
    finally:
        server.terminate()


def test_model_that_cannot_load_exits_nonzero(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        serve_argv(free_port(), "--model", str(missing)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "model_load_failed" in proc.stderr and str(missing) in proc.stderr


def test_grace_period_cuts_requests_that_run_too_long(tmp_path) -> None:
    server = start_server(tmp_path, "--grace-period", "1")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
                next(events)
                server.proc.send_signal(signal.SIGTERM)
                rest = list(events)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert server.proc.wait(timeout=30) == 0, server.log()
        assert "event=drain_timeout aborted=1" in server.log()
    finally:
        server.terminate()
