"""Scenario 7: a real engine behind a simulated pod answers the official OpenAI client.

The sample InferenceService asks for the embedded model and leaves quantization and speculation
to the CRD's defaults (auto); the operator plans and renders its Deployment; kwok runs the pod (a
loopback pod IP, no process); a real `kvpilot serve`, started with exactly the rendered arguments
and bound to that pod IP, serves it.
"""

from __future__ import annotations

import filecmp
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster, is_loopback
from e2e.hub_server import HubServer
from e2e.local_engine import PodVolumes, engine_argv, key_env, start_engine
from e2e.local_operator import LocalOperator
from e2e.procs import Process, kvpilot_executable
from kvpilot.engine.contract.config import CAPABILITIES


@pytest.fixture()
def smollm2(k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any) -> dict[str, Any]:
    obj = kvis.sample("smollm2-135m")
    apply_isvc(obj["metadata"]["name"], obj["spec"])
    return kvis.wait_condition(k8s, kvpilot.watch_namespaces[0], obj["metadata"]["name"], "Ready", "True", timeout_s=60)


@pytest.fixture()
def engine(k8s: Cluster, smollm2: dict[str, Any], tmp_path: Path) -> Iterator[tuple[Process, str, dict[str, Any]]]:
    ns, name = smollm2["metadata"]["namespace"], smollm2["metadata"]["name"]
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    (pod,) = kvis.running_pods(k8s, ns, name)
    process, url = start_engine(deployment, pod, tmp_path / "engine.log", env=key_env(k8s, ns, deployment))
    try:
        yield process, url, pod
    finally:
        assert process.stop() == 0, process.log_tail()


