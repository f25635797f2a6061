"""The CPU kernel path: chosen from the CPU's flags (or forced), named at start-up, and on each path
the engine's greedy tokens are HuggingFace's (within the near-tie rule)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.cpu.features import KERNEL_PATHS, choose_kernel_path, kernel_path, read_cpu_flags
from kvpilot.engine.model.quantization import Int8Dynamic
from tests.engine.conftest import make_prompts
from tests.engine.oracle import check_greedy

# /proc/cpuinfo flags of the three kinds of machine (abridged): a Zen 5 / Sapphire Rapids with bf16,
# an Ice Lake Xeon (VNNI, no bf16), a Haswell-era AVX2 CPU.
ZEN5 = "fpu sse avx2 avx512f avx512bw avx_vnni avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8"
ICE_LAKE = "fpu sse avx2 avx512f avx512bw avx512vl avx512_vnni avx512_vbmi2"
ALDER_LAKE = "fpu avx2 avx_vnni"
HASWELL = "fpu sse sse4_2 avx avx2 fma"


BOTH = ("float32", "bfloat16")


@pytest.mark.parametrize(
    ("flags", "path", "packed"),
    [
        (ZEN5, "bf16", BOTH),
        (SAPPHIRE_RAPIDS, "bf16", BOTH),
        (ICE_LAKE, "vnni", ("float32",)),
        (ALDER_LAKE, "vnni", ("float32",)),
        (HASWELL, "fp32", ("float32",)),
        ("", "fp32", ()),  # not an x86's flags: no oneDNN-packed weights
    ],
)
def test_the_path_follows_the_flags(flags: str, path: str, packed: tuple[str, ...]) -> None:
    chosen = kernel_path(frozenset(flags.split()))
    assert chosen.name == path
    assert chosen.bf16 == (path == "bf16") and chosen.integer_kernels == (path != "fp32")
    assert chosen.onednn_dtypes == packed


def test_flags_are_read_from_cpuinfo_and_an_override_wins() -> None:
    cpuinfo = f"processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: {ICE_LAKE}\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert read_cpu_flags(cpuinfo) == frozenset(ICE_LAKE.split())
    assert read_cpu_flags("") == frozenset()
    assert choose_kernel_path("auto", frozenset(ICE_LAKE.split())).reason == "cpu flags avx512_vnni, no bf16"
    for path in KERNEL_PATHS:
        # A forced path keeps what the CPU itself runs well.
        assert choose_kernel_path(path, frozenset(ZEN5.split())) == (path, "forced by cpu_kernels", BOTH)
        assert choose_kernel_path(path, frozenset(HASWELL.split())).onednn_dtypes == ("float32",)
    with pytest.raises(ValueError, match="unknown cpu kernel path 'avx'"):
        choose_kernel_path("avx")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_auto_dtype_is_bf16_only_on_the_bf16_path(path: str) -> None:
    config = EngineConfig(cpu_kernels=path)
    cpu_bf16 = choose_kernel_path(path).bf16
    expected = torch.bfloat16 if path == "bf16" else torch.float32
    assert config.torch_dtype(torch.device("cpu"), cpu_bf16) == expected
    assert EngineConfig(dtype="float32").torch_dtype(torch.device("cpu"), cpu_bf16) == torch.float32
    assert config.torch_dtype(torch.device("cuda"), cpu_bf16) == torch.bfloat16


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_each_forced_path_is_logged_and_gives_hf_greedy_tokens(path, corpus_ids, hf_greedy, caplog):
    """vnni and fp32 compute in fp32 under dtype auto, the oracle's dtype; the bf16 path's auto is
    bf16, so there the oracle runs it at dtype float32 and the bf16 choice is checked alone."""
    dtype = "float32" if path == "bf16" else "auto"
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.worker.model_runner"):
        llm = LLM(kv_cache_memory_bytes=16 << 20, cpu_kernels=path, dtype=dtype)
    assert f"cpu_kernels={path} cpu_kernels_from='forced by cpu_kernels'" in caplog.text
    assert llm.engine.runner.dtype == torch.float32
    prompts = make_prompts(corpus_ids, [7, 23])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref = hf_greedy(prompt, 10)
        check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, f"{path}: prompt {i}")


def test_the_auto_path_is_this_cpus_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.worker.model_runner"):
        llm = LLM(kv_cache_memory_bytes=16 << 20)
    path = kernel_path(read_cpu_flags())
    assert f"cpu_kernels={path.name} cpu_kernels_from={path.reason!r}" in caplog.text
    assert llm.engine.runner.cpu_kernels == path


@pytest.mark.parametrize("path", ["vnni", "fp32"])
def test_w8a8_layers_take_the_paths_kernel(path: str) -> None:
    llm = LLM(kv_cache_memory_bytes=16 << 20, cpu_kernels=path, quantization="w8a8")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "quantization", None), Int8Dynamic)]
    assert layers and all(m.quantization.integer_kernel == (path != "fp32") for m in layers)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert "Paris" in out.outputs[0].text
