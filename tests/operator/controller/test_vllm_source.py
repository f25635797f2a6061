"""A vLLM service without model.source: the operator downloads the repository its model name stands
for (planning/sources.py), or says Ready=False (ModelSourceRequired) instead of rolling out a pod that
loads nothing; `kvpilot render` prints the same, `kvpilot plan` still plans."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml

from kvpilot.operator.api import names
from kvpilot.operator.controller.reconcile import reconcile
from kvpilot.operator.planning.models import MODELS
from tests.operator.controller.test_reconcile import NOW, FakeCluster, body, condition
from tests.operator.test_operator_cli import parser, run

SPEC: dict[str, Any] = {
    "runtime": "vllm",
    "model": {"name": "llama-3-8b", "tokenSecret": {"name": "hf-token"}},
    "accelerator": {"type": "H100-80GB"},
}
# A name that is neither a catalog model nor a repository, planned from its architecture.
UNKNOWN: dict[str, Any] = {
    "runtime": "vllm",
    "model": {"name": "my-finetune", "architecture": MODELS["llama-3-8b"].model_dump(by_alias=True)},
    "accelerator": {"type": "H100-80GB"},
}


def test_a_catalog_model_is_downloaded_from_its_repository_and_vllm_loads_the_download() -> None:
    cluster = FakeCluster()
    reconcile(body(SPEC), cluster, NOW)
    pod = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["args"][:3] == ["meta-llama/Meta-Llama-3-8B", "--revision", "main"]
    # Meta's repositories are gated: the token reaches the download.
    assert any(e["name"] == "HF_TOKEN" for e in download["env"])
    (engine,) = pod["containers"]
    assert engine["args"][0] == "/model-cache/hf/meta-llama/Meta-Llama-3-8B@main"
    assert f"--served-model-name={SPEC['model']['name']}" in engine["args"]


def test_a_repository_as_the_model_name_is_downloaded_and_served_under_that_name() -> None:
    cluster = FakeCluster()
    spec = {**SPEC, "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"}}
    reconcile(body(spec), cluster, NOW)
    (engine,) = cluster.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["containers"]
    assert engine["args"][0] == "/model-cache/hf/meta-llama/Meta-Llama-3-8B-Instruct@main"
    assert "--served-model-name=meta-llama/Meta-Llama-3-8B-Instruct" in engine["args"]


def test_a_name_that_stands_for_no_repository_is_not_ready_and_rolls_out_nothing() -> None:
    cluster = FakeCluster()
    status = reconcile(body(UNKNOWN), cluster, NOW)
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelSourceRequired")
    assert ready["message"].startswith("runtime vllm loads the files the pod has")
    assert "set model.source (hf://org/repo, pvc://claim/path, or a path in spec.image)" in ready["message"]
    assert ("Deployment", "ml", "chat") not in cluster.objects
    # With a source it rolls out.
    sourced = {**UNKNOWN, "model": {**UNKNOWN["model"], "source": "pvc://weights/my-finetune"}}
    reconcile(body(sourced), cluster, NOW)
    assert ("Deployment", "ml", "chat") in cluster.objects


def _manifest(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": names.API_VERSION, "kind": names.KIND, "spec": spec}))
    return path


def _render(path: Path) -> tuple[int, list[dict[str, Any]]]:
    out = io.StringIO()
    args = parser().parse_args(["render", "-f", str(path)])
    code = args.func(args, out=out)
    return code, list(yaml.safe_load_all(out.getvalue()))


def test_the_cli_renders_what_the_operator_would_and_still_plans_without_a_source(tmp_path: Path) -> None:
    code, objects = _render(_manifest(tmp_path, SPEC))
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert code == 0
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][0].startswith("/model-cache/hf/")
    code, objects = _render(_manifest(tmp_path, UNKNOWN))
    assert code == 1 and "Deployment" not in [o["kind"] for o in objects]
    # The what-if plans it: the files matter to the pod, not to the plan.
    code, text = run(f"plan -f {_manifest(tmp_path, UNKNOWN)}")
    assert code == 0, text
