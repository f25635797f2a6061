"""The operator's reads of the Hugging Face Hub: a repository's config.json at a revision, and the
bytes of its safetensors weights.

Files are read at `{endpoint}/{repo}/resolve/{revision}/{file}` (the hub's file URL, which
huggingface_hub and `kvpilot download` use too), with the service's token as a bearer token. The
endpoint is the service's HF_ENDPOINT (a mirror or an air-gapped hub) or the operator's. The weights'
bytes are the sharded checkpoint's `model.safetensors.index.json` `metadata.total_size`, else the
single `model.safetensors` file's header (its first 8 bytes give the header's length, the header
every tensor's byte range), read with two range requests as huggingface_hub's
get_safetensors_metadata does: never the weights themselves. Of them, the multi-token-prediction
modules' (which vLLM does not load to serve the model) are summed from the headers of the shards the
index puts them in, read the same way: one shard for DeepSeek-V3, none for most models. Answers are kept per (endpoint,
repository, revision) in a bounded cache, so a reconcile of a healthy service costs the Hub nothing
after the first; a refusal is not kept: it is asked again on the next try. An answer the hub refuses
is a HubError carrying its status and its own words, for the service's status.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from kvpilot.operator.hub import safetensors
from kvpilot.operator.hub.safetensors import INDEX_FILE, SINGLE_FILE, CheckpointWeights

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 10.0
CACHED_ANSWERS = 512
# A config.json or a safetensors index is at most a few MB; anything far larger is not one.
MAX_JSON_BYTES = 16 * 1024**2


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


class _Repository(NamedTuple):
    base: str
    repo: str
    revision: str
    token: str | None

    def url(self, name: str) -> str:
        return f"{self.base}/{self.repo}/resolve/{urllib.parse.quote(self.revision, safe='')}/{name}"


class HubClient:
    def __init__(self, default_endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = TIMEOUT_S) -> None:
        self.default_endpoint, self.timeout_s = default_endpoint.rstrip("/"), timeout_s
        self._answers: OrderedDict[tuple[str, str, str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # reconciles of several services run in threads

    def config(self, repo: str, revision: str, token: str | None, endpoint: str | None = None) -> dict[str, Any]:
        """The repository's config.json at `revision`; HubError when the hub does not give it."""
        where = self._repository(repo, revision, token, endpoint)
        return self._kept("config", where, lambda: self._json(where, "config.json"))  # type: ignore[no-any-return]

    def weights(
        self, repo: str, revision: str, token: str | None, layers: int, endpoint: str | None = None
    ) -> CheckpointWeights | None:
        """The bytes of the repository's safetensors weights at `revision`, of a model of `layers`
        decoder layers (module docstring); None when it has neither an index nor a single
        model.safetensors (weights in another format); HubError when the hub refuses otherwise."""
        where = self._repository(repo, revision, token, endpoint)
        return self._kept(f"weights of {layers} layers", where, lambda: self._weights(where, layers))  # type: ignore[no-any-return]

    def _repository(self, repo: str, revision: str, token: str | None, endpoint: str | None) -> _Repository:
        base = (endpoint or self.default_endpoint).rstrip("/")
        if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
            raise HubError(None, f"the hub endpoint {base!r} is not an http(s) URL")
        return _Repository(base, repo, revision, token)

    def _kept(self, kind: str, where: _Repository, fetch: Callable[[], Any]) -> Any:
        key = (kind, where.base, where.repo, where.revision)
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
        answer = fetch()
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > CACHED_ANSWERS:
                self._answers.popitem(last=False)
        return answer

    def _weights(self, where: _Repository, layers: int) -> CheckpointWeights | None:
        try:
            index = self._json(where, INDEX_FILE)
        except HubError as error:
            if error.status != 404:
                raise
            return self._single_file_weights(where, layers)
        try:
            return safetensors.index_weights(index, layers, lambda shard: self._header(where, shard))
        except ValueError as error:
            raise HubError(None, f"{where.url(INDEX_FILE)}: {error}") from None

    def _single_file_weights(self, where: _Repository, layers: int) -> CheckpointWeights | None:
        """A single model.safetensors' weights, from its header; None without one."""
        try:
            header = self._header(where, SINGLE_FILE)
        except HubError as error:
            if error.status == 404:
                return None
            raise
        try:
            return safetensors.header_weights(header, layers)
        except ValueError as error:
            raise HubError(None, f"{where.url(SINGLE_FILE)}: {error}") from None

    def _header(self, where: _Repository, name: str) -> dict[str, Any]:
        """A safetensors file's header, by two range requests: its length, then the header."""
        first = self._get(where, name, 8, start=0)
        try:
            length = safetensors.header_length(first)
        except ValueError as error:
            raise HubError(None, f"{where.url(name)}: {error}") from None
        return _parsed(where.url(name), self._get(where, name, length, start=8))

    def _json(self, where: _Repository, name: str) -> dict[str, Any]:
        return _parsed(where.url(name), self._get(where, name, MAX_JSON_BYTES))

    def _get(self, where: _Repository, name: str, most: int, start: int | None = None) -> bytes:
        """At most `most` bytes of a file; with `start`, exactly the `most` bytes from there (a range)."""
        url = where.url(name)
        headers = {"Authorization": f"Bearer {where.token}"} if where.token else {}
        if start is not None:
            headers["Range"] = f"bytes={start}-{start + most - 1}"
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - _repository checks the scheme
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - likewise
                # A server that ignores the range sends the whole file (200): skip to the range's start.
                skip = start if start is not None and response.status == 200 else 0
                body = response.read(skip + most + 1)[skip:]
        except urllib.error.HTTPError as error:
            raise HubError(error.code, f"{url}: {_answer(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            raise HubError(None, f"{url}: no answer: {getattr(error, 'reason', error)}") from None
        if start is None and len(body) > most:
            raise HubError(None, f"{url}: over {most} bytes, not a {name}")
        if start is not None and len(body) < most:
            raise HubError(None, f"{url}: {len(body)} bytes where {most} were asked")
        return body[:most]


def _parsed(url: str, body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError as error:
        raise HubError(None, f"{url}: not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise HubError(None, f"{url}: not a JSON object")
    return parsed
