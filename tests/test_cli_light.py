"""The operator image has no torch: every command's parser must build without importing it."""

from __future__ import annotations

import subprocess
import sys


def test_cli_parser_imports_no_heavy_engine_stack():
    # `-c` from the repository root also proves that the folder operator/ does not shadow the
    # stdlib module `operator` (which collections, and so nearly everything, imports).
    code = (
        "import sys; from kvpilot.engine.cli import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
