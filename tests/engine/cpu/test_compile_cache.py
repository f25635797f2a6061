"""compile_cache_dir: a second engine with the same cache starts without compiling again, engines
publishing at once leave one whole entry, and an entry that is corrupt, foreign or unloadable is
ignored with a warning and rebuilt; the compiled graph still gives HF's greedy tokens."""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu.compile_cache import MANIFEST, Manifest, publish, resolve_root, seed
from kvpilot.engine.cpu.kernels import KERNELS
from tests.engine.conftest import make_prompts
from tests.engine.oracle import check_greedy

KEY = {"torch": "2.99.0", "model": "m"}


def _engine(root: Path) -> LLM:
    """A new engine on `root`, starting as a new process would: nothing compiled earlier in this
    process (Dynamo's or inductor's in-memory state) serves it, only what the cache root holds."""
    torch.compiler.reset()
    return LLM(dtype="float32", compile_decode=True, kv_cache_memory_bytes=64 << 20, compile_cache_dir=str(root))


def _inductor_counts() -> dict[str, int]:
    return {**counters["inductor"], **counters["aot_autograd"]}


def _delta(before: dict[str, int], name: str) -> int:
    return _inductor_counts().get(name, 0) - before.get(name, 0)


def _entry(root: Path) -> Path:
    (entry,) = (p for p in root.iterdir() if not p.name.startswith(".") and p.name != KERNELS)
    return entry


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its inode and modification time: a rewrite changes one."""
    return {
        str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


def _check_greedy_through_graph(llm: LLM, corpus_ids: list[int], hf_greedy) -> None:
    assert llm.engine.runner.compiled_decode is not None
    for prompt in make_prompts(corpus_ids, [17, 90]):
        out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
        ref = hf_greedy(prompt, 10)
        check_greedy(out.token_ids, ref.tokens, ref.logits, f"{len(prompt)}-token prompt")


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache root after one cold start compiled into it."""
    root = tmp_path_factory.mktemp("compile-cache")
    before = _inductor_counts()
    llm = _engine(root)
    assert _delta(before, "fxgraph_cache_miss") == 1, "the first start found a compiled graph somewhere"
    del llm
    gc.collect()
    yield root


def test_a_second_engine_on_the_same_cache_starts_without_compiling(published, corpus_ids, hf_greedy) -> None:
    entry = _entry(published)
    manifest = Manifest.model_validate_json((entry / MANIFEST).read_bytes())
    assert any(name.endswith(".so") for name in manifest.files), "the built kernels are not in the cache"
    files = _files(published)
    before = _inductor_counts()
    llm = _engine(published)
    assert _delta(before, "fxgraph_cache_hit") == 1
    assert _delta(before, "fxgraph_cache_miss") == 0, "the second start compiled the graph again"
    # The graph's weights are frozen into it, which AOTAutograd's cache refuses; inductor's holds
    # the compiled code, so only the tracing runs again.
    assert _delta(before, "autograd_cache_bypass") == 1
    assert _files(published) == files, "a warm start rewrote the cache"
    _check_greedy_through_graph(llm, corpus_ids, hf_greedy)


def test_an_entry_inductor_cannot_load_is_ignored_with_a_warning_and_rebuilt(
    published, corpus_ids, hf_greedy, caplog: pytest.LogCaptureFixture
) -> None:
    """Kernels that match the manifest and still do not load (built against another C library, say):
    the start compiles from scratch and replaces them."""
    entry = _entry(published)
    manifest = Manifest.model_validate_json((entry / MANIFEST).read_bytes())
    for name in (n for n in manifest.files if n.endswith(".so")):
        (entry / name).write_bytes(b"not a shared object")
        manifest.files[name] = hashlib.sha256(b"not a shared object").hexdigest()
    (entry / MANIFEST).write_text(manifest.model_dump_json())
    before = _inductor_counts()
    with caplog.at_level(logging.WARNING, "kvpilot.engine.cpu.compile_cache"):
        llm = _engine(published)
    assert "event=compile_cache_ignored" in caplog.text
    assert _delta(before, "fxgraph_cache_miss") == 1
    rebuilt = Manifest.model_validate_json((_entry(published) / MANIFEST).read_bytes())
    kernels = [n for n in rebuilt.files if n.endswith(".so")]
    assert kernels and all((_entry(published) / n).read_bytes()[:4] == b"\x7fELF" for n in kernels)
    _check_greedy_through_graph(llm, corpus_ids, hf_greedy)