def test_engine_behind_a_simulated_pod_answers_the_openai_client(
    k8s: Cluster, smollm2: dict[str, Any], engine: tuple[Process, str, dict[str, Any]]
) -> None:
    process, url, pod = engine
    ns, name = smollm2["metadata"]["namespace"], smollm2["metadata"]["name"]
    pod_ip = pod["status"]["podIP"]
    assert is_loopback(pod_ip) and url == f"http://{pod_ip}:8000"

    # Exactly the rendered arguments: only --host moved from 0.0.0.0 to the pod's IP.
    rendered = k8s.kubectl_json("get", "deployment", name, "-n", ns)["spec"]["template"]["spec"]["containers"][0]
    argv = process.argv
    assert argv[1:] == ["serve", *[pod_ip if a == "0.0.0.0" else a for a in rendered["args"]]]
    assert argv == engine_argv(k8s.kubectl_json("get", "deployment", name, "-n", ns), pod_ip)
    plan = smollm2["status"]["plan"]
    # The API server filled in the CRD's defaults; the plan chose among what this engine runs.
    serving = smollm2["spec"]["serving"]
    assert (serving["quantization"], serving["speculative"]) == ("auto", "auto")
    assert plan["quantization"] in CAPABILITIES.quantization and plan["speculative"] in CAPABILITIES.speculative
    # A small TPOT-bound load at temperature 0.7: the planner speculates with n-gram drafts.
    assert plan["speculative"] == "ngram" and argv[argv.index("--num-speculative-tokens") + 1] == "4"
    for flag, value in [
        ("--max-num-seqs", plan["maxNumSeqs"]),
        ("--max-model-len", plan["maxModelLen"]),
        ("--max-num-batched-tokens", plan["maxNumBatchedTokens"]),
        ("--block-size", 16),
        ("--quantization", plan["quantization"]),
        ("--speculative", plan["speculative"]),
    ]:
        assert argv[argv.index(flag) + 1] == str(value), flag

    # The status names the Service's in-cluster URL; the client here dials the pod IP behind it
    # (loopback Services have no endpoints, and nothing resolves cluster.local outside a cluster).
    assert smollm2["status"]["url"] == f"http://{name}.{ns}.svc.cluster.local:8000/v1"
    served = smollm2["spec"]["model"]["name"]
    with httpx.Client(trust_env=False, timeout=120) as http:
        # The engine requires the key of the Secret the operator made; its metrics stay open.
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=kvis.api_key(k8s, ns, name), http_client=http, max_retries=0
        )
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="not-the-key").models.list()
        assert [m.id for m in client.models.list().data] == [served]
        chat = client.chat.completions.create(
            model=served,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert chat.choices[0].message.content and chat.usage is not None
        assert 0 < chat.usage.completion_tokens <= 16
        stream = client.completions.create(model=served, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
        # An answer that copies its prompt: the engine verifies n-gram drafts and accepts some.
        text = "one two three four five six seven eight nine ten eleven twelve"
        copy = client.completions.create(model=served, prompt=f"{text}\n{text}\n{text}\n", max_tokens=24, temperature=0)
        assert copy.choices[0].text
        metrics = {
            s.name: s.value for f in text_string_to_metric_families(http.get(f"{url}/metrics").text) for s in f.samples
        }
    assert metrics["kvpilot_spec_decode_num_drafts_total"] > 0
    assert (
        0
        < metrics["kvpilot_spec_decode_num_accepted_tokens_total"]
        <= metrics["kvpilot_spec_decode_num_draft_tokens_total"]
    )


@dataclass
class PinnedEngine:
    plan: dict[str, Any]
    deployment: dict[str, Any]
    volumes: PodVolumes  # the pod's volumes, as folders here
    process: Process
    url: str
    model: str
    client: openai.OpenAI
    http: httpx.Client

    def capital_of_france(self, max_tokens: int = 6, **extra_body: Any) -> str:
        """The engine's greedy completion of "The capital of France is"."""
        out = self.client.completions.create(
            model=self.model,
            prompt="The capital of France is",
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra_body or None,
        )
        return out.choices[0].text


@contextmanager
def pinned_sample(
    k8s: Cluster,
    kvpilot: Installation,
    apply_isvc: Any,
    tmp_path: Path,
    name: str,
    model: dict[str, Any] | None = None,
    env: list[dict[str, str]] | None = None,
    **serving: str,
) -> Iterator[PinnedEngine]:
    """The sample with `serving` (and `model`, `env`) fields pinned, rolled out, and a real engine
    behind its one pod, started after the pod's init containers have run."""
    spec = kvis.sample("smollm2-135m")["spec"]
    spec = {
        **spec,
        "model": {**spec["model"], **(model or {})},
        "serving": {**spec.get("serving", {}), **serving},
        **({"env": env} if env else {}),
    }
    apply_isvc(name, spec)
    ns = kvpilot.watch_namespaces[0]
    ready = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=60)
    (pod,) = kvis.running_pods(k8s, ns, name)
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", ns)
    volumes = PodVolumes(tmp_path / f"{name}-volumes")
    volumes.run_init_containers(k8s, ns, deployment, tmp_path / f"{name}-init.log")
    process, url = start_engine(deployment, pod, tmp_path / f"{name}.log", volumes, env=key_env(k8s, ns, deployment))
    try:
        with httpx.Client(trust_env=False, timeout=120) as http:
            key = kvis.api_key(k8s, ns, name)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, http_client=http, max_retries=0)
            yield PinnedEngine(
                ready["status"]["plan"], deployment, volumes, process, url, spec["model"]["name"], client, http
            )
    finally:
        assert process.stop() == 0, process.log_tail()


def test_a_plan_that_chose_int4_runs_a_real_int4_engine(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any, tmp_path: Path
) -> None:
    # The sample, pinned to INT4 (the planner picks it under `auto` only where BF16 misses the SLO).
    with pinned_sample(k8s, kvpilot, apply_isvc, tmp_path, "smollm2-int4", quantization="int4") as engine:
        assert engine.plan["quantization"] == "int4"
        assert engine.process.argv[engine.process.argv.index("--quantization") + 1] == "int4"
        assert "Paris" in engine.capital_of_france()
        assert "quantization=int4" in engine.process.log_tail(200)


