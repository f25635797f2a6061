"""`kvpilot plan` and `kvpilot operator` through the register() contract with the engine's CLI."""

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.operator import cli
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.controller import render


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    return top


def run(argv: str) -> tuple[int, str]:
    args = parser().parse_args(argv.split())
    out = io.StringIO()
    code = args.func(args, out=out) if args.func in (cli.run_plan, cli.run_render) else args.func(args)
    return code, out.getvalue()


def test_plan_prints_a_readable_table() -> None:
    code, text = run("plan --model llama-2-7b --gpu A10G --context 4096")
    assert code == 0
    assert "runtime             kvpilot" in text and "gpus per replica    1\n" in text
    assert "max num seqs        20 (sequences at the mean context that fit)" in text
    assert "KV per token        0.5 MiB" in text
    assert "quantization        none" in text
    assert "predicted TTFT" in text and "predicted TPOT" in text
    assert (
        "why:" in text
        and "kvCache: 20 sequences at the mean context of 640 tokens (prompt + half the output) fit, 3 at the full 4096"
        in text
    )


def test_plan_json_is_the_plan() -> None:
    code, text = run("plan --model llama-2-7b --gpu A10G --context 4096 --json")
    assert code == 0
    result = Plan.model_validate_json(text)
    assert (result.max_num_seqs, result.kv_bytes_per_token, result.max_model_len) == (20, 524288, 4096)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_plans_and_renders_offline(example: Path) -> None:
    """The manifests the docs use (e2e/test_examples.py applies them to a cluster): each plans (exit
    0: it fits) and renders its Deployments, here in seconds."""
    code, text = run(f"plan -f {example}")
    assert code == 0, text
    code, text = run(f"render -f {example}")
    assert code == 0 and "kind: Deployment" in text, text


