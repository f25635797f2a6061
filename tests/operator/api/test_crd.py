"""The CRDs are valid and structural, the shipped InferenceService CRD is the one generated from the
pydantic types (operator/api/crd.py), and it accepts and refuses what the models and the status we
write say it should.

No API server here (the e2e suite applies the CRD to a real one), so this checks the structural
schema rules and validates objects against the schema with a small validator for the subset of
OpenAPI the CRD uses.
"""

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from kvpilot.operator.api.crd import crd as generated_crd
from kvpilot.operator.api.names import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvpilot.operator.api.spec import BLOCK_SIZES, VARIANTS_UNIQUE, InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.autoscaling.accuracy import SUSTAIN_PERIODS, accuracy_patch
from kvpilot.operator.autoscaling.decisions import Signals
from kvpilot.operator.controller.reconcile import last_good, planned_fields
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.plan import plan
from tests.operator.statuses import reconciled

ROOT = Path(__file__).resolve().parents[3]
CRDS = ROOT / "crds"
Schema = dict[str, Any]


def load(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((CRDS / name).read_text()))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    (document,) = load("inferenceservice.yaml")
    return document


def version(crd: dict[str, Any]) -> dict[str, Any]:
    (v,) = crd["spec"]["versions"]
    return v


def root(crd: dict[str, Any]) -> Schema:
    return version(crd)["schema"]["openAPIV3Schema"]


VALUE_KEYS = {
    "type",
    "format",
    "description",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "maxItems",
    "pattern",
    "required",
    "properties",
    "items",
    "additionalProperties",
    "anyOf",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def check_structural(node: Schema, path: str) -> None:
    """The Kubernetes structural-schema rules the CRD relies on."""
    assert set(node) <= VALUE_KEYS, f"{path}: unexpected keys {set(node) - VALUE_KEYS}"
    if node.get("x-kubernetes-int-or-string"):
        assert "type" not in node
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
    else:
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            f"{path}: every node needs a type"
        )
        assert "anyOf" not in node, path
    assert not ("properties" in node and "additionalProperties" in node), path
    if "x-kubernetes-preserve-unknown-fields" in node:
        assert node["type"] == "object" and node["x-kubernetes-preserve-unknown-fields"] is True
    for rule in node.get("x-kubernetes-validations", []):
        assert set(rule) <= {"rule", "message"} and rule["rule"] and rule["message"], path
    if "x-kubernetes-list-type" in node:
        assert node["type"] == "array"
        if node["x-kubernetes-list-type"] == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert keys and set(keys) <= set(node["items"].get("required", [])), path
    if node.get("type") == "object":
        for name, child in node.get("properties", {}).items():
            check_structural(child, f"{path}.{name}")
        for name in node.get("required", []):
            assert name in node["properties"], f"{path}: required {name} is not a property"
        if isinstance(node.get("additionalProperties"), dict):
            check_structural(node["additionalProperties"], f"{path}.*")
        if "default" in node:
            validate(node["default"], node, path)
    if node.get("type") == "array":
        check_structural(node["items"], f"{path}[]")
    if node.get("type") in {"string", "integer", "number"} and "default" in node:
        validate(node["default"], node, path)


