"""docs/crd-reference.md is what operator/api/crd_reference.py generates from the types now, and the
generator leaves out no field and no CEL rule of the CRD."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpilot.operator.api.crd import crd
from kvpilot.operator.api.crd_reference import reference

PAGE = Path(__file__).resolve().parents[3] / "docs" / "crd-reference.md"


def test_the_checked_in_page_is_the_generated_one() -> None:
    assert PAGE.read_text() == reference(), (
        "docs/crd-reference.md is stale: run `.venv/bin/python -m kvpilot.operator.api.crd_reference > "
        "docs/crd-reference.md`"
    )


def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("properties", {}).values():
        yield from walk(child)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from walk(node[key])


def test_every_field_and_every_rule_is_on_the_page() -> None:
    (version,) = crd()["spec"]["versions"]
    page = reference()
    for node in walk(version["schema"]["openAPIV3Schema"]):
        for rule in node.get("x-kubernetes-validations", []):
            assert f"{rule['message']}: `{rule['rule']}`" in page
        for name, child in node.get("properties", {}).items():
            if name not in ("apiVersion", "kind", "metadata", "spec", "status"):
                assert f"| `{name}`" in page
                assert child.get("description", "").replace("|", "\\|") in page
