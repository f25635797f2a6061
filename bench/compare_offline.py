"""The offline bench's engine half, before and after a change: same workload, same run.

    .venv/bin/python -m bench.compare_offline --before REV [--after TREE|REV] [--rounds 3] [--num-requests 64]

`--before` is a git revision of this repository, exported (`git archive`) into a temporary
directory; `--after` is a source tree (default: this working tree, uncommitted changes included)
or another revision. Each measurement is a fresh `python` process that generates bench/offline.py's
workload (same requests, lengths and seed; `time_engine`: the public `LLM(...).generate` API, model
load not timed, no HF) with one tree's engine. The sides alternate (before/after, then
after/before, ...) for `--rounds` rounds, so a change in the machine's load hits both alike. It
prints a table (tokens/s per round, the median per side, the ratio after/before of the medians),
writes JSON, and prints a Markdown table for bench/RESULTS.md.

How the child imports the intended tree although the venv has an editable install of this one:
`kvpilot` is a namespace package (pyproject maps kvpilot.engine -> engine/, kvpilot.operator ->
operator/), and setuptools' editable finder is appended to sys.meta_path, after the path-based
finder. So `<tmp>/<side>-pkgroot/kvpilot/{engine,operator}` are symlinks into the tree, the child
runs with PYTHONPATH=<tmp>/<side>-pkgroot, and the path-based finder finds that first. The child
checks that `kvpilot.engine` and every `kvpilot.engine.*` module it loaded come from the intended
tree and fails loudly otherwise. Both sides, the current tree included, load the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.machine import machine

REPO = Path(__file__).resolve().parents[1]
SIDES = ("before", "after")
# What a tree must contain; only these are exported from a revision.
TREE_PATHS = ("engine", "operator")
RESULT_PREFIX = "COMPARE_OFFLINE_RESULT "


# ---- the child: one measurement in a fresh process ------------------------------------------------


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:16]


def _drop_editable_finders() -> None:
    """Remove setuptools' editable-install finders of this process (before anything imports kvpilot):
    a module missing from the tree under test must fail to import, not come from the editable tree."""

    def editable(obj: object) -> bool:
        return str(getattr(obj, "__module__", "")).startswith("__editable__")

    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]
    sys.path_importer_cache.clear()


def _check_origin(tree: Path) -> str:
    """Fail unless kvpilot.engine and every kvpilot.engine.* / kvpilot.operator.* module loaded so far
    come from `tree`; return the resolved path of kvpilot.engine."""
    import kvpilot.engine

    dirs = [(tree / name).resolve() for name in TREE_PATHS]

    def inside(path: str | None) -> bool:
        return path is not None and any(Path(path).resolve().is_relative_to(d) for d in dirs)

    paths = list(kvpilot.engine.__path__)
    if not inside(kvpilot.engine.__file__) or not paths or not all(inside(p) for p in paths):
        raise SystemExit(
            f"compare_offline: kvpilot.engine was imported from {kvpilot.engine.__file__} "
            f"(__path__ {paths}), not from {tree}; PYTHONPATH={os.environ.get('PYTHONPATH')!r}"
        )
    strays = sorted(
        f"{name} ({module.__file__})"
        for name, module in list(sys.modules.items())
        if name.startswith(("kvpilot.engine.", "kvpilot.operator."))
        and getattr(module, "__file__", None)
        and not inside(module.__file__)
    )
    if strays:
        raise SystemExit(f"compare_offline: modules from outside {tree}: {', '.join(strays)}")
    return str(Path(kvpilot.engine.__file__).resolve())


def child(args: argparse.Namespace) -> int:
    import torch

    from bench.offline import make_requests, time_engine

    if args.threads:
        # The engine sizes its own threads and honours OMP_NUM_THREADS; older trees take torch's.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    tree = Path(args.tree)
    engine_file = _check_origin(tree)
    requests = make_requests(args.num_requests, args.bench_seed, args.vocab_size)
    workload = _digest([[r.prompt_token_ids, r.output_len] for r in requests])
    seconds, tokens = time_engine(requests)
    _check_origin(tree)  # again: the engine's lazily imported modules too
    output_tokens = sum(len(t) for t in tokens)
    result = {
        "engine": engine_file,
        "seconds": seconds,
        "output_tokens": output_tokens,
        "tokens_per_second": output_tokens / seconds,
        "workload_digest": workload,
        "outputs_digest": _digest(tokens),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def child_vocab_size(args: argparse.Namespace) -> int:
    """Print the embedded model's vocabulary size as the tree's own loader reads it (bench/offline.py's
    `embedded_vocab_size`), for the loader's current (kvpilot.engine.model.loader) or older
    (kvpilot.engine.model_loader) location."""
    import importlib

    for name in ("kvpilot.engine.model.loader", "kvpilot.engine.model_loader"):
        try:
            loader = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not (err.name and name.startswith(err.name)):
                raise  # the module exists but one of its imports is missing: a real failure
            continue
        _check_origin(Path(args.tree))
        print(
            RESULT_PREFIX + json.dumps({"vocab_size": int(loader.load_config(loader.embedded_model_dir()).vocab_size)})
        )
        return 0
    raise SystemExit("compare_offline: no model loader in this tree; pass --vocab-size")


# ---- the parent -------------------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    label: str  # what the user asked for: a revision (and its commit) or a directory
    tree: Path
    pkgroot: Path


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def export_revision(rev: str, dest: Path) -> str:
    """Extract engine/ and operator/ of git revision `rev` into `dest`; return the commit id."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, *TREE_PATHS], check=True, capture_output=True
    ).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return commit


