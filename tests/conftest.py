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


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """HuggingFace's implementation of the embedded model: the reference for greedy tokens and logits."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
