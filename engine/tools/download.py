"""`kvpilot download`: a model repository from the Hugging Face Hub into a local folder.

An engine pod whose InferenceService has an `hf://` source runs this as its init container
(operator/controller/render.py renders it), into a cache volume the engine then reads. A pod restarts at any
moment, so the download must resume, verify and not repeat:

- partial files stay in the target folder, named by the content they will hold, and the next run
  continues them with a Range request (huggingface_hub 2.4's snapshot_download deletes a partial
  file when its process dies, so a pod killed mid-download would start every unfinished file over);
- every file is checked against the hub's hash before it is moved into place: an LFS file's sha256,
  or a small file's git blob sha1 (snapshot_download checks sizes only);
- a marker keyed by the resolved commit is written last; a run that finds it, with every file at its
  recorded size, downloads nothing (and asks the hub nothing when the revision is a commit, or when
  the hub cannot be reached).

The hub protocol itself (headers and token, error types, resuming a dropped stream within a run) is
huggingface_hub's. Layout of the target folder:

    <files of the repository>      moved into place once verified
    .kvpilot/complete.json         the marker: repo, revision, commit, {path: size}; written last
    .kvpilot/partial/<hash>        files being downloaded
    .kvpilot/lock                  one downloader per folder (replicas sharing a PVC)
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import hf_hub_url, http_get
from huggingface_hub.utils import build_hf_headers, disable_progress_bars
from pydantic import BaseModel

from kvpilot.engine.cli import COMMANDS

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
# What the engine loads from a model folder (config, safetensors weights, tokenizer, chat
# template), at the top of the repository: repositories often also carry .bin/.pth/.gguf/ONNX
# copies of the same weights, which would multiply the download.
DEFAULT_INCLUDE = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt")
STATE_DIR = ".kvpilot"
MARKER = "complete.json"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HASH_BLOCK = 8 * 1024 * 1024


class DownloadError(RuntimeError):
    """A download that cannot complete, with a message for the pod's log."""


class HubFile(BaseModel):
    """One file of the repository at the resolved commit, as the hub describes it."""

    path: str
    size: int
    blob_id: str  # the git blob sha1 (of the LFS pointer, for an LFS file)
    sha256: str | None = None  # LFS files: the content's sha256

    @property
    def partial_name(self) -> str:
        return self.sha256 or self.blob_id


class Marker(BaseModel):
    repo: str
    revision: str
    commit: str
    files: dict[str, int]


def content_problem(path: Path, file: HubFile) -> str | None:
    """Why the file at `path` is not `file` (None: it is): wrong size, or a hash that differs."""
    size = path.stat().st_size
    if size != file.size:
        return f"size {size}, expected {file.size}"
    if file.sha256 is not None:
        digest, kind, want = hashlib.sha256(), "sha256", file.sha256
    else:
        # A git blob id is the sha1 of "blob <size>\0" followed by the content.
        digest, kind, want = hashlib.sha1(f"blob {size}\0".encode()), "git blob sha1", file.blob_id
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return None if digest.hexdigest() == want else f"{kind} {digest.hexdigest()}, expected {want}"


def wanted(path: str, include: Sequence[str]) -> bool:
    return "/" not in path and any(fnmatch.fnmatchcase(path, pattern) for pattern in include)