def test_plan_exit_codes_for_no_fit_and_invalid_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run("plan --model llama-3-70b --gpu A10G")
    assert code == 1 and "NO (WeightsDoNotFit)" in text and "42.8 GiB" in text  # even at INT4
    code, _ = run("plan --model llama-2-7b --gpu A10G --block-size 24")
    assert code == 2 and "power of two" in capsys.readouterr().err
    code, text = run("plan --model llama-2-7b --gpu TPU-v5")
    assert code == 1 and "UnknownGPU" in text
    code, _ = run("plan --model llama-2-7b --gpu A10G --speculative draft --draft-model llama-2-7b")
    assert code == 2 and "must be hf://org/repo[@revision]" in capsys.readouterr().err  # not a source
    code, text = run("plan --model llama-2-7b --gpu A10G --speculative draft --draft-model pvc://models/my-draft")
    assert code == 1 and "NO (UnknownDraftModel)" in text and "serving.draftModelArchitecture" in text
    code, text = run(
        "plan --model llama-2-7b --gpu A10G --speculative draft --draft-model hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    )
    assert code == 0 and "speculative         draft (k=4)" in text


def test_plan_on_several_gpu_types_prints_a_variant_each() -> None:
    code, text = run("plan --model llama-3-8b --runtime vllm --rps 8 --gpu H100-80GB,L4:2,A10G --gpu-price L4=0.3")
    assert code == 0
    assert text.startswith("variants ")
    assert all(f"== {gpu} ==" in text for gpu in ("H100-80GB", "L4", "A10G"))
    lines = text.splitlines()
    assert lines[1].startswith("L4 ") and "(max 2)" in lines[1] and "$0.3/GPU-h" in lines[1]
    assert "stands by" in text and "capacity            " in text
    code, text = run("plan --model llama-3-70b --runtime vllm --rps 2 --gpu H100-80GB,T4 --json")
    body = json.loads(text)
    assert code == 0 and body["fits"] and list(body["left_out"]) == ["T4"]
    (variant,) = body["variants"]
    assert f"--max-num-seqs={variant['plan']['max_num_seqs']}" in variant["args"]
    assert f"--tensor-parallel-size={variant['plan']['gpu_count']}" in variant["args"]


def test_plan_on_several_gpu_types_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run("plan --model llama-3-70b --runtime vllm --gpu T4,A10G")
    assert code == 1 and "NoVariantFits" not in text and "fits none of the GPU types" in text
    code, _ = run("plan --model llama-3-8b --gpu L4:3")
    assert code == 2 and "for one type use --max-replicas" in capsys.readouterr().err
    for bad in ("--gpu L4:0,A10G", "--gpu L4,A10G --gpu-price L4=cheap", "--gpu L4,A10G --gpu-price TPU=1"):
        with pytest.raises(SystemExit):
            run(f"plan --model llama-3-8b {bad}")
        assert "expected TYPE" in capsys.readouterr().err


CLASS_FLAGS = (
    "--capacity-class spot=karpenter.sh/capacity-type=spot "
    "--capacity-class on-demand=karpenter.sh/capacity-type=on-demand,example.com/pool=gpu"
)


def test_plan_says_spot_and_on_demand_of_one_type_as_variants_of_their_own() -> None:
    code, text = run(
        f"plan --model llama-3-8b --runtime vllm --rps 8 --gpu L4@spot:2,L4@on-demand "
        f"{CLASS_FLAGS} --gpu-price L4@spot=0.1 --gpu-price L4=0.2"
    )
    assert code == 0, text
    lines = text.splitlines()
    # Spot first (the cheaper per req/s, to its maxReplicas), then on-demand at the type's price.
    assert lines[1].startswith("L4@spot ") and "(max 2)" in lines[1] and "$0.1/GPU-h" in lines[1]
    assert lines[2].startswith("L4@on-demand ") and "$0.2/GPU-h" in lines[2]
    assert "== L4@spot ==" in text and "== L4@on-demand ==" in text
    code, text = run(f"plan --model llama-3-8b --runtime vllm --rps 8 --gpu L4@spot {CLASS_FLAGS} --json")
    (spot,) = json.loads(text)["variants"]
    assert (spot["capacity_class"], spot["node_selector"]) == ("spot", {"karpenter.sh/capacity-type": "spot"})


def test_plan_refuses_a_class_it_was_not_told_of(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run("plan --model llama-3-8b --runtime vllm --gpu L4@spot,H100-80GB")
    assert code == 1 and "capacity class(es) spot, which the operator does not know (known: none)" in text
    # A price of a class no --capacity-class declares would price nothing: refused, not ignored.
    code, _ = run(f"plan --model llama-3-8b --gpu L4@spot,H100-80GB {CLASS_FLAGS} --gpu-price L4@spto=0.1")
    assert code == 2 and "--gpu-price L4@spto: no such --capacity-class (declared: on-demand, spot)" in (
        capsys.readouterr().err
    )
    refusals = {
        "--gpu L4@Spot,A10G": "the capacity class 'Spot' is not a DNS-1123 label",
        "--gpu-price L4@=1": "the capacity class '' is not a DNS-1123 label",
        "--capacity-class spot": "expected CLASS=LABEL=VALUE",
        "--capacity-class spot==x": "expected CLASS=LABEL=VALUE",
    }
    for bad, words in refusals.items():
        with pytest.raises(SystemExit):
            run(f"plan --model llama-3-8b --gpu L4,A10G {bad}")
        assert words in capsys.readouterr().err


SPOT_POOL = """
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: chat, namespace: ml}
spec:
  runtime: vllm
  model: {name: llama-3-8b}
  accelerator:
    variants: [{type: L4, capacityClass: spot, count: 1}, {type: L4, count: 1}]
  load: {requestsPerSecond: 8}
"""


def test_render_rolls_out_a_class_s_variant_on_its_nodes(tmp_path: Path) -> None:
    manifest = tmp_path / "chat.yaml"
    manifest.write_text(SPOT_POOL)
    code, text = run(f"render -f {manifest} {CLASS_FLAGS} --gpu-price L4@spot=0.1")
    assert code == 0
    made = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text) if d["kind"] == "Deployment"}
    assert set(made) == {"chat-l4-spot", "chat-l4"}
    selectors = {name: d["spec"]["template"]["spec"]["nodeSelector"] for name, d in made.items()}
    assert selectors["chat-l4-spot"] == {"nvidia.com/gpu.product": "NVIDIA-L4", "karpenter.sh/capacity-type": "spot"}
    assert selectors["chat-l4"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    # Spot is the cheaper: it fills to its maxReplicas (autoscaling's default 4) before any node of the type.
    assert made["chat-l4-spot"]["spec"]["replicas"] == 4 and made["chat-l4"]["spec"]["replicas"] > 0


class Recorder:
    def __init__(self) -> None:
        self.peerings: list[tuple[str, list[str] | None]] = []
        self.runs: list[dict[str, Any]] = []

    def ensure_peering(self, name: str, namespaces: list[str] | None) -> None:
        self.peerings.append((name, namespaces))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorded = Recorder()
    monkeypatch.setattr(cli.KubeCluster, "connect", classmethod(lambda cls: recorded))
    monkeypatch.setattr(cli.kopf, "run", lambda **kwargs: recorded.runs.append(kwargs))
    monkeypatch.setattr(cli.kopf, "configure", lambda **kwargs: None)
    return recorded


def test_operator_peers_with_a_priority_of_its_own(recorder: Recorder) -> None:
    assert run("operator -n ml -n prod")[0] == 0
    assert run("operator -n ml -n prod")[0] == 0
    assert recorder.peerings == [("kvpilot", ["ml", "prod"])] * 2
    first, second = recorder.runs
    assert first["peering_name"] == "kvpilot" and first["standalone"] is False
    assert first["namespaces"] == ["ml", "prod"] and first["clusterwide"] is False
    # Equal priorities would pause both replicas; each draws its own so exactly one acts.
    assert first["priority"] != second["priority"]
    # The client that made the peering is the one every handler, the autoscaler and the gateway use.
    assert first["memo"].cluster is recorder


def test_operator_cluster_wide_and_standalone(recorder: Recorder) -> None:
    run("operator --all-namespaces --priority 7 --liveness http://0.0.0.0:8080/healthz")
    (wide,) = recorder.runs
    assert wide["clusterwide"] is True and wide["namespaces"] == ()
    assert (wide["priority"], wide["liveness_endpoint"]) == (7, "http://0.0.0.0:8080/healthz")
    assert recorder.peerings == [("kvpilot", None)]
    run("operator -A --standalone")
    assert recorder.runs[-1]["peering_name"] is None and recorder.runs[-1]["standalone"] is True
    assert len(recorder.peerings) == 1


def test_operator_needs_a_scope() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["operator"])
    with pytest.raises(SystemExit):
        parser().parse_args(["operator", "-A", "-n", "ml"])


