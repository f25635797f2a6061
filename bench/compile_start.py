"""Start-up time of `kvpilot serve --compile-decode`: cold (an empty compile cache) and warm (the
cache a previous start left), beside a start without compiled decoding.

    .venv/bin/python -m bench.compile_start [--runs 3] [--server-args "..."] [--output bench/compile-start-cpu.json]

Each run starts a fresh server process (a process that already compiled the graph reuses it in
memory) and times it from the spawn to its first 200 on /ready; the engine's own
`event=decode_compiled seconds=... cache=...` line gives the compile's share. Modes alternate
within each run (eager, cold, warm), so load changes hit all three alike. Cold runs compile into
an empty folder of their own; warm runs share one folder, filled by one start before the runs.
"""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.machine import machine, write_result

KVPILOT = Path(sys.executable).parent / "kvpilot"
COMPILED = re.compile(r"event=decode_compiled seconds=([\d.]+) cache=(\w+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_once(extra: list[str], log_path: Path, timeout: float = 600.0) -> dict[str, object]:
    """Seconds from spawning `kvpilot serve` to its first ready answer, and its compile line."""
    port = _free_port()
    argv = [str(KVPILOT), "serve", "--port", str(port), *extra]
    started = time.monotonic()
    with log_path.open("w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not _ready(port):
                if server.poll() is not None or time.monotonic() - started > timeout:
                    raise RuntimeError(f"{shlex.join(argv)} did not become ready: see {log_path}")
                time.sleep(0.1)
            seconds = time.monotonic() - started
        finally:
            server.terminate()
            server.wait(30)
    match = COMPILED.search(log_path.read_text())
    return {
        "ready_s": round(seconds, 2),
        "compile_s": float(match.group(1)) if match else None,
        "cache": match.group(2) if match else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-args", default="", help="more `kvpilot serve` flags for every mode")
    parser.add_argument("--output", type=Path, default=Path("bench/compile-start-cpu.json"))
    args = parser.parse_args()
    common = shlex.split(args.server_args)
    record: dict[str, object] = {"machine_at_start": machine(), "server_args": common, "runs": []}
    with tempfile.TemporaryDirectory(prefix="compile-start-") as tmp:
        work = Path(tmp)
        warm = ["--compile-decode", "--compile-cache-dir", str(work / "warm")]
        filled = start_once([*common, *warm], work / "fill.log")
        print(f"filling the warm cache: {filled}", flush=True)
        for run in range(args.runs):
            modes = {
                "eager": [],
                "cold": ["--compile-decode", "--compile-cache-dir", str(work / f"cold{run}")],
                "warm": warm,
            }
            for mode, flags in modes.items():
                result = {"run": run, "mode": mode, **start_once([*common, *flags], work / f"{mode}{run}.log")}
                print(result, flush=True)
                record["runs"].append(result)
    record["machine_at_end"] = machine()
    record["summary"] = {
        mode: {
            key: statistics.median(r[key] for r in record["runs"] if r["mode"] == mode)
            for key in ("ready_s", "compile_s")
            if mode != "eager" or key == "ready_s"
        }
        for mode in ("eager", "cold", "warm")
    }
    print(record["summary"])
    write_result(args.output, record)


if __name__ == "__main__":
    main()