def validate(value: Any, node: Schema, path: str = "") -> None:
    """Validate `value` against the OpenAPI subset used by the CRD (raises AssertionError)."""
    if node.get("x-kubernetes-int-or-string"):
        assert isinstance(value, int | str) and not isinstance(value, bool), path
        return
    kind = node["type"]
    python = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": int | float}[
        kind
    ]
    assert isinstance(value, python) and (kind == "boolean" or not isinstance(value, bool)), (
        f"{path}: {value!r} is not {kind}"
    )
    if "enum" in node:
        assert value in node["enum"], f"{path}: {value!r} not in {node['enum']}"
    if "minimum" in node:
        assert value > node["minimum"] if node.get("exclusiveMinimum") else value >= node["minimum"], path
    if "maximum" in node:
        assert value < node["maximum"] if node.get("exclusiveMaximum") else value <= node["maximum"], path
    if "minLength" in node:
        assert len(value) >= node["minLength"], path
    if "maxLength" in node:
        assert len(value) <= node["maxLength"], path
    if "pattern" in node:
        assert re.search(node["pattern"], value), f"{path}: {value!r} does not match {node['pattern']}"
    if "maxItems" in node:
        assert len(value) <= node["maxItems"], path
    if kind == "object":
        for name in node.get("required", []):
            assert name in value, f"{path}: missing {name}"
        properties = node.get("properties")
        for key, item in value.items():
            if properties is not None:
                assert key in properties, f"{path}: unknown field {key} (would be pruned)"
                validate(item, properties[key], f"{path}.{key}")
            elif isinstance(node.get("additionalProperties"), dict):
                validate(item, node["additionalProperties"], f"{path}.{key}")
    if kind == "array":
        for index, item in enumerate(value):
            validate(item, node["items"], f"{path}[{index}]")


def apply_defaults(value: Any, node: Schema) -> Any:
    """What the API server's defaulting does to an object (defaults of absent fields, recursively)."""
    if node.get("type") == "object" and isinstance(value, dict) and "properties" in node:
        result = dict(value)
        for name, child in node["properties"].items():
            if name not in result and "default" in child:
                result[name] = child["default"]
            if name in result:
                result[name] = apply_defaults(result[name], child)
        return result
    if node.get("type") == "array" and isinstance(value, list):
        return [apply_defaults(item, node["items"]) for item in value]
    return value


def test_the_shipped_crd_is_what_kvpilot_crd_prints(crd: dict[str, Any]) -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "crd"], capture_output=True, cwd=ROOT, check=False
    )
    assert printed.returncode == 0, printed.stderr.decode()
    assert (CRDS / "inferenceservice.yaml").read_bytes() == printed.stdout, (
        "crds/inferenceservice.yaml is not what `kvpilot crd` prints from operator/api/spec.py and status.py: "
        "run `kvpilot crd > crds/inferenceservice.yaml`"
    )
    assert crd == generated_crd()


