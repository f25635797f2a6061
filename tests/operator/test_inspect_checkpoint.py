"""`kvpilot inspect-checkpoint`: what the operator's inspection Job of a pvc:// model runs, and what
the operator parses back from its termination message (api/inspection.py)."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.operator import cli
from kvpilot.operator.api import inspection
from kvpilot.operator.api.inspection import TERMINATION_MESSAGE_LIMIT, CheckpointInspection
from kvpilot.operator.planning.model_config import read_config
from tests.operator.hub.checkpoints import write_safetensors

CONFIGS = Path(__file__).parent / "planning" / "hf_configs"
ROOT = Path(__file__).resolve().parents[2]


def checkpoint(tmp_path: Path, config: str = "Qwen--Qwen3-8B.json") -> Path:
    folder = tmp_path / "claim" / "qwen3"
    folder.mkdir(parents=True)
    shutil.copy(CONFIGS / config, folder / "config.json")
    return folder


def run(folder: Path, log: Path) -> tuple[int, str]:
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["inspect-checkpoint", str(folder), "--termination-log", str(log)])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_a_checkpoint_is_read_as_the_hub_s_config_with_its_weights_bytes(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path)
    weights = write_safetensors(folder / "model.safetensors", {"a": (0, 64), "b": (64, 192)})
    code, out = run(folder, tmp_path / "termination-log")
    assert code == 0
    written = (tmp_path / "termination-log").read_text()
    assert out == written + "\n"
    assert len(written.encode()) <= TERMINATION_MESSAGE_LIMIT
    # Parsed back by the model the operator reads it with, it is what the hf:// path plans from.
    result = CheckpointInspection.model_validate_json(written)
    expected = read_config(json.loads((CONFIGS / "Qwen--Qwen3-8B.json").read_text()), f"config.json of {folder}")
    assert not isinstance(expected, str)
    assert result.architecture == expected.architecture.model_copy(update={"checkpoint_bytes": weights})
    assert result.architecture.checkpoint_bytes == weights == 192
    assert result.quantization is None
    # Compact: the parsed architecture, not config.json.
    assert "max_position_embeddings" not in written and written.startswith('{"architecture":{"layers":36,')


def test_a_quantized_checkpoint_reports_its_scheme(tmp_path: Path) -> None:
    folder = tmp_path / "awq"
    folder.mkdir()
    config = json.loads((CONFIGS / "Qwen--Qwen3-8B.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    code, out = run(folder, tmp_path / "log")
    assert code == 0
    assert CheckpointInspection.model_validate_json(out).quantization == "awq"


def test_an_unknown_architecture_is_refused_as_the_hub_s_would_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "foo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "hidden_size": 8}))
    code, out = run(folder, tmp_path / "log")
    assert (code, out) == (1, "")
    message = (tmp_path / "log").read_text()
    assert message.startswith(f"UnsupportedArchitecture: {folder}: FooForCausalLM is not an architecture")
    assert capsys.readouterr().err.strip() == message


def test_a_folder_without_config_json_says_so(tmp_path: Path) -> None:
    code, _ = run(tmp_path, tmp_path / "log")
    assert code == 1
    assert "config.json" in (tmp_path / "log").read_text()
    assert not (tmp_path / "log").read_text().startswith("UnsupportedArchitecture")


def test_a_result_larger_than_a_termination_message_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No config.json the parser reads comes near 4096 bytes of result (a path cannot be that long
    # either): the check is shown with a smaller bound.
    monkeypatch.setattr(inspection, "TERMINATION_MESSAGE_LIMIT", 100)
    code, out = run(checkpoint(tmp_path), tmp_path / "log")
    assert (code, out) == (1, "")
    message = (tmp_path / "log").read_text()
    assert message.startswith("the inspection's result is ") and message.endswith(
        "more than the 100 a termination message holds"
    )


def test_outside_a_pod_the_termination_log_is_skipped(tmp_path: Path) -> None:
    code, out = run(checkpoint(tmp_path), tmp_path / "no-such-folder" / "log")
    assert code == 0 and CheckpointInspection.model_validate_json(out)


def test_the_kvpilot_command_runs_it(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path)
    log = tmp_path / "log"
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "inspect-checkpoint", str(folder), "--termination-log", str(log)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert CheckpointInspection.model_validate_json(result.stdout) == CheckpointInspection.model_validate_json(
        log.read_text()
    )