def test_operator_prometheus_allowlist_reaches_the_autoscaler(recorder: Recorder) -> None:
    """`autoscaling.prometheusUrl` is read only under prefixes the operator's admin allows
    (the chart's autoscaler.prometheusUrlAllow); none by default."""
    run("operator -A")
    assert tuple(recorder.runs[-1]["memo"].prometheus_url_allow) == ()
    run(
        "operator -A --prometheus-url-allow http://prometheus.monitoring:9090 "
        "--prometheus-url-allow https://thanos.monitoring/query"
    )
    assert tuple(recorder.runs[-1]["memo"].prometheus_url_allow) == (
        "http://prometheus.monitoring:9090",
        "https://thanos.monitoring/query",
    )
    for prefix in ("prometheus:9090", "ftp://p", "http://", "http://user@prometheus:9090", "http://p/?q=1"):
        with pytest.raises(SystemExit):
            parser().parse_args(["operator", "-A", "--prometheus-url-allow", prefix])


VLLM_70B = """
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: big, namespace: team-a}
spec:
  runtime: vllm
  model: {name: llama-3-70b, source: "hf://meta-llama/Meta-Llama-3-70B-Instruct"}
  accelerator: {type: H100-80GB}
"""


def test_plan_runtime_vllm_splits_a_70b_model_and_json_carries_the_vllm_argv() -> None:
    code, text = run("plan --model llama-3-70b --gpu H100-80GB --runtime vllm --json")
    assert code == 0
    body = json.loads(text)
    assert body["runtime"] == "vllm" and body["gpu_count"] in (2, 4)
    _, table = run("plan --model llama-3-70b --gpu H100-80GB --runtime vllm")
    assert f"gpus per replica    {body['gpu_count']} (tensor parallel)" in table
    assert "--tensor-parallel-size=" + str(body["gpu_count"]) in body["args"]
    # vLLM measures its pool from the utilization; the plan's prediction says what it is made of.
    assert f"--gpu-memory-utilization={body['gpu_memory_utilization']:g}" in body["args"]
    assert not any(arg.startswith("--kv-cache-memory") for arg in body["args"])
    assert "as vLLM profiles it" in body["reasons"]["kvCache"]
    assert body["reasons"]["tensorParallel"].startswith(f"{body['gpu_count']}: the smallest")
    # Our own engine refuses more than one GPU, and says which runtime runs it.
    code, text = run("plan --model llama-3-70b --gpu H100-80GB --gpus 2")
    assert code == 1 and "UnsupportedByRuntime" in text and "runtime: vllm runs tensor parallelism over 2" in text


