"""The import graph of both halves, read from the source (ast): neither half has an import cycle,
the model side reads checkpoints without reaching up into the runner, the server or the offline
quantization tools, and the operator's rooms depend one way only (the rooms in docs/contributing.md).
Imports inside functions count as much as those at the top of a module: a deferred import is still a
dependency, and a cycle that only defers one of its edges is still one."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it is imported as (pyproject's package-dir).
PACKAGES = {"engine": "kvpilot.engine", "operator": "kvpilot.operator"}
# What the model side must not import: it only builds models and reads checkpoints.
ABOVE_THE_MODEL = ("kvpilot.engine.worker", "kvpilot.engine.serving", "kvpilot.engine.quantize")
# The operator's rooms and what each may import besides itself: api/ nothing, runtimes/ only api/ and
# the engine's flags, planning/ those and the engine's torch-free contract, kube/ only api/, and so on
# up to cli.py, which wires them all.
ROOMS = {
    "api": set(),
    "runtimes": {"api", "kvpilot.engine.contract.config"},
    "planning": {
        "api",
        "runtimes",
        "kvpilot.engine.contract.acceptance_window",
        "kvpilot.engine.contract.config",
        "kvpilot.engine.contract.device_profile",
    },
    "kube": {"api"},
    "hub": {"api"},
    "controller": {
        "api",
        "runtimes",
        "planning",
        "kube",
        "hub",
        "kvpilot.engine.contract.config",
        "kvpilot.engine.contract.device_profile",
    },
    "autoscaling": {"api", "kube"},
    "gateway": {"api", "kube"},
}


def modules() -> dict[str, Path]:
    """Every module of both halves by its dotted name, found by walking their folders."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((package, *parts)).removesuffix(".__init__")] = path
    return found


def _imported(name: str, path: Path, modules: set[str]) -> Iterator[str]:
    """The kvpilot modules that module `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"{package.rsplit('.', node.level - 1)[0]}.{base}".rstrip(".")
            # `from package import name` imports the submodule `name` when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        yield from (target for target in targets if target.startswith("kvpilot."))


def _graph() -> dict[str, set[str]]:
    found = modules()
    return {name: set(_imported(name, path, set(found))) - {name} for name, path in found.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_every_module_of_both_halves_is_found() -> None:
    graph = _graph()
    assert {"kvpilot.engine.model.loader", "kvpilot.engine.cli", "kvpilot.operator.cli"} <= set(graph)
    assert "kvpilot.engine.model.llama" in graph["kvpilot.engine.model.loader"]


@pytest.mark.parametrize("half", PACKAGES.values())
def test_neither_half_has_an_import_cycle(half: str) -> None:
    graph = {
        name: {t for t in targets if t.startswith(half)} for name, targets in _graph().items() if name.startswith(half)
    }
    assert graph and _cycles(graph) == []


def _room(module: str) -> str:
    """`api` for kvpilot.operator.api.spec; the module itself outside the operator's rooms."""
    parts = module.split(".")
    return parts[2] if module.startswith("kvpilot.operator.") and parts[2] in ROOMS else module


def test_the_operator_rooms_depend_one_way() -> None:
    crossing = {}
    for name, targets in _graph().items():
        room = _room(name)
        if room not in ROOMS:
            continue
        outside = sorted(
            t
            for t in targets
            if _room(t) != room
            and _room(t) not in ROOMS[room]
            and not any(t == allowed or t.startswith(f"{allowed}.") for allowed in ROOMS[room])
        )
        if outside:
            crossing[name] = outside
    assert crossing == {}


def test_the_model_side_imports_nothing_above_it() -> None:
    upward = {
        name: sorted(t for t in targets if t.startswith(ABOVE_THE_MODEL))
        for name, targets in _graph().items()
        if name.startswith("kvpilot.engine.model")
    }
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_checker_sees_cycles_and_deferred_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from kvpilot.engine.model import b\n")
    found = set(_imported("kvpilot.engine.model.a", tmp_path / "a.py", {"kvpilot.engine.model.b"}))
    assert found == {"kvpilot.engine.model.b"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
