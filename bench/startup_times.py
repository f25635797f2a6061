"""vLLM's time to ready, planned against public start-up logs: `python -m bench.startup_times`.

Each log of tests/operator/planning/vllm_startup_times.json (vLLM 0.19 on H100s) planned as
planning/startup.py predicts it: the typical engine start and the bound the startup probe allows,
beside the observed time from the process's first line to its server starting (downloads excluded:
kvpilot's pods download in an init container). Prints a row per log and the summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.models import find_model
from kvpilot.operator.planning.startup import predict_startup

LOGS = Path(__file__).parent.parent / "tests" / "operator" / "planning" / "vllm_startup_times.json"


class Row(NamedTuple):
    log: dict[str, Any]
    predicted_s: float
    bound_s: float

    @property
    def ratio(self) -> float:
        """Observed over predicted."""
        return float(self.log["ready_s"]) / self.predicted_s


def planned_rows() -> list[Row]:
    """Every log with the start planning/startup.py predicts for it: a vLLM service of its layers,
    multimodal or not, on its tensor-parallel size, reading its checkpoint from the node's disk."""
    spec = InferenceServiceSpec.model_validate({"model": {"name": "llama-3-8b"}, "runtime": "vllm"})
    base = find_model("llama-3-8b")
    assert base is not None
    rows = []
    for log in json.loads(LOGS.read_text())["logs"]:
        arch = base.model_copy(update={"layers": log["layers"], "vision_parameters": 1 if log["multimodal"] else None})
        plan = Plan(
            fits=True,
            reason="",
            model=log["model"],
            runtime="vllm",
            gpu_count=log["tensor_parallel_size"],
            checkpoint_bytes=int(log["checkpoint_gib"] * sizing.GiB),
        )
        typical, bound = predict_startup(spec, arch, plan)
        rows.append(Row(log, typical.engine_s, bound.engine_s))
    return rows


def main() -> None:
    rows = planned_rows()
    for row in rows:
        log = row.log
        print(
            f"{log['model'][:44]:44} TP {log['tensor_parallel_size']} {log['checkpoint_gib']:6.1f} GiB  "
            f"observed {log['ready_s']:6.1f} s  predicted {row.predicted_s:6.1f} s  ratio {row.ratio:.2f}  "
            f"probe allows {row.bound_s:5.0f} s"
        )
    ratios = [row.ratio for row in rows]
    within = sum(0.75 <= r <= 1.25 for r in ratios)
    headroom = [row.bound_s / row.log["ready_s"] for row in rows]
    print(
        f"{len(rows)} logs: observed / predicted median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}), {within} within 25 %; "
        f"the probe's budget over the observed start: min {min(headroom):.2f}x, max {max(headroom):.2f}x"
    )


if __name__ == "__main__":
    main()
