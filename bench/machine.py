"""The machine a benchmark ran on, as every result file records it (the CPU's model name as lscpu
gives it, the software, the load), and the writing of a result file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """lscpu's "Model name" (empty where lscpu is missing or says none)."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")


def machine() -> dict[str, object]:
    """This machine and this process's torch, now (the load average is that of the last minute, 5, 15)."""
    import torch

    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": os.getloadavg(),
    }


def write_result(path: Path, record: dict[str, Any]) -> None:
    """`record` as indented JSON at `path`, its folder made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
