"""Operator scale: N InferenceServices applied at once to a real local control plane.

Measures the time until every one is Ready=True, the API requests the operator makes per
reconciliation, and the operator's memory. The operator is the chart's, run locally under the
chart's ServiceAccount (as in the e2e tests); its requests are counted by the API server itself, in
an audit log that records only that ServiceAccount, and its reconciliations from its own log (one
line per handler run or per reconcile for a child's or pod's event).

    .venv/bin/python -m bench.operator_scale [--count 200] [--steady-s 45] [--output bench/out/operator_scale.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from e2e import kvis
from e2e.chart import NAMESPACE, RELEASE, Installation, install
from e2e.cluster import GPUNodeSpec, build_binaries, default_gpu_nodes, running_cluster
from e2e.local_operator import LocalOperator
from e2e.polling import poll
from e2e.procs import memory_kib
from kvpilot.operator.controller.handlers import REFRESHED

WATCHED = "bench"
GPUS_PER_NODE = 8
# One reconciliation = one reconcile of the operator's work queue, whatever event queued it (the
# operator logs REFRESHED; events collapsed into a queued reconcile, and Service/PDB events that change
# nothing of ours, log nothing).
RECONCILE_MARKERS = (REFRESHED,)


def gpu_nodes(count: int) -> list[GPUNodeSpec]:
    """Enough H100 nodes (8 GPUs each, like a DGX) for `count` single-GPU engines."""
    (h100,) = default_gpu_nodes((("H100-80GB", GPUS_PER_NODE),))
    return [dataclasses.replace(h100, name=f"gpu-h100-80gb-{i}") for i in range(-(-count // GPUS_PER_NODE))]


def audit_policy(path: Path, subject: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "audit.k8s.io/v1",
                "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata", "users": [subject]}, {"level": "None"}],
            }
        )
    )
    return path


def requests_by_kind(audit_log: Path, since: float, until: float) -> collections.Counter[str]:
    """Operator requests completed (or, for watches, started) within [since, until] (epoch s)."""
    counts: collections.Counter[str] = collections.Counter()
    seen: set[str] = set()
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        ts = _epoch(event["stageTimestamp"])
        if not since <= ts <= until or event["auditID"] in seen:
            continue
        seen.add(event["auditID"])
        ref = event.get("objectRef", {})
        resource = ref.get("resource", event["requestURI"].split("?")[0])
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
        counts[f"{event['verb']} {resource}"] += 1
    return counts


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def reconciles(log: str, since: float, until: float) -> int:
    count = 0
    for line in log.splitlines():
        if any(m in line for m in RECONCILE_MARKERS):
            ts = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            count += since <= ts <= until
    return count


def ready_count(items: list[dict[str, Any]]) -> int:
    return sum(kvis.condition(o, "Ready").get("status") == "True" for o in items)


def run(count: int, steady_s: float, output: Path) -> dict[str, Any]:
    installation = Installation(RELEASE, NAMESPACE, (WATCHED,))
    binaries = build_binaries()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvpilot-bench-{os.getpid()}"
    workdir.mkdir(parents=True)
    policy = audit_policy(workdir / "audit-policy.yaml", installation.subject)
    started = time.monotonic()
    with running_cluster(binaries, nodes=gpu_nodes(count), audit_policy=policy) as cluster:
        install(cluster, [WATCHED])
        operator = LocalOperator(cluster, installation, workdir)
        process = operator.start()
        try:
            setup_s = time.monotonic() - started
            rss_idle = memory_kib(process.pid)
            spec = {
                "model": {"name": "llama-3-8b"},
                "accelerator": {"type": "H100-80GB"},
                "serving": {"maxContextLength": 8192},
                "replicas": 1,
            }
            manifests = [kvis.manifest(f"svc-{i:03d}", WATCHED, spec) for i in range(count)]

            t0, wall0 = time.monotonic(), time.time()
            cluster.apply(*manifests, timeout=300)
            applied_s = time.monotonic() - t0
            first_ready_s = None
            progress: list[tuple[float, int]] = []

            def all_ready() -> bool:
                nonlocal first_ready_s
                items = cluster.kubectl_json("get", "inferenceservices", "-n", WATCHED, timeout=120)["items"]
                ready = ready_count(items)
                elapsed = time.monotonic() - t0
                progress.append((round(elapsed, 1), ready))
                if ready and first_ready_s is None:
                    first_ready_s = elapsed
                return ready == count

            try:
                poll(all_ready, 600, f"all {count} InferenceServices Ready", interval_s=1.0)
            except TimeoutError:
                raise TimeoutError(f"only {progress[-1][1]}/{count} Ready after 600 s") from None
            all_ready_s, wall_ready = time.monotonic() - t0, time.time()
            rss_ready = memory_kib(process.pid)

            # Steady state: nothing changes; with no resync timer the operator should be (nearly) idle.
            time.sleep(steady_s)
            wall_end = time.time()
            rss_end = memory_kib(process.pid)
            log = operator.log()
            burst = requests_by_kind(cluster.audit_log, wall0, wall_ready)
            steady = requests_by_kind(cluster.audit_log, wall_ready, wall_end)
            burst_reconciles = reconciles(log, wall0, wall_ready)
            steady_reconciles = reconciles(log, wall_ready, wall_end)
        finally:
            operator.stop()
    result = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.operator_scale", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "inference_services": count,
        "gpu_nodes": len(gpu_nodes(count)),
        "cluster_and_operator_setup_s": round(setup_s, 1),
        "apply_s": round(applied_s, 1),
        "first_ready_s": round(first_ready_s or 0, 1),
        "all_ready_s": round(all_ready_s, 1),
        "ready_progress": progress[:: max(1, len(progress) // 20)],
        "burst": {
            "requests": sum(burst.values()),
            "reconciles": burst_reconciles,
            "requests_per_reconcile": round(sum(burst.values()) / max(1, burst_reconciles), 2),
            "by_kind": dict(burst.most_common()),
        },
        "steady": {
            "seconds": steady_s,
            "requests": sum(steady.values()),
            "reconciles": steady_reconciles,
            "requests_per_reconcile": round(sum(steady.values()) / max(1, steady_reconciles), 2),
            "requests_per_s": round(sum(steady.values()) / steady_s, 1),
            "by_kind": dict(steady.most_common()),
        },
        "operator_rss_mib": {
            "idle": round(rss_idle["VmRSS"] / 1024, 1),
            "all_ready": round(rss_ready["VmRSS"] / 1024, 1),
            "end": round(rss_end["VmRSS"] / 1024, 1),
            "peak": round(rss_end["VmHWM"] / 1024, 1),
        },
        "total_s": round(time.monotonic() - started, 1),
        "operator_logs": str(workdir),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument(
        "--steady-s", type=float, default=45.0, help="seconds to measure after all are Ready (idle: nothing changes)"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/out/operator_scale.json"))
    args = parser.parse_args()
    print(json.dumps(run(args.count, args.steady_s, args.output), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
