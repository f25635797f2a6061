"""The real gateway in a process of its own over fixed indexes (a JSON file), for the tests that
measure its memory or stop it with SIGTERM:
`python -m tests.operator.gateway.standalone PORT INDEXES.json LIMITS.json DRAIN_SECONDS`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from kvpilot.operator.gateway.limits import Limits
from kvpilot.operator.gateway.main import serve_until_stopped
from kvpilot.operator.gateway.server import Gateway


class NoScaler:
    def write_replicas(self, body: Any, replicas: int, event: Any, resource_version: str | None = None) -> None:
        raise AssertionError("no scale write expected")


def main() -> None:
    port, indexes_path, limits_path, drain = sys.argv[1:5]
    saved = json.loads(Path(indexes_path).read_text())
    indexes = [
        {tuple(key): values for key, values in saved[kind]}
        for kind in ("services", "deployments", "replicasets", "pods")
    ]
    limits = Limits.model_validate_json(Path(limits_path).read_text())
    gateway = Gateway(*indexes, NoScaler(), limits)
    asyncio.run(serve_until_stopped(gateway, "127.0.0.1", int(port), float(drain)))


if __name__ == "__main__":
    main()
