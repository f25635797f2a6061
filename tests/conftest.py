"""Session-wide fixtures: the real embedded model, converted once and shared by every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Two cores: more threads than that only makes OpenMP spin against the other processes.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from kvpilot.engine.model.loader import embedded_model_dir

    return embedded_model_dir()