def test_crd_identity_names_and_subresources(crd: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert crd["spec"]["group"] == GROUP and crd["spec"]["scope"] == "Namespaced"
    names = crd["spec"]["names"]
    assert names["kind"] == KIND and names["plural"] == PLURAL
    assert names["shortNames"] == ["kvis"] and "isvc" not in names["shortNames"]
    v = version(crd)
    assert (v["name"], v["served"], v["storage"]) == (VERSION, True, True)
    assert API_VERSION == f"{GROUP}/{VERSION}"
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_scale_paths_point_at_integer_and_string_fields(crd: dict[str, Any]) -> None:
    properties = root(crd)["properties"]
    assert properties["spec"]["properties"]["replicas"]["type"] == "integer"
    assert properties["status"]["properties"]["replicas"]["type"] == "integer"
    assert properties["status"]["properties"]["selector"]["type"] == "string"


def test_printer_columns(crd: dict[str, Any]) -> None:
    columns = {c["name"]: c["jsonPath"] for c in version(crd)["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.name",
        "Runtime": ".spec.runtime",
        "GPU": ".status.plan.gpu",
        "GPUs": ".status.plan.gpuCount",
        "Quant": ".status.plan.quantization",
        "Replicas": ".status.replicas",
        "Ready-Replicas": ".status.readyReplicas",
        # The Ready condition and its reason, as `kubectl get` shows them for built-in kinds.
        "Ready": '.status.conditions[?(@.type=="Ready")].status',
        "Status": '.status.conditions[?(@.type=="Ready")].reason',
        "TTFT-P95": ".status.latency.ttftP95Ms",
        "TPOT-P95": ".status.latency.tpotP95Ms",
        # What the service costs an hour: kubectl get shows the total (a mixed pool's variants summed).
        "Cost-Per-Hour": ".status.costPerHour",
        "Age": ".metadata.creationTimestamp",
        "URL": ".status.url",
        "Plan-Accurate": '.status.conditions[?(@.type=="PlanAccurate")].status',
    }
    # The URL is long, and whether the plan holds is for a closer look: only `kubectl get -o wide`.
    assert {c["name"] for c in version(crd)["additionalPrinterColumns"] if c.get("priority")} == {
        "URL",
        "Plan-Accurate",
    }


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    check_structural(root(crd), "")
    assert set(root(crd)["properties"]["metadata"]) == {"type"}


def test_cel_rules_cover_what_the_schema_cannot_say(crd: dict[str, Any]) -> None:
    spec = root(crd)["properties"]["spec"]["properties"]

    def rules(section: str) -> str:
        return " ".join(r["rule"] for r in spec[section]["x-kubernetes-validations"])

    assert "self.minReplicas <= self.maxReplicas" in rules("autoscaling")
    assert "self.ttftP95Ms > 0.0" in rules("slo") and "self.tpotP95Ms > 0.0" in rules("slo")
    assert f"self.blockSize in [{', '.join(map(str, BLOCK_SIZES))}]" in rules("serving")
    assert "self.speculative in ['draft', 'eagle']" in rules("serving") and "has(self.draftModel)" in rules("serving")
    architecture = spec["model"]["properties"]["architecture"]["x-kubernetes-validations"]
    assert architecture[0]["rule"] == "self.attentionHeads % self.kvHeads == 0"


def _variants_unique(rule: str) -> Any:
    """The accelerator's (type, capacityClass) uniqueness rule as a Python predicate over the
    variants' list: its CEL read term by term (has(x.f) ? x.f : '' is x.get(f, '')), so a rule that
    stops saying what pydantic says fails here, not first on an API server."""
    match = re.fullmatch(
        r"!has\(self\.variants\) \|\| self\.variants\.all\(v, self\.variants\.exists_one\(w, (.*)\)\)", rule
    )
    assert match is not None, rule
    condition = re.sub(r"\(has\((\w)\.(\w+)\) \? \1\.\2 : ''\)", r"\1.get('\2', '')", match[1])
    condition = re.sub(r"\b([vw])\.(?!get\()(\w+)", r"\1['\2']", condition).replace("&&", "and")
    assert set(re.findall(r"\w+", condition)) <= {"v", "w", "get", "type", "capacityClass", "and"}, condition
    return lambda variants: all(
        sum(1 for w in variants if eval(condition, {}, {"v": v, "w": w})) == 1 for v in variants
    )


@pytest.mark.parametrize(
    "variants",
    [
        [{"type": "L4"}, {"type": "H100-80GB"}],
        [{"type": "L4", "capacityClass": "spot"}, {"type": "L4", "capacityClass": "on-demand"}, {"type": "L4"}],
        [{"type": "L4"}, {"type": "L4", "maxReplicas": 2}],
        [{"type": "L4", "capacityClass": "spot"}, {"type": "H100-80GB"}, {"type": "L4", "capacityClass": "spot"}],
    ],
    ids=["two-types", "one-type-three-classes", "a-type-twice", "a-type-twice-on-one-class"],
)
def test_a_variant_is_one_per_type_and_capacity_class_in_cel_as_in_pydantic(
    crd: dict[str, Any], variants: list[dict[str, Any]]
) -> None:
    accelerator = root(crd)["properties"]["spec"]["properties"]["accelerator"]
    (rule,) = [r for r in accelerator["x-kubernetes-validations"] if r["message"] == VARIANTS_UNIQUE]
    cel_accepts = _variants_unique(rule["rule"])(variants)
    try:
        InferenceServiceSpec.model_validate({"model": {"name": "llama-3-8b"}, "accelerator": {"variants": variants}})
        pydantic_accepts = True
    except ValidationError as error:
        assert VARIANTS_UNIQUE in str(error)
        pydantic_accepts = False
    assert cel_accepts == pydantic_accepts
    assert cel_accepts == (len({(v["type"], v.get("capacityClass")) for v in variants}) == len(variants))


def test_the_name_must_be_able_to_name_a_service(crd: dict[str, Any]) -> None:
    # At the schema root, CEL sees metadata.name; the Service the operator renders takes it.
    (rule,) = root(crd)["x-kubernetes-validations"]
    assert "DNS-1035 label" in rule["message"]
    pattern = re.fullmatch(
        r"size\(self\.metadata\.name\) <= (\d+) && "
        r"self\.metadata\.name\.matches\('(.*)'\)",
        rule["rule"],
    )
    assert pattern is not None, rule["rule"]
    limit, regex = int(pattern[1]), pattern[2]
    assert (limit, regex) == (63, "^[a-z]([-a-z0-9]*[a-z0-9])?$")

    def allowed(name: str) -> bool:
        return len(name) <= limit and re.fullmatch(regex, name) is not None

    assert all(map(allowed, ["db", "llama-3-8b", "a" * 63, "x1"]))
    assert not any(map(allowed, ["7b-chat", "db.v2", "Chat", "chat-", "a" * 64, "my_model", ""]))


ARCHITECTURE = {
    "layers": 2,
    "hiddenSize": 64,
    "attentionHeads": 4,
    "kvHeads": 2,
    "vocabSize": 10,
    "parameters": 10,
    "maxContext": 16,
}


@pytest.mark.parametrize(
    "bad",
    [
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        {"slo": {"ttftP95Ms": 0}},
        {"slo": {"tpotP95Ms": -5}},
        {"serving": {"blockSize": 24}},
        {"serving": {"speculative": "draft"}},
        {"accelerator": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}},
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "attentionHeads": 6, "kvHeads": 4}}},
        # A chunk needs its size (slidingWindow): CEL's "slidingKind chunk needs slidingWindow".
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "slidingKind": "chunk"}}},
        # The MTP modules are some of the checkpoint's bytes: CEL's "mtpBytes must be fewer than checkpointBytes".
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "mtpBytes": 10}}},
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "mtpBytes": 10, "checkpointBytes": 10}}},
    ],
)
def test_pydantic_spec_enforces_the_same_rules_as_cel(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate({"model": {"name": "llama-2-7b"}, **bad})


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        if get_origin(candidate) is list:
            return _nested_model(get_args(candidate)[0])
    return None


def _missing_fields(model: type[BaseModel], node: Schema, path: str) -> list[str]:
    """Where `model`'s fields (and its nested models', recursively) and `node`'s properties differ:
    each field is a property under its camelCase alias, and each property a field."""
    if node.get("type") == "array":
        node = node["items"]
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    missing = [f"{path}.{alias}" for alias in sorted(set(fields) ^ set(node["properties"]))]
    for alias, field in fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None and alias in node["properties"]:
            missing += _missing_fields(nested, node["properties"][alias], f"{path}.{alias}")
    return missing


@pytest.mark.parametrize("section, model", [("spec", InferenceServiceSpec), ("status", InferenceServiceStatus)])
def test_every_field_is_in_the_schema_under_its_alias(
    crd: dict[str, Any], section: str, model: type[BaseModel]
) -> None:
    assert _missing_fields(model, root(crd)["properties"][section], section) == []


def test_the_field_check_sees_a_field_missing_or_misnamed(crd: dict[str, Any]) -> None:
    spec = copy.deepcopy(root(crd)["properties"]["spec"])
    serving = spec["properties"]["serving"]["properties"]
    del serving["blockSize"]
    serving["draftmodel"] = serving.pop("draftModel")
    assert _missing_fields(InferenceServiceSpec, spec, "spec") == [
        "spec.serving.blockSize",
        "spec.serving.draftModel",
        "spec.serving.draftmodel",
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"name": ""}},
        {"model": {"name": "x", "quantization": "int3"}},
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "layers": 0}}},
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "parameters": 0}}},
        {"model": {"name": "x", "architecture": {**ARCHITECTURE, "slidingWindow": 8, "slidingKind": "cyclic"}}},
        {"serving": {"numSpeculativeTokens": 17}},
        {"serving": {"gpuMemoryUtilization": 0}},
        {"serving": {"gpuMemoryUtilization": 1.01}},
        {"serving": {"quantization": "int3"}},
        {"load": {"meanPromptTokens": 0}},
        {"load": {"prefixShare": 1}},
        {"autoscaling": {"maxReplicas": 1001}},
        {"autoscaling": {"minReplicas": -1}},
        {"autoscaling": {"maxWaitingPerReplica": 0}},
        {"autoscaling": {"prometheusUrl": "ftp://prometheus"}},
        {"autoscaling": {"mode": "hpa"}},
        {"replicas": -1},
        {"image": ""},
        {"imagePullPolicy": "Sometimes"},
        {"accelerator": {"type": "cpu", "profile": "Not-A-Label"}},
        {"accelerator": {"count": 0}},
        {"rollout": {"maxDrainSeconds": 3601}},
        {"routing": {"strategy": "Random"}},
        {"inferencePool": {"endpointPicker": {"port": 0}}},
        {"inferencePool": {"endpointPicker": {"name": "7epp"}}},
        {"network": {"allowedNamespaces": ["ns"] * 65}},
        {"network": {"allowedNamespaces": ["Upper"]}},
        {"tolerations": [{"effect": "Sometimes"}]},
    ],
)
def test_the_schema_refuses_what_the_models_bounds_refuse(crd: dict[str, Any], bad: dict[str, Any]) -> None:
    """The schema is generated from the models: each bound, enum, length and pattern a model refuses
    a value with, the schema refuses it with too (the CEL rules are the test above's)."""
    manifest = {"model": {"name": "llama-2-7b"}, **bad}
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate(manifest)
    with pytest.raises(AssertionError):
        validate(manifest, root(crd)["properties"]["spec"], "spec")