def make_pkgroot(tree: Path, dest: Path) -> Path:
    """dest/kvpilot/{engine,operator} -> tree/{engine,operator}: a sys.path entry for that tree."""
    for name in TREE_PATHS:
        if not (tree / name).is_dir():
            raise SystemExit(f"compare_offline: {tree} has no {name}/")
    (dest / "kvpilot").mkdir(parents=True)
    for name in TREE_PATHS:
        (dest / "kvpilot" / name).symlink_to((tree / name).resolve(), target_is_directory=True)
    return dest


def _side(name: str, spec: str, tmp: Path) -> Side:
    path = Path(spec)
    if path.is_dir():
        tree, label = path.resolve(), f"tree {path.resolve()}"
    else:
        tree = tmp / f"{name}-tree"
        commit = export_revision(spec, tree)
        label = f"{spec} ({commit[:12]})" if not commit.startswith(spec) else commit[:12]
    return Side(name, label, tree, make_pkgroot(tree, tmp / f"{name}-pkgroot"))


def _run_child(side: Side, argv: list[str], log: Path) -> dict[str, object]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(side.pkgroot), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    cmd = [sys.executable, "-m", "bench.compare_offline", "--tree", str(side.tree), *argv]
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    text = log.read_text(errors="replace")
    results = [line[len(RESULT_PREFIX) :] for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        tail = "\n".join(text.splitlines()[-30:])
        raise SystemExit(
            f"compare_offline: the {side.name} side ({side.label}) failed with exit code "
            f"{proc.returncode}; log {log}:\n{tail}"
        )
    return json.loads(results[-1])


def _table(report: dict[str, object]) -> str:
    rounds = report["rounds"]  # type: ignore[assignment]
    lines = [f"{'round':>5}  {'order':<13}  {'before tok/s':>12}  {'after tok/s':>12}  {'after/before':>12}"]
    for r in rounds:  # type: ignore[union-attr]
        b, a = r["before"]["tokens_per_second"], r["after"]["tokens_per_second"]
        lines.append(f"{r['round']:>5}  {'/'.join(r['order']):<13}  {b:12.1f}  {a:12.1f}  {a / b:12.3f}")
    lines.append(
        f"{'median':>5}  {'':<13}  {report['median_before']:12.1f}  {report['median_after']:12.1f}  "
        f"{report['ratio']:12.3f}"
    )
    return "\n".join(lines)


def _markdown(report: dict[str, object]) -> str:
    rounds = report["rounds"]  # type: ignore[assignment]
    head = "| side | tree | " + " | ".join(f"round {r['round']}" for r in rounds) + " | median |"  # type: ignore[union-attr]
    rule = "| --- | --- | " + " | ".join("---:" for _ in rounds) + " | ---: |"  # type: ignore[arg-type]
    rows = [head, rule]
    for side in SIDES:
        cells = " | ".join(f"{r[side]['tokens_per_second']:.1f}" for r in rounds)  # type: ignore[union-attr]
        rows.append(f"| {side} | {report[side]['label']} | {cells} | **{report['median_' + side]:.1f} tok/s** |")  # type: ignore[index]
    return "\n".join(rows)


def compare(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvpilot-compare-"))
    try:
        sides = {"before": _side("before", args.before, tmp), "after": _side("after", args.after, tmp)}
        for side in sides.values():
            print(f"{side.name:6s}: {side.label}", flush=True)
        vocab = args.vocab_size
        if vocab is None:
            vocab = int(_run_child(sides["before"], ["--child-vocab-size"], tmp / "vocab.log")["vocab_size"])
        workload = [
            "--num-requests",
            str(args.num_requests),
            "--seed",
            str(args.bench_seed),
            "--vocab-size",
            str(vocab),
            *(["--threads", str(args.threads)] if args.threads else []),
        ]
        print(
            f"workload: bench/offline.py's, {args.num_requests} requests, seed {args.bench_seed}, vocab {vocab}; "
            f"{args.rounds} rounds; logs in {tmp}",
            flush=True,
        )
        rounds = []
        for i in range(1, args.rounds + 1):
            order = list(SIDES) if i % 2 else list(reversed(SIDES))  # ABBA: neither side always goes first
            measured = {}
            for name in order:
                measured[name] = _run_child(sides[name], ["--child", *workload], tmp / f"round{i}-{name}.log")
                print(
                    f"round {i} {name:6s}: {measured[name]['seconds']:7.1f} s  "
                    f"{measured[name]['output_tokens']:6d} tokens  "
                    f"{measured[name]['tokens_per_second']:7.1f} tok/s  (load {measured[name]['load_average'][0]:.1f})",
                    flush=True,
                )
            rounds.append({"round": i, "order": order, **measured})
        digests = {r[s]["workload_digest"] for r in rounds for s in SIDES}
        if len(digests) != 1:
            raise SystemExit(f"compare_offline: the sides ran different workloads: {sorted(digests)}")
        medians = {s: statistics.median(r[s]["tokens_per_second"] for r in rounds) for s in SIDES}
        ratio = medians["after"] / medians["before"]
        report: dict[str, object] = {
            "command": "python -m bench.compare_offline " + " ".join(sys.argv[1:]),
            # torch_threads: the measuring children's, not this process's.
            "machine": machine() | {"torch_threads": rounds[0]["before"]["torch_threads"]},
            "workload": {
                "num_requests": args.num_requests,
                "seed": args.bench_seed,
                "vocab_size": vocab,
                "digest": digests.pop(),
            },
            "before": {"label": sides["before"].label},
            "after": {"label": sides["after"].label},
            "rounds": rounds,
            "median_before": medians["before"],
            "median_after": medians["after"],
            "ratio": ratio,
            "same_outputs": len({r[s]["outputs_digest"] for r in rounds for s in SIDES}) == 1,
            "max_slowdown_percent": args.max_slowdown,
            "within_max_slowdown": ratio >= 1 - args.max_slowdown / 100,
        }
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        print()
        print(_table(report))
        print()
        print(_markdown(report))
        print()
        change = (ratio - 1) * 100
        print(
            f"after/before = {ratio:.3f} ({'+' if change >= 0 else ''}{change:.1f} % tokens/s); "
            f"{'within' if report['within_max_slowdown'] else 'NOT within'} the {args.max_slowdown:g} % "
            "slowdown budget; "
            f"greedy outputs {'identical' if report['same_outputs'] else 'DIFFER'} across sides and rounds"
        )
        print(f"wrote {output}")
        return 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_offline", description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the 'before' side (e.g. 0dc9ed5)")
    parser.add_argument(
        "--after",
        default=str(REPO),
        help="source tree (a directory with engine/ and operator/) or git revision of the 'after' side "
        "(default: this working tree)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="before/after pairs, alternating the order (default: 3)")
    parser.add_argument("--num-requests", type=int, default=64, help="as bench.offline (default: 64)")
    parser.add_argument("--seed", dest="bench_seed", type=int, default=0, help="as bench.offline (default: 0)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="prompt token id range (default: the embedded model's, read with the 'before' tree's loader)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads in each run (default: torch's default, as bench.offline)"
    )
    parser.add_argument(
        "--max-slowdown", type=float, default=5.0, help="budget in percent for the verdict line (default: 5)"
    )
    parser.add_argument("--output", default="bench/out/compare_offline.json")
    parser.add_argument("--keep", action="store_true", help="keep the exported trees and the logs")
    # The child side (run by the parent).
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-vocab-size", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child or args.child_vocab_size:
        _drop_editable_finders()
    if args.child:
        return child(args)
    if args.child_vocab_size:
        return child_vocab_size(args)
    if not args.before:
        parser.error("--before REV is required")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return compare(args)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
