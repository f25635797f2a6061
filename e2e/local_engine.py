"""A real `kvpilot serve` standing behind a kwok-simulated engine pod.

kwok gives the pod a loopback IP (e.g. 127.1.2.1) but runs nothing; this starts the engine the
operator rendered into the Deployment, with exactly its arguments, bound to that IP. Two
substitutions only: `--host` becomes the pod IP (the pod's 0.0.0.0), and `--model` becomes the
embedded model when the rendered one is a model this machine does not have (a catalog name, not
an absolute path that exists here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from e2e.procs import Process, kvpilot_executable, start_http
from kvpilot.operator.render import CONTAINER

def _set_flag(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def engine_argv(deployment: dict[str, Any], pod_ip: str) -> list[str]:
    # Imported here: the engine's model loader pulls in torch, which only this path needs.
    from kvpilot.engine.model.loader import EMBEDDED_MODEL

    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER)
    command, args = container["command"], list(container["args"])
    if command[0] != "kvpilot":
        raise ValueError(f"unexpected engine command {command}")
    _set_flag(args, "--host", pod_ip)
    model = _flag(args, "--model")
    # A path that exists here (a model "baked into the image") is used as it is.
    if model.lower() != EMBEDDED_MODEL.lower() and not (Path(model).is_absolute() and Path(model).exists()):
        _set_flag(args, "--model", EMBEDDED_MODEL)
    return [kvpilot_executable(), *command[1:], *args]


def base_url(argv: list[str]) -> str:
    """http://<host>:<port> of an engine command line."""
    return f"http://{_flag(argv, '--host')}:{_flag(argv, '--port')}"


def start_engine(deployment: dict[str, Any], pod: dict[str, Any], log: Path,
                 ready_timeout_s: float = 300.0) -> tuple[Process, str]:
    """Start the engine for `pod` and wait until it serves /ready; return it and its base URL."""
    argv = engine_argv(deployment, pod["status"]["podIP"])
    url = base_url(argv)
    process = start_http(argv, log, f"{url}/ready", ready_timeout_s, {**os.environ, "PYTHONUNBUFFERED": "1"})
    return process, url