@pytest.mark.parametrize(
    "minimal",
    [
        {"model": {"name": "llama-2-7b"}},
        {
            "model": {"name": "llama-2-7b"},
            "serving": {"quantization": "int4"},
            "slo": {},
            "autoscaling": {"maxReplicas": 9},
            "tolerations": [{"key": "k", "operator": "Exists"}],
        },
        {
            "model": {
                "name": "llama-2-7b",
                "source": "hf://meta-llama/Llama-2-7b-hf",
                "tokenSecret": {"name": "hf"},
                "cache": {},
            }
        },
    ],
)
def test_api_server_defaults_equal_pydantic_defaults(crd: dict[str, Any], minimal: dict[str, Any]) -> None:
    schema = root(crd)["properties"]["spec"]
    defaulted = apply_defaults(minimal, schema)
    validate(defaulted, schema, "spec")
    assert InferenceServiceSpec.model_validate(defaulted) == InferenceServiceSpec.model_validate(minimal)


def test_image_has_no_default_so_the_operator_supplies_one(crd: dict[str, Any]) -> None:
    image = root(crd)["properties"]["spec"]["properties"]["image"]
    assert "default" not in image
    minimal = {"model": {"name": "llama-2-7b"}}
    assert "image" not in apply_defaults(minimal, root(crd)["properties"]["spec"])
    assert InferenceServiceSpec.model_validate(minimal).image is None
    # An empty image would silently mean the default: both the schema and the model refuse it.
    with pytest.raises(AssertionError):
        validate("", image)
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate({**minimal, "image": ""})


