"""A lone sequence's decode step, compiled by torch.compile (inductor) before serving (`compile_decode`).

On CPU most of a single-sequence decode step is the dispatch of ~170 small ops per layer around a
few matmuls; one compiled forward fuses them into a few kernels (bench/history/2026-11-30-serving.md,
"The single stream with a compiled decode step"). Several sequences per step gain nothing measurable
(the matmuls and the attention's KV reads dominate), so only this shape is compiled. Compiling takes
tens of seconds, far too long to happen on a request, so it happens when the runner starts (after
kernels.py's library, which the graph calls, is loaded), and its artifacts are kept in
compile_cache_dir for the next start (compile_cache.py; bench/RESULTS.md, "Compiled decoding: cold
and warm starts").
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.convert_frame import register_bytecode_hook
from transformers import PretrainedConfig

from kvpilot.engine.cpu import kernels as cpu_kernels
from kvpilot.engine.cpu.compile_cache import compile_with_cache, key_inputs
from kvpilot.engine.model.attention import AttentionMetadata, KVCache
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

# The compiled decode step is traced at this position: its context length (41) must equal no
# dimension of the model (a head count of 3, say) nor be 1, or torch.compile would specialise the
# graph to that length instead of keeping it dynamic.
WARM_UP_POSITION = 40

# What a traced graph bakes in of the C++ kernels: whether single-query decodes attend through the
# attention kernel, and the weight-only schemes whose matmuls run kvpilot's kernels.
KernelState = tuple[bool, frozenset[str]]


class CompiledDecode:
    """The compiled forward and the kernels it was traced with. It runs without Dynamo's guards, so
    whoever calls `forward` asks `traced_for` first."""

    def __init__(self, forward: Callable[..., torch.Tensor], traced_with: KernelState) -> None:
        self.forward = forward
        self.traced_with = traced_with

    def traced_for(self, meta: AttentionMetadata, kernels: KernelState) -> bool:
        """Whether the compiled forward computes this step: one sequence decoding one token, at a
        context of 2 tokens or more (the graph's shapes are dynamic from 2: Dynamo specialises 0
        and 1), with the kernels it was traced with."""
        return _single_decode(meta) and meta.decodes[0].slots.shape[1] >= 2 and kernels == self.traced_with


def compile_decode(
    model: LlamaForCausalLM,
    hf_config: PretrainedConfig,
    kv_caches: list[KVCache],
    block_size: int,
    kernels: KernelState,
    root: Path | None,
) -> CompiledDecode:
    """The model's forward compiled for a lone sequence's decode step over these KV caches, traced
    with `kernels` (those loaded by now), from the compile cache under `root` where it has it."""
    # The caches are allocated on the runner's device in its dtype, the one its activations take.
    device, dtype, slots = kv_caches[0][0].device, kv_caches[0][0].dtype, kv_caches[0][0].shape[0]
    if slots <= WARM_UP_POSITION:
        raise ValueError(
            f"compile_decode needs a KV pool of more than {WARM_UP_POSITION} tokens, this one holds {slots}"
        )
    if device.type == "cpu" and not cpu_kernels.has_compiler():
        raise ValueError(
            "compile_decode needs a C++ compiler for torch.compile's CPU kernels: g++ or clang++ "
            "on PATH (or $CXX); install one or leave compile_decode off"
        )
    key = key_inputs(model, hf_config, dtype, device, model.quantization)
    log.info("event=decode_compile_started cache_dir=%s", root)
    started = time.monotonic()
    forward, cache = compile_with_cache(lambda: _trace(model, kv_caches, block_size, kernels[0]), root, key)
    log.info("event=decode_compiled seconds=%.1f cache=%s", time.monotonic() - started, cache)
    return CompiledDecode(forward, kernels)


def _trace(
    model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, decode_kernel: bool
) -> Callable[..., torch.Tensor]:
    """The compiled forward, traced and built on one decode in blocks no request holds yet,
    whose KV is overwritten before anything reads it; returned as the bytecode Dynamo made of
    it, which the runner calls without Dynamo's guards (as vLLM dispatches to its compiled
    code). The guards check every parameter, KV cache and module hook on each call, thousands
    of checks, a large share of a small model's batch-1 step on CPU
    (bench/history/2026-12-02-serving-cpu-decode.md, "The compiled step without Dynamo's
    guards"). They hold by
    construction here: the weights and caches are the runner's for its life, the graph is
    called only for the steps it was traced for (`CompiledDecode.traced_for`), and fullgraph
    leaves no part of the forward to Dynamo at run time."""
    code = type(model).forward
    # A code object of this trace's own: Dynamo keeps what it compiled per code object, so the
    # bytecode captured below is this trace's, never another engine's in the process.
    forward = types.FunctionType(code.__code__.replace(), code.__globals__, code.__name__, closure=code.__closure__)
    compiled = torch.compile(types.MethodType(forward, model), dynamic=True, fullgraph=True)
    made: list[types.CodeType] = []

    def keep(original: types.CodeType, transformed: types.CodeType) -> None:
        if original is forward.__code__:
            made.append(transformed)

    hook = register_bytecode_hook(keep)
    # Inside inference mode as in the runner's steps: the graph is built for inference tensors. The
    # modules' floats (RMSNorm's eps) are constants of the graph, not tensors made from them on
    # every call, and its parameters and buffers are frozen into it, so the bytecode before
    # the graph passes only the step's inputs, not ~430 weights looked up attribute by
    # attribute (bench/history/2026-12-02-serving-cpu-decode.md, "The compiled step's weights
    # frozen into its graph").
    try:
        with (
            torch.inference_mode(),
            torch._dynamo.config.patch(specialize_float=True),
            torch._inductor.config.patch({"freezing": True, "cpp.weight_prepack": False}),
        ):
            inputs = StepInputs(block_size, kv_caches[0][0].device, decode_kernel)
            blocks = list(range(-(-(WARM_UP_POSITION + 1) // block_size)))
            inputs.add([0], WARM_UP_POSITION, blocks, decode=True)
            input_ids, positions, meta = inputs.build()
            compiled(input_ids, positions, kv_caches, meta)
    finally:
        hook.remove()
    if len(made) != 1:
        raise RuntimeError(f"torch.compile made {len(made)} versions of the decode step's code, expected one")
    return types.MethodType(
        types.FunctionType(made[0], code.__globals__, code.__name__, closure=code.__closure__), model
    )


def _single_decode(meta: AttentionMetadata) -> bool:
    """The step is one sequence decoding one token."""
    return (
        not meta.prefills
        and len(meta.decodes) == 1
        and meta.decodes[0].num_queries == 1
        and meta.decodes[0].slots.shape[0] == 1
    )
