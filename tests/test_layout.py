"""A house a newcomer can walk: no function of either half runs over 60 lines unless it says, in a
`# One piece:` comment at the top of its body, why it must be one piece."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
MARKER = "# One piece:"


def long_functions(root: Path) -> list[str]:
    """`path:line name (lines)` of every function over MAX_LINES lines without the marker."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            head = lines[node.lineno - 1 : node.body[0].end_lineno + 1]
            if length > MAX_LINES and not any(line.strip().startswith(MARKER) for line in head):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_runs_over_60_lines_without_saying_why() -> None:
    assert [f for folder in ("engine", "operator") for f in long_functions(ROOT / folder)] == []


def test_the_check_sees_a_long_function_and_its_reason(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "a.py").write_text(f"def long():\n{body}\n\ndef explained():\n    {MARKER} a table\n{body}")
    assert [f.split(" ")[1] for f in long_functions(tmp_path)] == ["long"]