def test_the_accelerator_description_lists_the_catalog(crd: dict[str, Any]) -> None:
    description = root(crd)["properties"]["spec"]["properties"]["accelerator"]["properties"]["type"]["description"]
    assert all(name in description for name in GPUS)


def _through_the_status_model(written: dict[str, Any]) -> dict[str, Any]:
    """A status read by operator/api/status.py's model and written back: the same object when the
    model has every field the code writes, under the same name."""
    return InferenceServiceStatus.model_validate(written).model_dump(by_alias=True, exclude_none=True)


@pytest.mark.parametrize("model, gpu", [("llama-2-7b", "A10G"), ("llama-3-70b", "A10G"), ("nope", "A10G")])
def test_status_we_write_validates_against_the_schema(crd: dict[str, Any], model: str, gpu: str) -> None:
    spec = InferenceServiceSpec.model_validate({"model": {"name": model}, "accelerator": {"type": gpu}})
    result = plan(spec)
    deployment = {
        "metadata": {"generation": 2},
        "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    }
    written = reconciled(
        spec,
        result,
        generation=3,
        deployment=deployment if result.fits else None,
        last_good=last_good(planned_fields(spec), str(result.gpu), result.reasons.get("gpu")) if result.fits else None,
    )
    validate(written, root(crd)["properties"]["status"], "status")
    assert _through_the_status_model(written) == written


def test_the_status_the_autoscaler_adds_validates_against_the_schema(crd: dict[str, Any]) -> None:
    """The loop's planAccuracy and PlanAccurate, on the status a reconcile wrote, are what the
    schema keeps (an API server prunes unknown fields and refuses wrong types)."""
    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-3-8b"}, "accelerator": {"type": "L4"}, "serving": {"speculative": "ngram"}}
    )
    result = plan(spec)
    written = reconciled(spec, result, generation=3)
    signals = Signals(
        ttft_p95_seconds=result.predicted_ttft_ms * 3 / 1000,
        tpot_p95_seconds=result.predicted_tpot_ms / 1000,
        ttft_observations=64,
        tpot_observations=60,
        draft_acceptance=0.31,
        prefix_share=0.4,
    )
    for period in range(SUSTAIN_PERIODS):
        written = {
            **written,
            **accuracy_patch(
                InferenceServiceStatus.model_validate(written), signals, 60.0, 1_800_000_000.0 + 15 * period, 3
            ),
        }
    accuracy = written["planAccuracy"]
    assert {"ttft", "tpot", "draftAcceptance", "prefixShare", "outsidePeriods", "outsideSince", "band"} <= set(accuracy)
    assert {c["type"]: c["status"] for c in written["conditions"]}["PlanAccurate"] == "False"
    validate(written, root(crd)["properties"]["status"], "status")
    assert _through_the_status_model(written) == written
    carried = reconciled(spec, result, written, generation=4)
    validate(carried, root(crd)["properties"]["status"], "status")
    assert _through_the_status_model(carried) == carried


