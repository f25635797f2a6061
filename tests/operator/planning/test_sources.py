"""model.source where a spec leaves it unset: vLLM runs offline in the pod (HF_HUB_OFFLINE=1), so
`vllm serve llama-3-8b` would load nothing, and our engine loads a folder or its embedded model only;
the spec gets the repository its name stands for."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning.models import MODELS, catalog_repo, hub_repo
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.planning.sources import missing_source, with_model_source


def spec(model: dict[str, Any], runtime: str = "vllm") -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {"model": model, "runtime": runtime, "accelerator": {"type": "H100-80GB"}}
    )


def test_every_catalog_model_records_its_hub_repository() -> None:
    # A catalog model without one would leave a vLLM spec naming it without files to load.
    assert {name: catalog_repo(name) for name in MODELS if catalog_repo(name) is None} == {}
    assert catalog_repo("llama-3-8b") == "meta-llama/Meta-Llama-3-8B"
    assert catalog_repo("mixtral-8x7b") == "mistralai/Mixtral-8x7B-v0.1"


@pytest.mark.parametrize(
    ("name", "repo"),
    [
        ("llama-3-8b", "meta-llama/Meta-Llama-3-8B"),
        ("Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),
        ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        # A repository is itself, as `vllm serve org/repo` takes it (catalog or not).
        ("meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B-Instruct"),
        ("acme/tiny-chat@v2", "acme/tiny-chat@v2"),
        # find_model's alias of llama-3-8b, whose repository holds the base model, not this one.
        ("Meta-Llama-3-8B-Instruct", None),
        ("my-finetune", None),
        ("a/b/c", None),
    ],
)
def test_a_name_stands_for_a_repository_only_when_it_names_one_exactly(name: str, repo: str | None) -> None:
    assert hub_repo(name) == repo


def test_vllm_without_a_source_downloads_the_catalog_models_repository() -> None:
    defaulted = with_model_source(spec({"name": "llama-3-8b"}))
    assert defaulted.model.source == "hf://meta-llama/Meta-Llama-3-8B"
    assert missing_source(defaulted) is None
    # The plan counts the download in the pod's start (the Deployment's progress deadline).
    assert plan(defaulted).predicted_ready_s > plan(spec({"name": "llama-3-8b"})).predicted_ready_s


def test_a_source_given_and_kvpilots_named_models_stay_as_they_are() -> None:
    given = spec({"name": "llama-3-8b", "source": "pvc://weights/llama"})
    assert with_model_source(given) is given
    # The kvpilot engine loads its embedded model by name (as its loader: any case), with no download.
    for name in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"):
        embedded = spec({"name": name}, runtime="kvpilot")
        assert with_model_source(embedded) is embedded and missing_source(embedded) is None


def test_our_engine_gets_the_files_of_any_other_model() -> None:
    """It loads a folder with config.json or its embedded model, nothing else by name: a catalog name
    is downloaded as for vLLM (the catalog's key for the embedded model too), another is refused."""
    assert with_model_source(spec({"name": "llama-3-8b"}, runtime="kvpilot")).model.source == (
        "hf://meta-llama/Meta-Llama-3-8B"
    )
    assert with_model_source(spec({"name": "smollm2-135m"}, runtime="kvpilot")).model.source == (
        "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    why = missing_source(with_model_source(spec({"name": "my-finetune"}, runtime="kvpilot")))
    assert why is not None and why.startswith("runtime kvpilot loads the files the pod has")


def test_vllm_with_a_name_that_stands_for_no_repository_says_to_set_the_source() -> None:
    unknown = with_model_source(spec({"name": "Meta-Llama-3-8B-Instruct"}))
    assert unknown.model.source is None
    why = missing_source(unknown)
    assert why is not None and why.startswith("runtime vllm loads the files the pod has")
    assert "set model.source (hf://org/repo, pvc://claim/path, or a path in spec.image)" in why
    # Planning needs no files: the what-if still plans it (the catalog's architecture).
    assert plan(unknown).fits
