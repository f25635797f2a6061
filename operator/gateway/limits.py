"""The gateway's bounds: what one request and all of them together may hold of its memory and
time, and the counters that admit or refuse them. A refusal names the bound and says when to retry:
429 for one namespace's or service's share, 503 for the whole gateway's."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20
# Seconds a refused client is told to wait (Retry-After) before trying again.
RETRY_AFTER_SECONDS = 10


class Limits(BaseModel):
    """Defaults sized for a gateway with a 512 MiB memory limit (the chart's): bodies in memory at
    most 192 MiB in all, parsed one at a time."""

    model_config = ConfigDict(frozen=True)

    # A body over this is refused (413) from its Content-Length before a byte is read, or as soon
    # as that many (decoded) bytes arrived.
    max_body_bytes: int = Field(default=8 * MiB, gt=0)
    # Bodies of requests in the gateway (read, held or being sent), per namespace and in all.
    body_bytes_per_namespace: int = Field(default=64 * MiB, gt=0)
    body_bytes_total: int = Field(default=192 * MiB, gt=0)
    # Requests waiting for an engine (scale from zero, pods starting, engines full).
    held_per_service: int = Field(default=100, gt=0)
    held_total: int = Field(default=1000, gt=0)
    # How long a request waits for an engine before a 503 with Retry-After. Knative's activator and
    # KServe hold for their revision timeout (300 s by default); a cold replica must schedule, pull
    # and load a model, which takes about that.
    hold_seconds: float = Field(default=300.0, gt=0)
    # The whole body must arrive within this (a client sending a byte a second holds nothing long).
    body_read_seconds: float = Field(default=30.0, gt=0)
    # An idle client connection is closed after this.
    keepalive_seconds: float = Field(default=15.0, gt=0)
    # An engine that sends nothing for this long (no token, no keep-alive) is given up: 502.
    upstream_idle_seconds: float = Field(default=300.0, gt=0)
    upstream_connect_seconds: float = Field(default=5.0, gt=0)


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


@dataclass
class Admission:
    """Counts what the gateway holds against `limits`; every take is given back once."""

    limits: Limits
    body_bytes: dict[str, int] = field(default_factory=dict)
    held: dict[tuple[str, str], int] = field(default_factory=dict)

    def take_bytes(self, namespace: str, count: int) -> Refusal | None:
        limits = self.limits
        if sum(self.body_bytes.values()) + count > limits.body_bytes_total:
            return Refusal(503, f"the gateway holds {limits.body_bytes_total} bytes of request bodies, its limit")
        if self.body_bytes.get(namespace, 0) + count > limits.body_bytes_per_namespace:
            return Refusal(
                429,
                f"requests to namespace {namespace} hold {limits.body_bytes_per_namespace} bytes of "
                "bodies in the gateway, their limit",
            )
        self.body_bytes[namespace] = self.body_bytes.get(namespace, 0) + count
        return None

    def give_bytes(self, namespace: str, count: int) -> None:
        left = self.body_bytes.get(namespace, 0) - count
        if left > 0:
            self.body_bytes[namespace] = left
        else:
            self.body_bytes.pop(namespace, None)

    def hold(self, key: tuple[str, str]) -> Refusal | None:
        limits = self.limits
        if sum(self.held.values()) >= limits.held_total:
            return Refusal(503, f"the gateway holds {limits.held_total} requests waiting for engines, its limit")
        if self.held.get(key, 0) >= limits.held_per_service:
            return Refusal(
                429, f"{limits.held_per_service} requests to {'/'.join(key)} wait for an engine already, its limit"
            )
        self.held[key] = self.held.get(key, 0) + 1
        return None

    def release(self, key: tuple[str, str]) -> None:
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
