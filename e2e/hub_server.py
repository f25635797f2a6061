"""A Hugging Face Hub stand-in on 127.0.0.1: one model repository served from a local folder.

No test here may reach the real hub, so `kvpilot download` (and huggingface_hub's own
snapshot_download) are pointed at this with HF_ENDPOINT. It answers the endpoints they call, with
the hub's headers and error codes:

- `GET /api/models/{repo}[/revision/{rev}]`: model info, the resolved commit in `sha`, `siblings`
  (with `?blobs=true`: size, git blob id, LFS sha256);
- `GET /api/models/{repo}/tree/{rev}`: the file listing snapshot_download reads;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: the file, with ETag, X-Repo-Commit, Content-Length,
  X-Linked-Etag/-Size for LFS files, and byte ranges (206) for resuming;
- a token: with `token` set, a request whose Authorization is another token gets 401 "Invalid
  credentials"; a `gated` repo's files need the token (401, X-Error-Code GatedRepo), its info not.

`*.safetensors` files are served as LFS files (sha256), the rest as plain git blobs (sha1), as on the
hub. Faults for tests: `cut` (close the connection after some bytes, once), `hold` (send some bytes,
then wait for an event: the test kills the client meanwhile), `corrupt` (one byte flipped). Every
request is recorded (`requests`, `body_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from e2e.procs import LOOPBACK

_CHUNK = 1024 * 1024
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass(frozen=True)
class HubFile:
    path: str
    local: Path
    size: int
    blob_id: str  # git blob sha1 of the content, or of the LFS pointer for an LFS file
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


def _digest(local: Path, digest: Any, prefix: bytes = b"") -> str:
    digest.update(prefix)
    with local.open("rb") as f:
        while block := f.read(_CHUNK * 8):
            digest.update(block)
    return str(digest.hexdigest())


def _hub_file(root: Path, local: Path) -> HubFile:
    size = local.stat().st_size
    name = local.relative_to(root).as_posix()
    if local.suffix != ".safetensors":
        return HubFile(name, local, size, _digest(local, hashlib.sha1(), f"blob {size}\0".encode()), None)
    sha256 = _digest(local, hashlib.sha256())
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    blob = hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
    return HubFile(name, local, size, blob, sha256)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: Message  # looked up without regard to case, as HTTP headers are


@dataclass
class _Faults:
    cut: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before closing (once)
    hold: dict[str, tuple[int, threading.Event, threading.Event]] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)


class HubServer:
    """Serves `folder` as the model repository `repo` at one commit (branch `main`)."""

    def __init__(self, repo: str, folder: Path, *, token: str | None = None, gated: bool = False) -> None:
        self.repo = repo
        self.token = token
        self.gated = gated
        self.files = {f.path: f for f in (_hub_file(folder, p) for p in sorted(folder.rglob("*")) if p.is_file())}
        listing = "".join(f"{f.path} {f.blob_id}\n" for f in self.files.values())
        self.commit = hashlib.sha1(listing.encode()).hexdigest()
        self.requests: list[Request] = []
        self.body_bytes: dict[str, int] = {}  # file path -> body bytes sent
        self._faults = _Faults()
        self._releases: list[threading.Event] = []  # of every hold, so that stop() never waits on one
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((LOOPBACK, 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        for release in self._releases:
            release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Faults and records --------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the requests, the faults, the token and the gating (a server shared by tests)."""
        with self._lock:
            for release in self._releases:
                release.set()
            self.requests.clear()
            self.body_bytes.clear()
            self._faults = _Faults()
        self.token, self.gated = None, False

    def cut(self, path: str, after_bytes: int) -> None:
        """The next GET of `path` announces the whole length, sends `after_bytes`, and closes."""
        self._faults.cut[path] = after_bytes

    def hold(self, path: str, after_bytes: int) -> tuple[threading.Event, threading.Event]:
        """The next GET of `path` sends `after_bytes`, sets the first event, and waits for the
        second before it closes the connection."""
        held, release = threading.Event(), threading.Event()
        self._releases.append(release)
        self._faults.hold[path] = (after_bytes, held, release)
        return held, release

    def corrupt(self, path: str) -> None:
        """Serve `path` with its middle byte flipped, from now on."""
        self._faults.corrupt.add(path)

    def file_requests(self, path: str) -> list[Request]:
        """The GETs of `path`'s content."""
        suffix = f"/{path}"
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(suffix)]

    # HTTP ------------------------------------------------------------------------------------

    def _authorized(self, header: str | None) -> bool | None:
        """None: a token that is not ours; True: ours; False: none."""
        if header is None:
            return False
        return (self.token is not None and header == f"Bearer {self.token}") or None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test reads hub.requests instead

            def do_HEAD(self) -> None:
                self._route(body=False)

            def do_GET(self) -> None:
                self._route(body=True)

            def _route(self, body: bool) -> None:
                url = urlsplit(self.path)
                with hub._lock:
                    hub.requests.append(Request(self.command, url.path, self.headers))
                path = unquote(url.path)
                query = parse_qs(url.query)
                auth = hub._authorized(self.headers.get("Authorization"))
                if auth is None:
                    return self._error(401, "Invalid credentials in Authorization header")
                api = f"/api/models/{hub.repo}"
                if path in (api, f"{api}/") or path.startswith(f"{api}/revision/"):
                    revision = path.removeprefix(f"{api}/revision/") if "/revision/" in path else "main"
                    return self._info(revision, blobs=query.get("blobs", [""])[0].lower() == "true")
                if path.startswith(f"{api}/tree/"):
                    return self._tree(path.removeprefix(f"{api}/tree/").split("/", 1)[0])
                resolve = f"/{hub.repo}/resolve/"
                if path.startswith(resolve):
                    revision, _, name = path.removeprefix(resolve).partition("/")
                    return self._file(revision, name, body, authorized=auth)
                if path.startswith("/api/models/"):
                    return self._error(401, "Repository not found", code="RepoNotFound")
                return self._error(404, "Not found")

            def _commit(self, revision: str) -> str | None:
                return hub.commit if revision in ("main", hub.commit) else None

            def _info(self, revision: str, blobs: bool) -> None:
                commit = self._commit(revision)
                if commit is None:
                    return self._error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
                siblings = [{"rfilename": f.path} for f in hub.files.values()]
                if blobs:
                    for sibling, f in zip(siblings, hub.files.values()):
                        sibling.update({"size": f.size, "blobId": f.blob_id})
                        if f.sha256:
                            sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
                self._json(
                    {
                        "_id": commit[:24],
                        "id": hub.repo,
                        "modelId": hub.repo,
                        "sha": commit,
                        "private": False,
                        "gated": "manual" if hub.gated else False,
                        "disabled": False,
                        "tags": [],
                        "siblings": siblings,
                    }
                )

            def _tree(self, revision: str) -> None:
                if self._commit(revision) is None:
                    return self._error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
                entries = []
                for f in hub.files.values():
                    entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
                    if f.sha256:
                        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                    entries.append(entry)
                self._json(entries)

            def _file(self, revision: str, name: str, body: bool, authorized: bool) -> None:
                commit = self._commit(revision)
                if commit is None:
                    return self._error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
                if hub.gated and not authorized:
                    return self._error(
                        401,
                        f"Access to model {hub.repo} is restricted. You must have "
                        "access to it and be authenticated to access it.",
                        code="GatedRepo",
                    )
                f = hub.files.get(name)
                if f is None:
                    return self._error(404, f"Entry not found: {name}", code="EntryNotFound")
                start, end = 0, f.size - 1
                match = _RANGE.fullmatch(self.headers.get("Range", ""))
                if match:
                    start = int(match[1])
                    end = min(int(match[2]), end) if match[2] else end
                    if start >= f.size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{f.size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                self.send_response(206 if match else 200)
                if match:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
                self.send_header("Content-Length", str(end - start + 1))
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{f.etag}"')
                self.send_header("X-Repo-Commit", commit)
                if f.sha256:
                    self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                    self.send_header("X-Linked-Size", str(f.size))
                self.end_headers()
                if body:
                    self._send_content(f, start, end + 1)

            def _send_content(self, f: HubFile, start: int, stop: int) -> None:
                with hub._lock:
                    cut = hub._faults.cut.pop(f.path, None)
                    hold = hub._faults.hold.pop(f.path, None)
                    corrupt = f.path in hub._faults.corrupt
                limit = stop if cut is None else min(stop, start + cut)
                if hold is not None:
                    limit = min(limit, start + hold[0])
                flip = f.size // 2
                sent = 0
                try:
                    with f.local.open("rb") as src:
                        src.seek(start)
                        position = start
                        while position < limit:
                            chunk = bytearray(src.read(min(_CHUNK, limit - position)))
                            if corrupt and position <= flip < position + len(chunk):
                                chunk[flip - position] ^= 0xFF
                            self.wfile.write(chunk)
                            position += len(chunk)
                            sent += len(chunk)
                        self.wfile.flush()
                    if hold is not None:
                        hold[1].set()
                        hold[2].wait(timeout=120)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (or was killed): nothing to send it
                finally:
                    with hub._lock:
                        hub.body_bytes[f.path] = hub.body_bytes.get(f.path, 0) + sent
                if limit < stop:
                    self.close_connection = True

            def _json(self, value: Any) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, message: str, code: str | None = None) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        return Handler