def _read_marker(state: Path) -> Marker | None:
    try:
        return Marker.model_validate_json((state / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _complete(marker: Marker | None, local_dir: Path, repo: str, revision: str) -> bool:
    """The marker is for this repo and revision (or names it as its commit), and every file it
    lists has its recorded size (a file truncated or deleted since, say on a shared PVC, sends the
    run back to the hub)."""
    if marker is None or marker.repo != repo or revision not in (marker.revision, marker.commit):
        return False
    for name, size in marker.files.items():
        try:
            if (local_dir / name).stat().st_size != size:
                log.warning("%s: not at its recorded size %d: checking every file again", name, size)
                return False
        except OSError:
            log.warning("%s: missing: checking every file again", name)
            return False
    return True


@contextmanager
def _locked(state: Path) -> Iterator[None]:
    with (state / "lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another download into this folder is running: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _resolve(api: HfApi, repo: str, revision: str, include: Sequence[str]) -> tuple[str, list[HubFile]]:
    """The commit `revision` names, and the wanted files there with their sizes and hashes."""
    info = api.model_info(repo, revision=revision, files_metadata=True)
    if info.sha is None or info.siblings is None:
        raise DownloadError(f"the hub's answer for {repo}@{revision} has no commit or file list")
    if not any(wanted(s.rfilename, ("*.safetensors",)) for s in info.siblings):
        raise DownloadError(
            f"{repo}@{revision} has no *.safetensors weights at its top level: the engine loads only safetensors"
        )
    files = []
    for s in info.siblings:
        if not wanted(s.rfilename, include):
            continue
        if s.size is None or s.blob_id is None:  # nothing to verify against: refuse, not trust
            raise DownloadError(f"the hub gave no size or hash for {s.rfilename} of {repo}@{revision}")
        files.append(HubFile(path=s.rfilename, size=s.size, blob_id=s.blob_id, sha256=s.lfs.sha256 if s.lfs else None))
    return info.sha, files


def _fetch(file: HubFile, url: str, headers: dict[str, str], local_dir: Path, partial_dir: Path) -> None:
    """Download `file` into place: continue its partial file, verify, move."""
    partial = partial_dir / file.partial_name
    resume = partial.stat().st_size if partial.exists() else 0
    if resume > file.size:
        partial.unlink()
        resume = 0
    started = time.monotonic()
    log.info(
        "%s: downloading %d bytes%s", file.path, file.size - resume, f" (resuming after {resume})" if resume else ""
    )
    with partial.open("ab") as out:
        try:
            http_get(
                url, out, resume_size=resume, headers=headers, expected_size=file.size, displayed_filename=file.path
            )
        except HfHubHTTPError:  # an OSError too, but the hub's answer: explained by the caller
            raise
        except OSError as err:  # huggingface_hub's size check; the partial file is kept to resume
            raise DownloadError(f"{file.path}: {err}") from err
    problem = content_problem(partial, file)
    if problem is not None:
        # Restarting from zero is the only cure for a corrupt prefix: do not resume from it.
        partial.unlink()
        raise DownloadError(
            f"{file.path}: downloaded content does not match the hub's hash ({problem}); "
            "deleted, the next run downloads it again"
        )
    target = local_dir / file.path
    target.unlink(missing_ok=True)
    os.replace(partial, target)
    seconds = time.monotonic() - started
    log.info("%s: verified, %.1f MB/s", file.path, (file.size - resume) / max(seconds, 1e-6) / 1e6)


def download(
    repo: str,
    local_dir: Path,
    *,
    revision: str = "main",
    endpoint: str = DEFAULT_ENDPOINT,
    token: str | None = None,
    include: Sequence[str] = DEFAULT_INCLUDE,
    max_workers: int = 4,
) -> Path:
    """`repo` at `revision` into `local_dir` (see the module's docstring); returns `local_dir`."""
    state = local_dir / STATE_DIR
    partial_dir = state / "partial"
    partial_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state):
        marker = _read_marker(state)
        complete = _complete(marker, local_dir, repo, revision)
        if complete and _COMMIT.fullmatch(revision):
            log.info("%s@%s: complete, nothing to download", repo, revision)
            return local_dir
        api = HfApi(endpoint=endpoint, token=token or False, library_name="kvpilot")
        try:
            commit, files = _resolve(api, repo, revision, include)
        except (httpx2.TransportError, HfHubHTTPError) as err:
            unreachable = isinstance(err, httpx2.TransportError) or (
                err.response is not None and err.response.status_code >= 500
            )
            if complete and unreachable and marker is not None:
                why = f"the hub cannot be reached ({err})"
                log.warning("%s: %s: using the complete download of commit %s", repo, why, marker.commit)
                return local_dir
            raise
        if complete and marker is not None and marker.commit == commit:
            log.info("%s@%s: commit %s complete, nothing to download", repo, revision, commit)
            return local_dir
        # From here the folder changes: without a marker, a run cut short is never taken as complete.
        (state / MARKER).unlink(missing_ok=True)
        todo = [f for f in files if _needs_download(local_dir / f.path, f)]
        size = sum(f.size for f in todo)
        log.info(
            "%s@%s: commit %s, %d files, %d to download (%d bytes)", repo, revision, commit, len(files), len(todo), size
        )
        headers = build_hf_headers(token=token or False, library_name="kvpilot")
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            # list(): re-raises the first failure here.
            list(
                pool.map(
                    lambda f: _fetch(
                        f, hf_hub_url(repo, f.path, revision=commit, endpoint=endpoint), headers, local_dir, partial_dir
                    ),
                    todo,
                )
            )
        new = Marker(repo=repo, revision=revision, commit=commit, files={f.path: f.size for f in files})
        _settle(state, local_dir, marker, new)
        log.info("%s@%s: commit %s complete in %s", repo, revision, commit, local_dir)
        return local_dir


def _settle(state: Path, local_dir: Path, old: Marker | None, new: Marker) -> None:
    """Remove what the folder no longer holds for `new`, then mark it complete."""
    # Files of the previous commit that this one no longer has (a moved branch).
    for name in set(old.files if old else ()) - set(new.files):
        (local_dir / name).unlink(missing_ok=True)
    # Partial files left by earlier runs for content this commit does not have.
    for leftover in (state / "partial").iterdir():
        leftover.unlink()
    tmp = state / f"{MARKER}.tmp"
    tmp.write_text(new.model_dump_json(indent=1))
    os.replace(tmp, state / MARKER)


def _needs_download(path: Path, file: HubFile) -> bool:
    """A file already in place (from a run that stopped before its marker) is kept if it verifies."""
    if not path.is_file():
        return True
    problem = content_problem(path, file)
    if problem is not None:
        log.warning("%s: %s: downloading it again", file.path, problem)
    return problem is not None


def explain(err: Exception, repo: str, revision: str, endpoint: str, token: str | None) -> str:
    """A message that says what to do, for the errors a user can cause."""
    given = "the token in HF_TOKEN" if token else "no token (HF_TOKEN is not set)"
    if isinstance(err, GatedRepoError):
        why = "the token in HF_TOKEN has no access to it" if token else "HF_TOKEN is not set"
        return (
            f"{repo} is gated and {why}: accept its terms on the hub with an account and give that "
            "account's token as HF_TOKEN (in an InferenceService: spec.model.tokenSecret)"
        )
    if isinstance(err, RevisionNotFoundError):
        return f"{repo} has no revision {revision!r}"
    if isinstance(err, RepositoryNotFoundError):
        return (
            f"{repo} was not found at {endpoint}, or it is private and {given} gives access "
            "(in an InferenceService: spec.model.tokenSecret)"
        )
    if isinstance(err, HfHubHTTPError) and err.response is not None and err.response.status_code in (401, 403):
        return f"the hub refused {given} for {repo}: {err.server_message or err}"
    if isinstance(err, httpx2.TransportError):
        return f"cannot reach the hub at {endpoint}: {err}"
    return str(err)


def _main(args: argparse.Namespace) -> int:
    logging.getLogger("kvpilot").setLevel(logging.INFO)
    # One line per file in the pod's log, not progress bars redrawn into it.
    disable_progress_bars()
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    token = os.environ.get("HF_TOKEN") or None
    include = tuple(p for p in args.include.split(",") if p)
    try:
        download(
            args.repo,
            Path(args.local_dir),
            revision=args.revision,
            endpoint=endpoint,
            token=token,
            include=include,
            max_workers=args.max_workers,
        )
    except (DownloadError, HfHubHTTPError, httpx2.TransportError) as err:
        print(f"kvpilot download: error: {explain(err, args.repo, args.revision, endpoint, token)}", file=sys.stderr)
        return 1
    print(args.local_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "download",
        help=COMMANDS["download"][1],
        description="Download a model repository from the Hugging Face Hub (HF_ENDPOINT, default "
        f"{DEFAULT_ENDPOINT}; token from HF_TOKEN) into a folder the engine loads; "
        "resumes, verifies each file's hash, and does nothing when already complete.",
    )
    parser.add_argument("repo", help="org/name on the hub")
    parser.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    parser.add_argument("--local-dir", required=True, help="the folder to download into")
    parser.add_argument(
        "--include",
        default=",".join(DEFAULT_INCLUDE),
        help=f"comma-separated patterns of top-level files to fetch (default: {','.join(DEFAULT_INCLUDE)})",
    )
    parser.add_argument("--max-workers", type=int, default=4, help="files downloaded at once (default: 4)")
    parser.set_defaults(func=_main)
