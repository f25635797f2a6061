"""Which requests the gateway lets in: a service whose status carries the digest of its API key
(status.auth.apiKeySha256, names.API_KEY_SHA256) takes only requests whose bearer token hashes to
it. The gateway holds no key and reads no Secret: a digest of a random key tells its reader nothing.

Checked twice: before the body is read, against the namespace (a request no service of it would
take goes no further), and once routed, against the service (before any wake). Pure functions."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.operator.api.status import status_of


def token_digest(authorization: str | None) -> str | None:
    """The SHA-256 (hex) of a `Bearer <token>` header's token (None: no bearer token)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).hexdigest()


def key_digest(service: Mapping[str, Any]) -> str | None:
    """The digest `service` asks for (None: it asks for none)."""
    auth = status_of(service).auth
    return auth.api_key_sha256 if auth and auth.api_key_sha256 else None


def admits(service: Mapping[str, Any], digest: str | None) -> bool:
    wanted = key_digest(service)
    return wanted is None or (digest is not None and hmac.compare_digest(wanted, digest))


def namespace_admits(namespace: str, services: Sequence[Mapping[str, Any]], digest: str | None) -> bool:
    """Whether some service of `namespace` would take a request with this token."""
    return any(admits(s, digest) for s in services if s["metadata"]["namespace"] == namespace)
