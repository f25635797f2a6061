"""Which headers cross the gateway, each way. Pure functions.

Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, not the request: the fixed ones and
every header the `Connection` header names are dropped, as is `Proxy-Authorization` (a credential
for this proxy, never for an engine). The request body arrives decoded (aiohttp undoes a
`Content-Encoding`), so it leaves without that header; a response passes through as the engine
encoded it, header included. `X-Forwarded-For` gains the client's address."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Set again by the client library for the body it sends.
_REQUEST_ONLY = frozenset({"host", "content-length", "content-encoding"})
_RESPONSE_ONLY = frozenset({"content-length"})


def _named_by_connection(items: Iterable[tuple[str, str]]) -> set[str]:
    return {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }


def _kept(items: Iterable[tuple[str, str]], dropped: frozenset[str]) -> list[tuple[str, str]]:
    pairs = list(items)
    drop = HOP_BY_HOP | dropped | _named_by_connection(pairs)
    return [(name, value) for name, value in pairs if name.lower() not in drop]


def upstream_request_headers(items: Iterable[tuple[str, str]], client: str | None) -> list[tuple[str, str]]:
    """The headers sent to the engine for a client request with headers `items` from `client`."""
    kept = _kept(items, _REQUEST_ONLY)
    forwarded = [value for name, value in kept if name.lower() == "x-forwarded-for"]
    kept = [(name, value) for name, value in kept if name.lower() != "x-forwarded-for"]
    chain = ", ".join([*forwarded, *([client] if client else [])])
    return [*kept, ("X-Forwarded-For", chain)] if chain else kept


def client_response_headers(items: Iterable[tuple[str, str]] | Mapping[str, str]) -> list[tuple[str, str]]:
    """The engine's response headers as the client gets them."""
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    return _kept(pairs, _RESPONSE_ONLY)