def test_a_plan_with_a_draft_model_runs_a_real_engine_that_drafts_with_it(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any, tmp_path: Path
) -> None:
    # The draft: the embedded model's own weights, at a path (a model baked into the image), under
    # its catalog name so the planner knows its architecture. A target that is its own draft.
    from kvpilot.engine.model.loader import embedded_model_dir

    draft = tmp_path / "SmolLM2-135M-Instruct"
    draft.symlink_to(embedded_model_dir())
    with pinned_sample(
        k8s, kvpilot, apply_isvc, tmp_path, "smollm2-draft", speculative="draft", draftModel=str(draft)
    ) as engine:
        assert engine.plan["speculative"] == "draft"
        argv = engine.process.argv
        assert argv[argv.index("--speculative") + 1] == "draft" and argv[argv.index("--draft-model") + 1] == str(draft)
        text = engine.capital_of_france(max_tokens=24, ignore_eos=True)
        metrics = {
            s.name: s.value
            for f in text_string_to_metric_families(engine.http.get(f"{engine.url}/metrics").text)
            for s in f.samples
        }
    assert "Paris" in text
    drafted, accepted = (
        metrics["kvpilot_spec_decode_num_draft_tokens_total"],
        metrics["kvpilot_spec_decode_num_accepted_tokens_total"],
    )
    # Its own draft: most are kept (bf16 rounds one-token draft steps and the verifying pass
    # differently, and drafts past max_tokens are not kept); an unrelated draft keeps few.
    assert drafted > 0 and accepted >= 0.6 * drafted, (drafted, accepted)


