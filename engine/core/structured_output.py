"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings,
or an EBNF grammar. Plain data (no grammar library): it travels in SamplingParams and is the key
under which its compiled grammar is cached."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: Kind
    # The JSON schema as JSON text, the regex, the EBNF grammar, or the choices as a JSON list;
    # empty for json_object.
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} structured output needs a non-empty {self.kind}")

    @classmethod
    def json_schema(cls, schema: dict[str, object] | str) -> StructuredOutput:
        """Key order is kept: the grammar writes an object's properties in the schema's order."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice needs at least one choice, each a non-empty string")
        return cls("choice", json.dumps(choices))

    def ebnf(self) -> str:
        """For a choice: the grammar whose sentences are exactly the choices (EBNF string literals
        take JSON's escapes)."""
        return "root ::= " + " | ".join(json.dumps(c) for c in json.loads(self.spec))
