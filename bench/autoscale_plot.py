"""Plot one scale-up/scale-down cycle of the SLO autoscaler on real engines.

The cycle is e2e scenario 8 (e2e/test_autoscaling.py); run it with its timeline written out, then
plot that timeline:

    KVPILOT_AUTOSCALE_TIMELINE=bench/autoscale-cycle.json \\
        .venv/bin/python -m pytest e2e/test_autoscaling.py -k adds_engines
    .venv/bin/python -m bench.autoscale_plot bench/autoscale-cycle.json bench/autoscale-cycle.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path


def plot(timeline: dict[str, object], slo_ttft_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = timeline["samples"]
    assert isinstance(samples, list)
    t = [s["t"] for s in samples]
    fig, (load_ax, replicas_ax, ttft_ax) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    load_ax.step(t, [s["rate"] for s in samples], where="post")
    load_ax.set_ylabel("offered load (req/s)")
    replicas_ax.step(t, [s["replicas"] for s in samples], where="post", label="replicas (scale subresource)")
    replicas_ax.step(t, [s["engines"] for s in samples], where="post", linestyle="--", label="engines serving")
    replicas_ax.set_ylabel("replicas")
    replicas_ax.legend(loc="upper right")
    ttft_ax.plot(t, [s["clientTtftP95Ms"] for s in samples], marker=".", label="clients' p95 TTFT (last window)")
    ttft_ax.plot(t, [s["operatorTtftP95Ms"] for s in samples], marker=".", label="operator's windowed p95 TTFT")
    ttft_ax.axhline(slo_ttft_ms, color="red", linestyle=":", label=f"SLO {slo_ttft_ms:g} ms")
    ttft_ax.set_ylabel("p95 TTFT (ms)")
    ttft_ax.set_xlabel("seconds")
    ttft_ax.legend(loc="upper right")
    fig.suptitle(f"SLO autoscaler, period {timeline['intervalSeconds']} s, window {timeline['windowSeconds']} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--slo-ttft-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    plot(json.loads(args.timeline.read_text()), args.slo_ttft_ms, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
