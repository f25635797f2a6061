"""`kvpilot download` against a hub stand-in on 127.0.0.1 (e2e/hub_server.py) serving the embedded
model: it downloads and verifies, does not download again, resumes, refuses corrupt content, sends
the token, explains a gated repository; and the engine runs the folder it fills."""

from __future__ import annotations

import filecmp
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download

from e2e.hub_server import HubServer
from e2e.polling import poll
from e2e.procs import free_port, kvpilot_executable, start
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cli import main
from kvpilot.engine.tools.download import MARKER, STATE_DIR, DownloadError, Marker, download

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEIGHTS = "model.safetensors"
# Every file but the weights: enough for the protocol, at a hundredth of the bytes.
SMALL = ("*.json", "*.jinja")
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[HubServer]:
    with HubServer(REPO, model_dir) as hub:
        yield hub


@pytest.fixture
def hub(server: HubServer) -> Iterator[HubServer]:
    server.reset()
    yield server
    server.reset()


@pytest.fixture(scope="module")
def downloaded(server: HubServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One complete download, and the requests it made."""
    server.reset()
    target = tmp_path_factory.mktemp("hub") / "smollm2"
    assert download(REPO, target, endpoint=server.url) == target
    return target, [f"{r.method} {r.path}" for r in server.requests]


def marker(folder: Path) -> Marker | None:
    path = folder / STATE_DIR / MARKER
    return Marker.model_validate_json(path.read_text()) if path.exists() else None


def partial_files(folder: Path) -> list[Path]:
    return sorted((folder / STATE_DIR / "partial").iterdir())


def test_a_download_is_verified_and_marked_with_its_commit(
    downloaded: tuple[Path, list[str]], server: HubServer, model_dir: Path
) -> None:
    target, requests = downloaded
    names = sorted(p.name for p in model_dir.iterdir())
    assert sorted(p.name for p in target.iterdir() if p.name != STATE_DIR) == names
    assert all(filecmp.cmp(model_dir / name, target / name, shallow=False) for name in names)
    assert marker(target) == Marker(
        repo=REPO,
        revision="main",
        commit=server.commit,
        files={name: (model_dir / name).stat().st_size for name in names},
    )
    # One question to resolve the revision, then each file once, by the commit it resolved to.
    assert requests[0] == f"GET /api/models/{REPO}/revision/main"
    assert sorted(requests[1:]) == sorted(f"GET /{REPO}/resolve/{server.commit}/{name}" for name in names)
    assert partial_files(target) == []


def test_a_complete_download_is_not_fetched_again(downloaded: tuple[Path, list[str]], hub: HubServer) -> None:
    target, _ = downloaded
    # A branch: the hub is asked where it points (it may have moved), nothing is downloaded.
    download(REPO, target, endpoint=hub.url)
    assert [(r.method, r.path) for r in hub.requests] == [("GET", f"/api/models/{REPO}/revision/main")]
    # A commit cannot move: the hub is not asked at all, even when it is down.
    hub.requests.clear()
    download(REPO, target, revision=hub.commit, endpoint=hub.url)
    assert hub.requests == []
    # A branch while the hub is down (a pod restarting): the complete download is used.
    download(REPO, target, endpoint=f"http://127.0.0.1:{free_port()}")
    assert marker(target).commit == hub.commit


def test_the_engine_generates_from_the_downloaded_folder(
    downloaded: tuple[Path, list[str]], hf_greedy, corpus_ids: list[int]
) -> None:
    target, _ = downloaded
    prompt = corpus_ids[:24]
    llm = LLM(str(target), kv_cache_memory_bytes=16 << 20, max_model_len=64, dtype="float32")
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert list(out.outputs[0].token_ids) == hf_greedy(prompt, 8).tokens


def test_a_dropped_connection_is_resumed_within_the_run(hub: HubServer, tmp_path: Path, model_dir: Path) -> None:
    hub.cut(WEIGHTS, after_bytes=64 * MiB)
    download(REPO, tmp_path, endpoint=hub.url, include=("*.safetensors",))
    first, second = hub.file_requests(WEIGHTS)
    assert "Range" not in first.headers
    start = int(second.headers["Range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= 64 * MiB
    size = (model_dir / WEIGHTS).stat().st_size
    # The second response carried only the rest.
    assert hub.body_bytes[WEIGHTS] == 64 * MiB + size - start
    assert filecmp.cmp(model_dir / WEIGHTS, tmp_path / WEIGHTS, shallow=False)


def test_a_killed_download_resumes_where_it_stopped(hub: HubServer, tmp_path: Path, model_dir: Path) -> None:
    held, release = hub.hold(WEIGHTS, after_bytes=64 * MiB)
    target = tmp_path / "model"
    env = {**os.environ, "HF_ENDPOINT": hub.url}
    env.pop("HF_TOKEN", None)
    process = start(
        [kvpilot_executable(), "download", REPO, "--local-dir", str(target)], tmp_path / "download.log", env
    )
    try:
        assert held.wait(timeout=60), process.log_tail()
        # The small files are in place; the weights are partly on disk.
        poll(
            lambda: (
                (target / "tokenizer.json").exists()
                and (target / "config.json").exists()
                and any(p.stat().st_size > 0 for p in partial_files(target))
            ),
            30,
            "files on disk",
        )
        process.popen.kill()  # SIGKILL, as when a node dies: nothing is cleaned up
        process.popen.wait()
    finally:
        release.set()
        process.stop()
    (partial,) = partial_files(target)
    on_disk = partial.stat().st_size
    assert marker(target) is None and not (target / WEIGHTS).exists()
    hub.requests.clear()
    download(REPO, target, endpoint=hub.url)
    # Only the weights were fetched again, from where the killed run had stopped.
    (resumed,) = [r for r in hub.requests if "/resolve/" in r.path]
    assert resumed.path.endswith(WEIGHTS) and resumed.headers["Range"] == f"bytes={on_disk}-"
    size = (model_dir / WEIGHTS).stat().st_size
    assert hub.body_bytes[WEIGHTS] == 64 * MiB + size - on_disk
    assert filecmp.cmp(model_dir / WEIGHTS, target / WEIGHTS, shallow=False)
    assert marker(target) is not None and partial_files(target) == []


@pytest.mark.parametrize(
    "name, include, kind", [("tokenizer.json", SMALL, "git blob sha1"), (WEIGHTS, ("*.safetensors",), "sha256")]
)
def test_corrupt_content_is_refused_and_not_kept(
    hub: HubServer, tmp_path: Path, model_dir: Path, name: str, include: tuple[str, ...], kind: str
) -> None:
    hub.corrupt(name)
    with pytest.raises(DownloadError, match=f"{name}: downloaded content does not match the hub's hash \\({kind} "):
        download(REPO, tmp_path, endpoint=hub.url, include=include)
    assert not (tmp_path / name).exists() and marker(tmp_path) is None and partial_files(tmp_path) == []
    hub.reset()
    download(REPO, tmp_path, endpoint=hub.url, include=include)
    assert filecmp.cmp(model_dir / name, tmp_path / name, shallow=False)


def test_a_truncated_or_deleted_file_is_fetched_again_alone(hub: HubServer, tmp_path: Path, model_dir: Path) -> None:
    download(REPO, tmp_path, endpoint=hub.url, include=SMALL)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[: tokenizer.stat().st_size // 2])
    (tmp_path / "config.json").unlink()
    hub.requests.clear()
    download(REPO, tmp_path, endpoint=hub.url, include=SMALL)
    fetched = sorted(r.path.rsplit("/", 1)[1] for r in hub.requests if "/resolve/" in r.path)
    assert fetched == ["config.json", "tokenizer.json"]
    assert all("Range" not in r.headers for r in hub.requests)
    assert all(filecmp.cmp(model_dir / n, tmp_path / n, shallow=False) for n in ("config.json", "tokenizer.json"))


def _run(*args: str) -> int:
    return main(["download", REPO, *args])


def test_a_token_is_sent_and_a_gated_repo_without_one_fails_clearly(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.token, hub.gated = "hf_test_token", True
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    args = ("--local-dir", str(tmp_path), "--include", ",".join(SMALL))
    assert _run(*args) == 1
    err = capsys.readouterr().err
    assert f"kvpilot download: error: {REPO} is gated and HF_TOKEN is not set: accept its terms" in err
    assert "spec.model.tokenSecret" in err and "Traceback" not in err
    assert marker(tmp_path) is None

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert _run(*args) == 1
    assert "the hub refused the token in HF_TOKEN" in capsys.readouterr().err

    hub.requests.clear()
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert _run(*args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert hub.requests and all(r.headers.get("Authorization") == "Bearer hf_test_token" for r in hub.requests)
    assert marker(tmp_path) is not None


def test_an_unknown_repository_or_revision_says_so(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert _run("--local-dir", str(tmp_path), "--revision", "v9") == 1
    assert f"{REPO} has no revision 'v9'" in capsys.readouterr().err
    assert main(["download", "org/absent", "--local-dir", str(tmp_path)]) == 1
    assert f"org/absent was not found at {hub.url}, or it is private" in capsys.readouterr().err
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert _run("--local-dir", str(tmp_path)) == 1
    assert "cannot reach the hub at http://127.0.0.1:" in capsys.readouterr().err


def test_huggingface_hubs_own_snapshot_download_works_against_the_stand_in(
    hub: HubServer, tmp_path: Path, model_dir: Path
) -> None:
    # The stand-in answers what huggingface_hub itself asks (tree listing, HEAD with ETag and
    # X-Repo-Commit), so other tools can be tested against it too.
    folder = snapshot_download(REPO, local_dir=tmp_path, endpoint=hub.url, allow_patterns=list(SMALL), token=False)
    names = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".json", ".jinja"))
    assert sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith(".")) == names
    assert all(filecmp.cmp(model_dir / n, Path(folder) / n, shallow=False) for n in names)
    assert any(r.method == "HEAD" and r.path == f"/{REPO}/resolve/{hub.commit}/config.json" for r in hub.requests)
