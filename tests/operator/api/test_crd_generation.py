"""operator/api/crd.py's conversion of a pydantic model's JSON schema into a Kubernetes structural
schema, rule by rule, on small models."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kvpilot.operator.api.crd import crd_yaml, structural
from kvpilot.operator.api.spec import CREATED_EMPTY, INT64, INT_OR_STRING, cel, no_crd_default
from tests.operator.api.test_crd import check_structural


class Inner(BaseModel):
    """A docstring, for the code's readers: never the CRD's description."""

    model_config = ConfigDict(json_schema_extra=cel(("self.low <= self.high", "low must be <= high")))

    low: int = 0
    high: int = 1


class Tiny(BaseModel):
    """Another docstring."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel)

    count: int = Field(gt=0)
    below_ten: int = Field(default=1, lt=10)
    share: float = Field(default=0.5, gt=0, le=1)
    ratio: float = Field(default=0.5, lt=1)
    name: str | None = Field(default=None, min_length=1, description="Optional, described.")
    size: int | None = Field(default=None, json_schema_extra=INT64)
    mode: Literal["a", "b"] = "a"
    only: Literal["x"] | None = None
    inner: Inner = Field(default=Inner(), json_schema_extra=CREATED_EMPTY)
    other: Inner | None = Field(default=None, description="The same model, another meaning.")
    absent: Inner = Inner()
    flag: bool = Field(default=False, json_schema_extra=no_crd_default)
    quantity: str | int = Field(default=1, json_schema_extra=INT_OR_STRING)
    labels: dict[str, str] = Field(default_factory=dict)
    anything: dict[str, Any] | None = None
    items: list[Inner] = Field(default_factory=list, max_length=3)


def properties() -> dict[str, Any]:
    schema = structural(Tiny)
    check_structural(schema, "tiny")
    return schema["properties"]


def test_the_root_is_a_plain_object_with_its_required_fields() -> None:
    schema = structural(Tiny)
    assert schema["type"] == "object" and schema["required"] == ["count"]
    # No title, no $defs, no docstring, and extra="forbid" is not said (the API server prunes).
    assert set(schema) == {"type", "required", "properties"}


def test_an_integers_exclusive_bound_is_the_next_integer() -> None:
    assert properties()["count"] == {"type": "integer", "minimum": 1}
    assert properties()["belowTen"] == {"type": "integer", "default": 1, "maximum": 9}


def test_a_numbers_exclusive_bound_is_openapi_3_0s_flag() -> None:
    assert properties()["share"] == {
        "type": "number",
        "default": 0.5,
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1,
    }
    assert properties()["ratio"] == {"type": "number", "default": 0.5, "maximum": 1, "exclusiveMaximum": True}


def test_an_optional_field_is_its_type_without_null_or_default() -> None:
    assert properties()["name"] == {"type": "string", "minLength": 1, "description": "Optional, described."}
    assert properties()["size"] == {"type": "integer", "format": "int64"}


def test_a_literal_is_a_string_enum() -> None:
    assert properties()["mode"] == {"type": "string", "enum": ["a", "b"], "default": "a"}
    assert properties()["only"] == {"type": "string", "enum": ["x"]}


def test_a_model_is_inlined_with_its_rules_and_the_fields_description_only() -> None:
    inner = {
        "type": "object",
        "x-kubernetes-validations": [{"message": "low must be <= high", "rule": "self.low <= self.high"}],
        "properties": {"low": {"type": "integer", "default": 0}, "high": {"type": "integer", "default": 1}},
    }
    assert properties()["inner"] == {**inner, "default": {}}
    assert properties()["other"] == {**inner, "description": "The same model, another meaning."}
    # A section's pydantic default (the model's dump) is not the CRD's: without CREATED_EMPTY, none.
    assert properties()["absent"] == inner
    assert properties()["items"] == {"type": "array", "maxItems": 3, "items": inner}


def test_declared_extras_default_and_int_or_string() -> None:
    assert properties()["flag"] == {"type": "boolean"}
    assert properties()["quantity"] == {
        "default": 1,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    }


def test_maps_and_kubernetes_objects() -> None:
    assert properties()["labels"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert properties()["anything"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def test_a_model_inlined_twice_shares_no_objects() -> None:
    # Shared objects would be written as YAML anchors and aliases.
    assert "&id" not in yaml.safe_dump(structural(Tiny)) and "&id" not in crd_yaml()
