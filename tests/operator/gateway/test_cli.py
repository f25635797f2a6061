"""`kvpilot gateway`: its flags are the bounds of gateway/limits.py, and a start it cannot make
is a message and exit status 2, not a stack trace."""

from __future__ import annotations

import argparse
import os
import subprocess

from e2e.procs import kvpilot_executable
from kvpilot.operator import cli
from kvpilot.operator.gateway.limits import Limits


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["gateway", *argv])


def test_every_bound_is_a_flag_with_the_models_default() -> None:
    args = parse("--listen", "127.0.0.1:9000", "--hold-seconds", "30", "--max-body-bytes", "1024")
    assert args.listen == ("127.0.0.1", 9000)
    chosen = {name: getattr(args, name) for name in Limits.model_fields}
    assert Limits.model_validate(chosen) == Limits(hold_seconds=30, max_body_bytes=1024)


def test_bad_bounds_and_missing_credentials_are_messages() -> None:
    env = {**os.environ, "KUBECONFIG": "/nonexistent"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    for argv, expected in (
        (["--max-body-bytes", "0"], "max_body_bytes"),
        (["--listen", "127.0.0.1:0"], "no credentials for the Kubernetes API"),
    ):
        done = subprocess.run(
            [kvpilot_executable(), "gateway", *argv], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
