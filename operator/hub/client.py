"""The operator's reads of the Hugging Face Hub: a repository's config.json at a revision.

One GET of `{endpoint}/{repo}/resolve/{revision}/config.json` (the hub's file URL, which
huggingface_hub and `kvpilot download` use too), with the service's token as a bearer token. The
endpoint is the service's HF_ENDPOINT (a mirror or an air-gapped hub) or the operator's. Configs are
kept per (endpoint, repository, revision) in a bounded cache, so a reconcile of a healthy service
costs the Hub nothing after the first; a refusal is not kept: it is asked again on the next try.
An answer the hub refuses is a HubError carrying its status and its own words, for the service's
status.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from typing import Any

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 10.0
CACHED_CONFIGS = 256
# A config.json is a few kB; anything far larger is not one.
MAX_CONFIG_BYTES = 4 * 1024**2


class HubError(Exception):
    """The hub did not give the file: `status` is its HTTP status (None: no answer at all)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _answer(error: urllib.error.HTTPError) -> str:
    """The hub's own words for a refusal: its X-Error-Message header, else the body's start."""
    words = error.headers.get("X-Error-Message")
    if not words:
        words = error.read(500).decode("utf-8", "replace").strip()
    return f"{error.code} {error.reason}" + (f": {words}" if words else "")


class HubClient:
    def __init__(self, default_endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = TIMEOUT_S) -> None:
        self.default_endpoint, self.timeout_s = default_endpoint.rstrip("/"), timeout_s
        self._configs: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()  # reconciles of several services run in threads

    def config(self, repo: str, revision: str, token: str | None, endpoint: str | None = None) -> dict[str, Any]:
        """The repository's config.json at `revision`; HubError when the hub does not give it."""
        base = (endpoint or self.default_endpoint).rstrip("/")
        key = (base, repo, revision)
        with self._lock:
            if key in self._configs:
                self._configs.move_to_end(key)
                return self._configs[key]
        config = self._fetch(base, repo, revision, token)
        with self._lock:
            self._configs[key] = config
            while len(self._configs) > CACHED_CONFIGS:
                self._configs.popitem(last=False)
        return config

    def _fetch(self, base: str, repo: str, revision: str, token: str | None) -> dict[str, Any]:
        if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
            raise HubError(None, f"the hub endpoint {base!r} is not an http(s) URL")
        url = f"{base}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/config.json"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - the scheme is checked above
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - likewise
                body = response.read(MAX_CONFIG_BYTES + 1)
        except urllib.error.HTTPError as error:
            raise HubError(error.code, f"{url}: {_answer(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            raise HubError(None, f"{url}: no answer: {getattr(error, 'reason', error)}") from None
        if len(body) > MAX_CONFIG_BYTES:
            raise HubError(None, f"{url}: over {MAX_CONFIG_BYTES} bytes, not a config.json")
        try:
            config = json.loads(body)
        except ValueError as error:
            raise HubError(None, f"{url}: not JSON: {error}") from None
        if not isinstance(config, dict):
            raise HubError(None, f"{url}: not a JSON object")
        return config