def test_a_checkpoint_stored_in_int4_is_served_as_stored(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any, tmp_path: Path
) -> None:
    # A W4A16 compressed-tensors checkpoint (`kvpilot quantize`, group 64 so that it differs from
    # the engine's default group 32), at a path baked into the image, declared model.quantization.
    checkpoint = tmp_path / "SmolLM2-135M-Instruct-w4a16"
    subprocess.run(
        [
            kvpilot_executable(),
            "quantize",
            str(checkpoint),
            "--scheme",
            "int4",
            "--group-size",
            "64",
            "--method",
            "rtn",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    with pinned_sample(
        k8s, kvpilot, apply_isvc, tmp_path, "smollm2-w4a16", model={"source": str(checkpoint), "quantization": "int4"}
    ) as engine:
        assert engine.plan["quantization"] == "int4"
        argv = engine.process.argv
        assert argv[argv.index("--model") + 1] == str(checkpoint) and argv[argv.index("--quantization") + 1] == "none"
        assert "Paris" in engine.capital_of_france()
        assert "quantization=int4" in engine.process.log_tail(200)


def test_an_hf_source_is_downloaded_by_the_init_container_and_served(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any, tmp_path: Path
) -> None:
    # The hub: a stand-in on 127.0.0.1 that serves the embedded model's folder under the hub's name
    # and wants a token; the spec names the endpoint in its env and the token by its Secret.
    from kvpilot.engine.model.loader import embedded_model_dir

    ns, repo, token = kvpilot.watch_namespaces[0], "HuggingFaceTB/SmolLM2-135M-Instruct", "hf_e2e_token"
    k8s.kubectl("create", "secret", "generic", "hub-token", "-n", ns, f"--from-literal=token={token}")
    try:
        with (
            HubServer(repo, embedded_model_dir(), token=token) as hub,
            pinned_sample(
                k8s,
                kvpilot,
                apply_isvc,
                tmp_path,
                "smollm2-hub",
                model={"source": f"hf://{repo}", "tokenSecret": {"name": "hub-token"}},
                env=[{"name": "HF_ENDPOINT", "value": hub.url}],
            ) as engine,
        ):
            (init,) = engine.deployment["spec"]["template"]["spec"]["initContainers"]
            assert init["command"] == ["kvpilot", "download"]
            # The engine loads what the init container put into the cache volume, nothing else.
            argv = engine.process.argv
            served = Path(argv[argv.index("--model") + 1])
            assert served == engine.volumes.root / "model-cache" / "hf" / f"{repo}@main", argv
            weights = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
            assert len(weights) == 1 and weights[0].headers["Authorization"] == f"Bearer {token}"
            assert filecmp.cmp(served / "model.safetensors", embedded_model_dir() / "model.safetensors", shallow=False)
            assert "Paris" in engine.capital_of_france()
            # The pod restarts on the same cache (a PVC): of the model, its download asks only where
            # the branch points and fetches no file again (huggingface_hub's other requests, such as
            # its agent registry, are not the model's).
            hub.requests.clear()
            engine.volumes.run_init_containers(k8s, ns, engine.deployment, tmp_path / "restart-init.log")
            asked = [(r.method, r.path) for r in hub.requests if r.path.startswith(("/api/models/", f"/{repo}/"))]
            assert asked == [("GET", f"/api/models/{repo}/revision/main")], [r.path for r in hub.requests]
    finally:
        k8s.kubectl("delete", "secret", "hub-token", "-n", ns, "--ignore-not-found")


def test_a_model_known_only_by_its_private_repository_is_planned_from_its_config_json(
    k8s: Cluster, kvpilot: Installation, operator: LocalOperator, apply_isvc: Any
) -> None:
    # The embedded model as a private repository under a name the catalog does not know, with no
    # architecture in the spec: the operator reads the repository's config.json from the Hub
    # stand-in (the service's HF_ENDPOINT) with the service's token. First the token's Secret is
    # missing: the Hub answers 401, which the status says; once the Secret is made, a retry plans.
    from kvpilot.engine.model.loader import embedded_model_dir

    ns, name, repo, token = kvpilot.watch_namespaces[0], "private-smol", "acme/private-smol", "hf_private_e2e"
    spec = kvis.sample("smollm2-135m")["spec"]
    with HubServer(repo, embedded_model_dir(), token=token, gated=True) as hub:
        spec = {
            **spec,
            "model": {"name": name, "source": f"hf://{repo}", "tokenSecret": {"name": "private-hub-token"}},
            "env": [{"name": "HF_ENDPOINT", "value": hub.url}],
        }
        apply_isvc(name, spec)
        try:
            refused = kvis.wait_condition(k8s, ns, name, "Planned", "False", timeout_s=60)
            planned = kvis.condition(refused, "Planned")
            assert planned["reason"] == "ModelConfigUnavailable", planned
            assert "401" in planned["message"] and "restricted" in planned["message"], planned
            assert kvis.children(k8s, ns, name, "deployments") == []
            k8s.kubectl("create", "secret", "generic", "private-hub-token", "-n", ns, f"--from-literal=token={token}")
            ready = kvis.wait_condition(k8s, ns, name, "Ready", "True", timeout_s=120)
        finally:
            k8s.kubectl("delete", "secret", "private-hub-token", "-n", ns, "--ignore-not-found")
        asked = hub.file_requests("config.json")
        assert asked[-1].headers["Authorization"] == f"Bearer {token}"
    plan = ready["status"]["plan"]
    assert plan["reasons"]["model"] == f"the checkpoint's config.json of hf://{repo}"
    # The same architecture as the catalog's entry for the embedded model.
    catalog = kvis.sample("smollm2-135m")
    apply_isvc("catalog-smol", catalog["spec"])
    reference = kvis.wait_condition(k8s, ns, "catalog-smol", "Planned", "True", timeout_s=60)["status"]["plan"]
    assert (plan["kvBytesPerToken"], plan["weightsGiB"]) == (reference["kvBytesPerToken"], reference["weightsGiB"])
