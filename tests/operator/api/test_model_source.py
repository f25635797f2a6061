"""Where an engine pod's model comes from: hf:// (an init container downloads it into a cache
volume), pvc:// (mounted) or a path in the image; and the sources the spec and the CRD refuse."""

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvpilot.engine.cli import build_parser
from kvpilot.operator.api.spec import SOURCE_PATTERN, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning.plan import plan

UID = "0b7c6e1e-0000-4000-8000-000000000002"
CRD = Path(__file__).resolve().parents[3] / "crds" / "inferenceservice.yaml"


def spec(model: dict[str, Any], **overrides: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-2-7b", **model}, "accelerator": {"type": "A10G"}, **overrides}
    )


def pod(s: InferenceServiceSpec) -> dict[str, Any]:
    return render.deployment("chat", "ml", UID, s, plan(s), default_image="reg/kvpilot:1")["spec"]["template"]["spec"]


def engine_model(pod_spec: dict[str, Any]) -> str:
    args = pod_spec["containers"][0]["args"]
    return args[args.index("--model") + 1]


def test_hf_source_is_downloaded_by_an_init_container_into_the_folder_the_engine_loads() -> None:
    p = pod(
        spec(
            {
                "source": "hf://meta-llama/Llama-2-7b-hf@v1.0",
                "tokenSecret": {"name": "hf"},
                "cache": {"claimName": "models"},
            }
        )
    )
    (init,) = p["initContainers"]
    engine = p["containers"][0]
    assert init["command"] == ["kvpilot", "download"]
    # The download command's own parser accepts the rendered arguments.
    args = build_parser("download").parse_args(["download", *init["args"]])
    assert (args.repo, args.revision) == ("meta-llama/Llama-2-7b-hf", "v1.0")
    assert engine_model(p) == args.local_dir == "/model-cache/hf/meta-llama/Llama-2-7b-hf@v1.0"
    assert (
        (init["image"], init["imagePullPolicy"])
        == (engine["image"], engine["imagePullPolicy"])
        == ("reg/kvpilot:1", "IfNotPresent")
    )
    # The named claim holds the download; the init container writes it, the engine only reads.
    volumes = {v["name"]: v for v in p["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    assert {"name": "model-cache", "mountPath": "/model-cache"} in init["volumeMounts"]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine["volumeMounts"]
    # The token reaches the download only, from the Secret (default key "token").
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert all(e["name"] != "HF_TOKEN" for e in engine["env"])
    # Read-only root filesystem as for the engine: it writes only to its volumes (HOME=/tmp).
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HOME", "value": "/tmp"} in init["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]


def test_without_a_claim_the_cache_is_an_empty_dir_and_no_token_is_asked_for() -> None:
    p = pod(spec({"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}))
    (init,) = p["initContainers"]
    # Sized as model.name says, llama-2-7b: 12.6 GiB at 16 bits x 1.1 + 1 GiB, twice (room for a
    # 32-bit checkpoint): past 30 GiB the pod would be evicted.
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "30Gi"}} in p["volumes"]
    assert "--revision" in init["args"] and init["args"][init["args"].index("--revision") + 1] == "main"
    assert engine_model(p) == "/model-cache/hf/HuggingFaceTB/SmolLM2-135M-Instruct@main"
    assert all(e["name"] != "HF_TOKEN" for e in init["env"])


def test_a_revision_with_slashes_stays_one_folder_name() -> None:
    p = pod(spec({"source": "hf://org/model@refs/pr/1"}))
    args = build_parser("download").parse_args(["download", *p["initContainers"][0]["args"]])
    assert args.revision == "refs/pr/1"
    assert args.local_dir == engine_model(p) == "/model-cache/hf/org/model@refs%2Fpr%2F1"


def test_the_download_leaves_the_engines_requests_and_the_pods_alone() -> None:
    hub, local = pod(spec({"source": "hf://meta-llama/Llama-2-7b-hf"})), pod(spec({"source": "/opt/llama"}))
    engine = hub["containers"][0]
    # Memory request of the weights plus the margin, as for any other source; and, for the
    # emptyDir the download fills, the disk the checkpoint needs (12.6 GiB x 1.1 + 1 GiB).
    requests = dict(engine["resources"]["requests"])
    assert requests.pop("ephemeral-storage") == "15Gi"
    assert {**engine["resources"], "requests": requests} == local["containers"][0]["resources"]
    assert engine["resources"]["requests"]["memory"] == "15Gi"
    # The pod's scheduling request is the larger of an init container's and the app containers':
    # the download's stays below the engine's, so it is the engine's.
    requests = hub["initContainers"][0]["resources"]["requests"]
    assert float(requests["cpu"]) < float(engine["resources"]["requests"]["cpu"])
    assert int(requests["memory"].removesuffix("Gi")) < int(
        engine["resources"]["requests"]["memory"].removesuffix("Gi")
    )
    assert "limits" not in hub["initContainers"][0]["resources"]


def test_pod_env_reaches_the_download_and_the_token_secret_comes_last() -> None:
    p = pod(
        spec(
            {"source": "hf://org/model", "tokenSecret": {"name": "hf", "key": "HF_TOKEN"}},
            env=[{"name": "HF_ENDPOINT", "value": "http://mirror.example"}],
            envFrom=[{"secretRef": {"name": "proxy"}}],
        )
    )
    init = p["initContainers"][0]
    names = [e["name"] for e in init["env"]]
    assert names == ["HOME", "HF_ENDPOINT", "HF_TOKEN"]
    assert init["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert init["envFrom"] == [{"secretRef": {"name": "proxy"}}]


@pytest.mark.parametrize(
    "model, expected, volume",
    [
        ({"source": "pvc://weights/llama-2-7b"}, "/models/weights/llama-2-7b", "model"),
        ({"source": "/opt/models/llama"}, "/opt/models/llama", None),
        ({}, "llama-2-7b", None),
    ],
)
def test_other_sources_need_no_download(model: dict[str, Any], expected: str, volume: str | None) -> None:
    p = pod(spec(model))
    assert "initContainers" not in p
    assert engine_model(p) == expected
    assert [v["name"] for v in p["volumes"]] == ([volume] if volume else []) + ["tmp"]


GOOD = [
    "hf://org/repo",
    "hf://org/repo@main",
    "hf://Org-1/re.po_2@0123abc",
    "hf://org/repo@refs/pr/1",
    "pvc://weights",
    "pvc://weights/llama/7b",
    "pvc://my.claim-1/x",
    "/opt/models/llama",
]
BAD = [
    "s3://bucket/model",
    "gs://b/m",
    "hf://repo-without-org",
    "hf://org/repo@",
    "hf://org/repo@a@b",
    "hf://org/re po",
    "hf:///repo",
    "hf://-org/repo",
    "pvc://Weights/x",
    "pvc:///x",
    "pvc://",
    "meta-llama/Llama-2-7b-hf",
    "models/llama",
    "",
    "https://huggingface.co/org/repo",
]


@pytest.mark.parametrize("extra", [{"tokenSecret": {"name": "hf"}}, {"cache": {"claimName": "c"}}])
@pytest.mark.parametrize("source", ["pvc://weights/x", "/opt/llama"])
def test_token_and_cache_belong_to_hf_sources(extra: dict[str, Any], source: str | None) -> None:
    model = {**({"source": source} if source else {}), **extra}
    with pytest.raises(ValidationError, match="apply only to hf:// sources"):
        spec(model)
    with pytest.raises(ValidationError, match="apply only to hf:// sources"):
        spec(model, serving={"draftModel": "/opt/draft"})
    # An hf:// draft model is downloaded with them, an hf:// adapter loaded with the token.
    spec(model, serving={"draftModel": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"})
    InferenceServiceSpec.model_validate(
        {"model": {"name": "llama-2-7b", **model}, "adapters": [{"name": "sql", "source": "hf://org/sql-lora"}]}
    )


@pytest.mark.parametrize("extra", [{"tokenSecret": {"name": "hf"}}, {"cache": {"claimName": "c"}}])
@pytest.mark.parametrize("runtime", ["kvpilot", "vllm"])
def test_token_and_cache_go_with_the_repository_a_model_name_stands_for(extra: dict[str, Any], runtime: str) -> None:
    # No model.source: the operator downloads the catalog's (or the named) repository, which a gated
    # one (meta-llama's) needs the token for.
    spec(extra, runtime=runtime)
    with pytest.raises(ValidationError, match="apply only to hf:// sources"):
        spec({"source": "pvc://weights/x", **extra}, runtime=runtime)


def _crd_rules(section: str) -> list[dict[str, str]]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return (
        spec_schema["x-kubernetes-validations"]
        if section == "spec"
        else spec_schema["properties"][section]["x-kubernetes-validations"]
    )


@pytest.mark.parametrize("field", ["model.source", "serving.draftModel"])
def test_the_crd_and_the_spec_accept_the_same_sources_and_refuse_others_saying_which(field: str) -> None:
    section, name = field.split(".")
    (source_rule,) = [r for r in _crd_rules(section) if f"self.{name}.matches(" in r["rule"]]
    match = re.fullmatch(rf"!has\(self\.{name}\) \|\| self\.{name}\.matches\('(.*)'\)", source_rule["rule"])
    assert match is not None, source_rule["rule"]
    assert match[1] == SOURCE_PATTERN
    assert (
        source_rule["message"]
        == f"{field} must be hf://org/repo[@revision], pvc://claim/path or an absolute path in the engine image"
    )

    def valid(source: str) -> InferenceServiceSpec:
        return spec({"source": source}) if section == "model" else spec({}, serving={"draftModel": source})

    for source in GOOD:
        assert re.search(match[1], source), source
        valid(source)
    for source in BAD:
        assert not re.search(match[1], source), source
        with pytest.raises(ValidationError, match=re.escape(f"{field} {source!r} must be hf://org/repo[@revision]")):
            valid(source)


def test_the_crd_puts_token_and_cache_with_either_hf_source() -> None:
    rule = next(r for r in _crd_rules("spec") if "tokenSecret" in r["rule"])
    assert rule["rule"] == (
        "!(has(self.model.tokenSecret) || has(self.model.cache)) || "
        "!has(self.model.source) || self.model.source.startsWith('hf://') || "
        "(has(self.serving) && has(self.serving.draftModel) && "
        "self.serving.draftModel.startsWith('hf://')) || "
        "(has(self.adapters) && self.adapters.exists(a, a.source.startsWith('hf://')))"
    )
    assert "apply only to hf:// sources" in rule["message"]