def test_plan_and_render_read_a_manifest_as_the_operator_would(tmp_path: Path) -> None:
    manifest = tmp_path / "big.yaml"
    manifest.write_text(VLLM_70B)
    code, text = run(f"plan -f {manifest} --json")
    assert code == 0 and json.loads(text)["runtime"] == "vllm"
    out = io.StringIO()
    args = parser().parse_args(["render", "-f", str(manifest)])
    assert args.func(args, out=out) == 0
    objects = list(yaml.safe_load_all(out.getvalue()))
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    assert {o["metadata"]["namespace"] for o in objects} == {"team-a"}
    pod = objects[0]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["image"] == "vllm/vllm-openai:v0.33.0" and engine["command"] == ["vllm", "serve"]
    assert engine["args"][0] == "/model-cache/hf/meta-llama/Meta-Llama-3-70B-Instruct@main"
    gpus = engine["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) > 1 and f"--tensor-parallel-size={gpus}" in engine["args"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # The download runs `kvpilot download` from the operator's image: vLLM's has no such command.
    assert pod["initContainers"][0]["image"] == render.DEFAULT_ENGINE_IMAGE


def test_render_refuses_what_is_not_an_inference_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text("kind: Pod\nspec: {}\n")
    args = parser().parse_args(["render", "-f", str(manifest)])
    assert args.func(args, out=io.StringIO()) == 2 and "not an InferenceService manifest" in capsys.readouterr().err
    code, _ = run("plan --model llama-2-7b")
    assert code == 2 and "--gpu or --device-profile is required with --model" in capsys.readouterr().err


def test_operator_takes_capacity_classes_and_their_prices(
    recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(f"operator -A {CLASS_FLAGS} --gpu-price L4=0.45 --gpu-price L4@spot=0.2")[0] == 0
    memo = recorder.runs[-1]["memo"]
    assert memo.capacity_classes == {
        "spot": {"karpenter.sh/capacity-type": "spot"},
        "on-demand": {"karpenter.sh/capacity-type": "on-demand", "example.com/pool": "gpu"},
    }
    assert memo.gpu_prices == {"L4": 0.45, "L4@spot": 0.2}
    assert run("operator -A --gpu-price L4@spot=0.2")[0] == 2
    assert "no such --capacity-class" in capsys.readouterr().err
