"""cpu_attention: the C++ decode-attention kernel gives SDPA's result over the same cached context,
for bf16 and fp32 caches, ragged lengths and grouped KV heads, eagerly and in a compiled graph; it
is built once per CPU type and then loaded from the cache; a build that fails leaves the portable
path."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM
from kvpilot.engine.model import cpu_attention
from kvpilot.engine.worker.cpu_features import read_cpu_flags
from kvpilot.engine.worker.step_inputs import StepInputs

HEADS, KV_HEADS, DIM, SLOTS = 9, 3, 64, 4096


def _load_in_a_new_process(root: Path) -> str:
    """What a starting engine logs when it loads the kernel with this cache root."""
    code = (
        "import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO);"
        "from kvpilot.engine.model import cpu_attention; from kvpilot.engine.worker.cpu_features import read_cpu_flags;"
        "cpu_attention.load(Path(sys.argv[1]), read_cpu_flags())"
    )
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def kernel_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root a first engine built the kernel into (a process of its own: this one may have
    loaded the kernel already), loaded here too."""
    root = tmp_path_factory.mktemp("kernels")
    assert "event=cpu_attention_kernel source=built vector_isa=" in _load_in_a_new_process(root)
    cpu_attention.load(root, read_cpu_flags())
    return root


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """SDPA in fp32 over the first n slots of one sequence: [heads, dim]."""
    keys = k[slots[:n]].float().transpose(0, 1).unsqueeze(0)
    values = v[slots[:n]].float().transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(q[None, :, None], keys, values, enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_it_equals_sdpa_over_ragged_contexts_of_several_sequences(kernel_root, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k = torch.randn(SLOTS, KV_HEADS, DIM).to(dtype)
    v = torch.randn(SLOTS, KV_HEADS, DIM).to(dtype)
    # One context within a chunk, one spanning three (the chunk merge), one exactly a chunk.
    lengths = [5, 300, cpu_attention._CHUNK]
    slots = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # padding: slot 0, never read
    for i, n in enumerate(lengths):
        slots[i, :n] = torch.randperm(SLOTS)[:n]
    q = torch.randn(len(lengths), HEADS, DIM)
    out = cpu_attention.decode_attention(q, k, v, slots, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[i], _reference(q[i], k, v, slots[i], n), atol=1e-5, rtol=1e-5)
    # A compiled graph calls the registered operator with the same result.
    compiled = torch.compile(lambda q, s, n: cpu_attention.decode_attention(q, k, v, s, n), dynamic=True)
    torch.testing.assert_close(compiled(q, slots, torch.tensor(lengths)), out)


def test_a_length_outside_the_slots_is_refused(kernel_root) -> None:
    k = v = torch.zeros(16, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="outside 1..width"):
        cpu_attention.decode_attention(
            torch.zeros(1, HEADS, DIM), k, v, torch.zeros(1, 4, dtype=torch.long), torch.tensor([5])
        )


def test_the_library_is_kept_per_cpu_type_and_a_second_start_loads_it(kernel_root) -> None:
    flags = read_cpu_flags()
    assert "event=cpu_attention_kernel source=cache" in _load_in_a_new_process(kernel_root)
    kernels = kernel_root / cpu_attention.KERNELS
    assert (kernels / f"{cpu_attention.library_name(flags)}.so").is_file()
    assert not list(kernels.glob(".build-*")), "the build directory was left behind"
    # Another CPU type (other flags) builds a library of its own name.
    assert cpu_attention.library_name(flags | {"a_flag_this_cpu_lacks"}) != cpu_attention.library_name(flags)


def test_isa_follows_the_flags() -> None:
    assert (
        cpu_attention.vector_isa(frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})) == "AVX512"
    )
    assert cpu_attention.vector_isa(frozenset({"avx512f", "avx2", "fma"})) == "AVX2"
    assert cpu_attention.vector_isa(frozenset({"neon"})) is None


def test_decode_groups_carry_lengths_for_the_kernel_and_no_mask() -> None:
    inputs = StepInputs(16, torch.device("cpu"), decode_kernel=True)
    inputs.add([1], 20, [0, 1], decode=True)
    inputs.add([2], 3, [2], decode=True)
    inputs.add([3, 4], 40, [3, 4, 5], decode=True)  # a decode with a draft: SDPA with its mask
    groups = inputs.build()[2].decodes
    assert groups[0].lengths.tolist() == [21, 4] and groups[0].mask is None
    assert groups[1].lengths is None and groups[1].mask is not None


def test_a_failed_build_leaves_the_portable_path(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    runner = LLM(dtype="float32", kv_cache_memory_bytes=16 << 20).engine.runner
    assert runner.decode_kernel is False  # built only beside compile_decode

    def fail(*args: object) -> None:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(cpu_attention, "load", fail)
    with caplog.at_level(logging.WARNING):
        assert runner._load_decode_kernel(None) is False
    assert "cpu_attention_kernel_unavailable" in caplog.text and "no compiler today" in caplog.text
