"""`make demo-down` leaves nothing that the next `make demo` could take for its own.

The demo's `up` takes about a minute, so this checks the mechanism instead: `down` removes every
file `up` wrote (no cluster needed), and the local operator's kubeconfig is made anew for the
cluster at hand at every start, whatever an earlier cluster left in its place (on the e2e cluster).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e import demo
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.local_operator import LocalOperator


def test_down_removes_everything_up_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kvpilot-demo"
    monkeypatch.setattr(demo, "ROOT", root)
    monkeypatch.setattr(demo, "STATE_FILE", root / "state.json")
    (root / demo.OPERATOR_DIR).mkdir(parents=True)
    (root / demo.OPERATOR_DIR / "operator-kubeconfig.yaml").write_text("stale: true\n")
    (root / demo.OPERATOR_DIR / "operator-1.log").write_text("log\n")
    (root / demo.ENGINE_LOG).write_text("log\n")
    # A cluster whose directory is already gone and no processes: down has only files to remove.
    (root / "state.json").write_text(
        json.dumps({"cluster": "kvpilot-demo", "bin_dir": str(tmp_path / "bin"), "processes": {}})
    )
    assert demo.down() == 0
    assert not root.exists()
    assert demo.down() == 0  # nothing up: says so, fails nothing


def test_down_leaves_a_root_with_other_files_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # KVPILOT_DEMO_STATE may name a directory that holds more than the demo.
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    monkeypatch.setattr(demo, "STATE_FILE", tmp_path / "state.json")
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "state.json").write_text(
        json.dumps({"cluster": "kvpilot-demo", "bin_dir": str(tmp_path / "bin"), "processes": {}})
    )
    assert demo.down() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_operator_kubeconfig_is_made_for_the_cluster_at_hand(
    k8s: Cluster, kvpilot: Installation, tmp_path: Path
) -> None:
    local = LocalOperator(k8s, kvpilot, tmp_path)
    # What a previous cluster left in its place: another CA, another port, another token.
    stale = yaml.safe_load(Path(k8s.kubeconfig).read_text())
    stale["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    stale["clusters"][0]["cluster"]["certificate-authority-data"] = "bm90IGEgQ0E="
    local.kubeconfig.write_text(yaml.safe_dump(stale))
    assert local.prepare_kubeconfig() == local.kubeconfig  # what start() runs first
    whoami = k8s.kubectl("auth", "whoami", "--kubeconfig", str(local.kubeconfig), "-o", "json").stdout
    assert yaml.safe_load(whoami)["status"]["userInfo"]["username"] == kvpilot.subject