def test_kopf_peering_crds() -> None:
    cluster, namespaced = load("kopf-peering.yaml")
    assert (cluster["metadata"]["name"], cluster["spec"]["scope"]) == ("clusterkopfpeerings.kopf.dev", "Cluster")
    assert (namespaced["metadata"]["name"], namespaced["spec"]["scope"]) == ("kopfpeerings.kopf.dev", "Namespaced")
    for crd in (cluster, namespaced):
        (v,) = crd["spec"]["versions"]
        assert crd["spec"]["group"] == "kopf.dev" and v["name"] == "v1"  # what kopf looks up
        check_structural(v["schema"]["openAPIV3Schema"], crd["spec"]["names"]["kind"])


def test_the_checkers_reject_what_an_api_server_would(crd: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match="every node needs a type"):
        check_structural({"type": "object", "properties": {"x": {"description": "untyped"}}}, "")
    status_schema = root(crd)["properties"]["status"]
    with pytest.raises(AssertionError, match="not in"):
        validate({"conditions": [{"type": "Ready", "status": "Yes"}]}, status_schema, "status")
    with pytest.raises(AssertionError, match="unknown field"):
        validate({"plan": {"fitz": True}}, status_schema, "status")
    with pytest.raises(AssertionError, match="missing"):
        validate({"conditions": [{"type": "Ready"}]}, status_schema, "status")
