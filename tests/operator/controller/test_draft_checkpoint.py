"""A draft model (serving.draftModel) that serving.draftModelArchitecture and the catalog do not
describe: its config.json is read where it is, as the target's is (from the Hub with the service's
token; from a claim or the engine image by an inspection Job), kept in the status, and planned from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.operator.api.inspection import CheckpointInspection
from kvpilot.operator.api.status import status_of
from kvpilot.operator.controller import inspection
from kvpilot.operator.controller.checkpoint import inspect_folder
from kvpilot.operator.controller.reconcile import decide, observe, reconcile
from kvpilot.operator.hub.client import HubError
from tests.operator.controller.test_decide import FakeHub, Secrets, deployment, kinds
from tests.operator.controller.test_inspection import IMAGE, job_pod
from tests.operator.controller.test_reconcile import NOW, FakeCluster, body, condition

CONFIGS = Path(__file__).parents[1] / "planning" / "hf_configs"
TARGET, DRAFT = "hf://meta-llama/Llama-3.3-70B-Instruct", "hf://meta-llama/Llama-3.2-3B"
# Llama-3.3-70B on vLLM, drafted by Llama-3.2-3B (the same tokenizer): both known only by their repositories.
SPEC = {
    "model": {"name": "llama-70b", "source": TARGET, "tokenSecret": {"name": "hub"}},
    "runtime": "vllm",
    "accelerator": {"type": "H100-80GB", "count": 2},
    "serving": {"speculative": "draft", "draftModel": DRAFT, "maxContextLength": 8192},
    "env": [{"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9999"}],
}


def config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


class Repositories(FakeHub):
    """A hub of several repositories; one it does not hold is refused as the Hub refuses it."""

    def __init__(self, configs: dict[str, dict[str, Any]], refused: HubError | None = None) -> None:
        super().__init__()
        self.configs, self.refused = configs, refused

    def config(self, repo: str, revision: str, token: str | None, endpoint: str | None = None) -> dict[str, Any]:
        self.asked.append((repo, revision, token, endpoint))
        if repo not in self.configs:
            raise self.refused or HubError(404, f"{endpoint}/{repo}/resolve/{revision}/config.json: 404 not found")
        return dict(self.configs[repo])


def both() -> Repositories:
    return Repositories(
        {
            "meta-llama/Llama-3.3-70B-Instruct": config("meta-llama--Llama-3.3-70B-Instruct"),
            "meta-llama/Llama-3.2-3B": config("meta-llama--Llama-3.2-3B"),
        }
    )


def test_a_draft_known_only_by_its_repository_is_read_from_the_hub_and_kept_for_when_it_is_down() -> None:
    hub = both()
    good = decide(observe(body(SPEC), Secrets(), None, hub), "i", None)  # type: ignore[arg-type]
    # Both repositories, with the service's token, at its endpoint.
    assert [(repo, token, endpoint) for repo, _, token, endpoint in hub.asked] == [
        ("meta-llama/Llama-3.3-70B-Instruct", "hf_token", "http://127.0.0.1:9999"),
        ("meta-llama/Llama-3.2-3B", "hf_token", "http://127.0.0.1:9999"),
    ]
    result = good.result
    assert result.fits and (result.speculative, result.draft_model) == ("draft", DRAFT), result.reason
    # Llama-3.2-3B as its config.json states it: 3.21 B parameters at 16 bits, 28 layers x 8 KV heads x 128.
    # Its 16-bit values, and its norms (two a layer and the last) whole on each of the other GPUs.
    norms = (result.gpu_count - 1) * (2 * 28 + 1) * 3072 * 2
    assert (
        result.draft_weight_bytes == 3_212_749_824 * 2 + norms
        and result.draft_kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    )
    args = deployment(good.wanted)["spec"]["template"]["spec"]["containers"][0]["args"]
    speculative = json.loads(next(a for a in args if a.startswith("--speculative-config=")).partition("=")[2])
    assert (
        speculative["method"] == "draft_model"
        and speculative["model"] == "/model-cache/hf/meta-llama/Llama-3.2-3B@main"
    )
    # Kept with the plan, in a form the status's types (and so the CRD's schema) take as written.
    assert good.last_good is not None
    written = good.last_good.dump()
    assert written["draftCheckpoint"]["architecture"]["layers"] == 28
    typed = status_of({"status": {"lastGoodPlan": written}}).last_good_plan
    assert typed is not None and typed.model_dump(mode="json", by_alias=True, exclude_none=True) == written
    # The operator restarted and the Hub is down: the kept configs render the same Deployment.
    down = Repositories({}, HubError(None, "http://127.0.0.1:9999/...: no answer"))
    kept = decide(observe(body(SPEC, status={"lastGoodPlan": written}), Secrets(), None, down), "i", None)  # type: ignore[arg-type]
    assert kept.result.failure == "ModelConfigUnavailable" and kept.last_good == good.last_good
    assert deployment(kept.wanted)["spec"]["template"]["spec"] == deployment(good.wanted)["spec"]["template"]["spec"]


def test_a_draft_the_hub_refuses_or_the_planner_cannot_read_is_not_ready_with_the_reason() -> None:
    only_target = Repositories({"meta-llama/Llama-3.3-70B-Instruct": config("meta-llama--Llama-3.3-70B-Instruct")})
    refused = decide(observe(body(SPEC), Secrets(), None, only_target), "i", None)  # type: ignore[arg-type]
    assert refused.result.failure == "ModelConfigUnavailable" and "Deployment" not in kinds(refused.wanted)
    assert refused.result.reason.startswith(f"serving.draftModel: {DRAFT}: http://127.0.0.1:9999/meta-llama/")
    assert "404 not found" in refused.result.reason
    mamba = both()
    mamba.configs["meta-llama/Llama-3.2-3B"] = config("tiiuae--falcon-mamba-7b")
    unsupported = decide(observe(body(SPEC), Secrets(), None, mamba), "i", None)  # type: ignore[arg-type]
    assert unsupported.result.failure == "UnsupportedArchitecture"
    assert f"serving.draftModel: {DRAFT}: FalconMambaForCausalLM is not an architecture" in unsupported.result.reason


def test_no_draft_is_read_when_the_plan_cannot_run_one_or_something_describes_it() -> None:
    for serving in (
        {"speculative": "ngram", "draftModel": DRAFT},
        {"speculative": "draft", "draftModel": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"},  # the catalog's
    ):
        hub = both()
        observe(body({**SPEC, "serving": serving}), Secrets(), None, hub)  # type: ignore[arg-type]
        assert [repo for repo, *_ in hub.asked] == ["meta-llama/Llama-3.3-70B-Instruct"]


def draft_job_name(source: str) -> str:
    return inspection.job_name("chat", "uid-1", source)


def test_a_draft_on_a_claim_is_read_by_its_own_inspection_job_and_recorded(tmp_path: Path) -> None:
    source = "pvc://models/llama-3.2-3b"
    claimed = {
        "model": {"name": "llama-3-8b"},
        "runtime": "vllm",
        "accelerator": {"type": "H100-80GB"},
        "serving": {"speculative": "draft", "draftModel": source},
    }
    cluster = FakeCluster()
    pending = reconcile(body(claimed), cluster, NOW, default_image=IMAGE)
    ready = condition(pending, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelConfigPending")
    assert ready["message"].startswith(f"serving.draftModel: Job ml/{draft_job_name(source)}")
    job = cluster.objects[("Job", "ml", draft_job_name(source))]
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pod_spec["containers"][0]["args"] == ["/models/models/llama-3.2-3b"]
    assert "Deployment" not in cluster.kinds()

    folder = tmp_path / "llama-3.2-3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config("meta-llama--Llama-3.2-3B")))
    found = inspect_folder(folder)
    assert isinstance(found, CheckpointInspection)
    job_pod(cluster, 0, found.message(), name=draft_job_name(source))
    planned = reconcile(body(claimed, status=pending), cluster, NOW, default_image=IMAGE)
    assert condition(planned, "Planned")["status"] == "True" and "Deployment" in cluster.kinds()
    assert planned["inspectedDraftCheckpoint"]["source"] == source and "inspectedCheckpoint" not in planned
    assert planned["inspectedDraftCheckpoint"]["architecture"]["layers"] == 28
    assert planned["plan"]["speculative"] == "draft"
    # The Job gone: planned from the status's record, no Job again.
    for key in [k for k in cluster.objects if k[0] in ("Job", "Pod")]:
        del cluster.objects[key]
    again = reconcile(body(claimed, status=planned), cluster, NOW, default_image=IMAGE)
    assert "Job" not in cluster.kinds() and condition(again, "Planned")["status"] == "True"
    assert again["inspectedDraftCheckpoint"] == planned["inspectedDraftCheckpoint"]
