"""spec.adapters: LoRA adapters, each a model name of its own beside the base model's. The pydantic
spec and the CRD (its schema and CEL rules) accept and refuse the same lists, saying why."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvpilot.operator.api.spec import ADAPTER_NAME, MAX_ADAPTERS, SOURCE_PATTERN, InferenceServiceSpec
from tests.operator.api.test_model_source import BAD, GOOD

CRD = Path(__file__).resolve().parents[3] / "crds" / "inferenceservice.yaml"


def spec(adapters: list[dict[str, Any]], **model: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"name": "llama-3-8b", **model}, "adapters": adapters})


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_adapters_are_a_list_of_name_source_and_rank() -> None:
    parsed = spec(
        [
            {"name": "sql", "source": "hf://org/sql-lora@v2", "rank": 8},
            {"name": "support.v2", "source": "pvc://adapters/support"},
            {"name": "legal", "source": "/adapters/legal", "rank": 12},
        ]
    )
    assert [(a.name, a.source, a.rank) for a in parsed.adapters] == [
        ("sql", "hf://org/sql-lora@v2", 8),
        ("support.v2", "pvc://adapters/support", None),
        ("legal", "/adapters/legal", 12),
    ]
    assert spec([]).adapters == []
    assert InferenceServiceSpec.model_validate({"model": {"name": "llama-3-8b"}}).adapters == []


@pytest.mark.parametrize(
    ("adapters", "model", "message"),
    [
        ([{"name": "sql", "source": "/a"}, {"name": "sql", "source": "/b"}], {}, "each name once \\(sql repeated\\)"),
        ([{"name": "llama-3-8b", "source": "/a"}], {}, "must differ from the served model name"),
        ([{"name": "chat", "source": "/a"}], {"servedModelName": "chat"}, "must differ from the served model name"),
        ([{"name": "Sql", "source": "/a"}], {}, "should match pattern"),
        ([{"name": "sql_v2", "source": "/a"}], {}, "should match pattern"),
        ([{"name": "-sql", "source": "/a"}], {}, "should match pattern"),
        ([{"name": "a" * 64, "source": "/a"}], {}, "at most 63 characters"),
        ([{"name": "sql", "source": "s3://bucket/sql"}], {}, "adapters\\[\\].source 's3://bucket/sql' must be"),
        ([{"name": "sql", "source": "/a", "rank": 0}], {}, "greater than or equal to 1"),
        ([{"name": "sql", "source": "/a", "rank": 1024}], {}, "less than or equal to 512"),
        ([{"name": "sql"}], {}, "source\n  Field required"),
        ([{"name": f"a{i}", "source": "/a"} for i in range(MAX_ADAPTERS + 1)], {}, "at most 64 items"),
    ],
)
def test_the_spec_refuses_adapters_saying_why(
    adapters: list[dict[str, Any]], model: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(adapters, **model)


def test_an_adapter_may_take_the_model_name_when_the_service_serves_another() -> None:
    # Clients send the served name; the catalog name is the planner's.
    assert spec([{"name": "llama-3-8b", "source": "/a"}], servedModelName="chat").adapters[0].name == "llama-3-8b"


def test_the_crd_refuses_what_the_spec_refuses() -> None:
    schema = _spec_schema()
    adapters = schema["properties"]["adapters"]
    # The API server keeps one entry per name (a list map), so repeated names never reach the operator.
    assert adapters["x-kubernetes-list-type"] == "map"
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["maxItems"] == MAX_ADAPTERS
    item = adapters["items"]
    assert item["required"] == ["name", "source"]
    assert item["properties"]["name"]["pattern"] == ADAPTER_NAME
    assert item["properties"]["name"]["maxLength"] == 63
    assert (item["properties"]["rank"]["minimum"], item["properties"]["rank"]["maximum"]) == (1, 512)
    (source_rule,) = item["x-kubernetes-validations"]
    assert source_rule["rule"] == f"self.source.matches('{SOURCE_PATTERN}')"
    for source in GOOD:
        assert re.search(SOURCE_PATTERN, source) and spec([{"name": "a", "source": source}])
    for source in BAD:
        assert not re.search(SOURCE_PATTERN, source)
        with pytest.raises(ValidationError, match="adapters\\[\\].source"):
            spec([{"name": "a", "source": source}])
    (name_rule,) = [r for r in schema["x-kubernetes-validations"] if "self.adapters.all(" in r["rule"]]
    assert name_rule["rule"] == (
        "!has(self.adapters) || self.adapters.all(a, a.name != (has(self.model.servedModelName) ? "
        "self.model.servedModelName : self.model.name))"
    )
    assert "must differ from the served model name" in name_rule["message"]


@pytest.mark.parametrize("name", ["sql", "support.v2", "a", "x1-lora", "a" * 63])
def test_names_clients_send(name: str) -> None:
    assert spec([{"name": name, "source": "/a"}]).adapters[0].name == name
