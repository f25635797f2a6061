"""`kvpilot plan` and `kvpilot operator` through the register() contract with the engine's CLI."""

import argparse
import io
from typing import Any

import pytest

from kvpilot.operator import cli
from kvpilot.operator.planning.planner import Plan


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    return top


def run(argv: str) -> tuple[int, str]:
    args = parser().parse_args(argv.split())
    out = io.StringIO()
    code = args.func(args, out=out) if args.func is cli.run_plan else args.func(args)
    return code, out.getvalue()


def test_plan_prints_a_readable_table() -> None:
    code, text = run("plan --model llama-2-7b --gpu A10G --context 4096")
    assert code == 0
    assert "max num seqs        21 (sequences at the mean context that fit)" in text
    assert "KV per token        0.5 MiB" in text
    assert "quantization        none" in text
    assert "predicted TTFT" in text and "predicted TPOT" in text
    assert (
        "why:" in text
        and "kvCache: 21 sequences at the mean context of 640 tokens (prompt + half the output) fit, 3 at the full 4096"
        in text
    )


def test_plan_json_is_the_plan() -> None:
    code, text = run("plan --model llama-2-7b --gpu A10G --context 4096 --json")
    assert code == 0
    result = Plan.model_validate_json(text)
    assert (result.max_num_seqs, result.kv_bytes_per_token, result.max_model_len) == (21, 524288, 4096)


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