def _published_entry(tmp_path: Path, files: dict[str, bytes]) -> Path:
    work = tmp_path / "work"
    for name, content in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(content)
    entry = tmp_path / "root" / "entry"
    entry.parent.mkdir()
    publish(work, entry, KEY)
    return entry


def test_a_file_that_does_not_match_the_manifest_is_ignored_with_a_warning(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    entry = _published_entry(tmp_path, {"ab/kernel.so": b"\x7fELF good", "fxgraph/x/entry": b"graph"})
    (entry / "ab" / "kernel.so").write_bytes(b"\x7fELF trunc")
    work = tmp_path / "seeded"
    work.mkdir()
    with caplog.at_level(logging.WARNING, "kvpilot.engine.cpu.compile_cache"):
        assert seed(entry, KEY, work) is False
    assert "does not match its sha256" in caplog.text
    assert list(work.iterdir()) == []


def test_an_entry_of_another_torch_build_is_ignored_with_a_warning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    entry = _published_entry(tmp_path, {"ab/kernel.so": b"\x7fELF"})
    work = tmp_path / "seeded"
    work.mkdir()
    with caplog.at_level(logging.WARNING, "kvpilot.engine.cpu.compile_cache"):
        assert seed(entry, {**KEY, "torch": "2.98.0"}, work) is False
    assert "2.99.0" in caplog.text and "2.98.0" in caplog.text
    (entry / MANIFEST).write_text("{not json")
    assert seed(entry, KEY, work) is False
    assert list(work.iterdir()) == []


def test_engines_publishing_at_once_leave_one_whole_entry_and_readers_never_see_half_of_one(tmp_path) -> None:
    """Eight engines publish different compiles to one entry while others read it: every read gets
    one publisher's files exactly, or nothing; at the end one whole entry is there and no leftovers."""
    entry = tmp_path / "root" / "entry"
    entry.parent.mkdir()
    contents = {i: {f"k{j}/kernel{j}.so": f"{i}-{j}".encode() * 1000 for j in range(20)} for i in range(8)}
    works = {}
    for i, files in contents.items():
        works[i] = tmp_path / f"work{i}"
        for name, content in files.items():
            (works[i] / name).parent.mkdir(parents=True, exist_ok=True)
            (works[i] / name).write_bytes(content)
    start = threading.Barrier(12)
    seen: list[dict[str, bytes]] = []
    errors: list[BaseException] = []

    def publisher(i: int) -> None:
        start.wait()
        for _ in range(5):
            publish(works[i], entry, KEY)

    def reader(r: int) -> None:
        start.wait()
        for n in range(20):
            work = tmp_path / f"read{r}-{n}"
            work.mkdir()
            if seed(entry, KEY, work):
                seen.append({str(p.relative_to(work)): p.read_bytes() for p in work.rglob("*") if p.is_file()})

    def guarded(target, arg) -> None:
        try:
            target(arg)
        except BaseException as e:  # noqa: BLE001 -- reported below with the thread's failure
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(publisher, i)) for i in range(8)]
    threads += [threading.Thread(target=guarded, args=(reader, r)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(files in contents.values() for files in seen), "a reader accepted a mix of two entries"
    final = tmp_path / "final"
    final.mkdir()
    assert seed(entry, KEY, final)
    assert {str(p.relative_to(final)): p.read_bytes() for p in final.rglob("*") if p.is_file()} in contents.values()
    assert sorted(p.name for p in entry.parent.iterdir()) == ["entry"], "a publisher left its temporary folder"


def test_the_root_is_off_a_path_or_beside_the_cached_models(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_CACHE", str(tmp_path / "user-cache"))
    assert resolve_root("off") is None
    assert resolve_root(str(tmp_path / "x")) == tmp_path / "x"
    assert resolve_root(None) == tmp_path / "user-cache" / "compiled"


def test_an_unwritable_root_still_serves(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A read-only volume: the engine compiles, serves and says the next start compiles again."""
    from kvpilot.engine.cpu.compile_cache import compile_with_cache

    root = tmp_path / "file-not-folder"
    root.write_text("")
    with caplog.at_level(logging.WARNING, "kvpilot.engine.cpu.compile_cache"):
        result, state = compile_with_cache(_write_a_kernel, root, KEY)
    assert (result, state) == ("compiled", "unwritable")
    assert "event=compile_cache_unwritable" in caplog.text


def _write_a_kernel() -> str:
    """A stand-in compile: writes a file into inductor's cache dir as inductor would."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    (Path(cache_dir()) / "ab").mkdir(exist_ok=True)
    (Path(cache_dir()) / "ab" / "kernel.so").write_bytes(b"\x7fELF")
    return "compiled"
