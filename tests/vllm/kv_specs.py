"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: each stdin line is a
case {"id", "config": a config.json}; each stdout line is what vLLM's own ModelConfig makes of it:
the layers, KV heads and head size it allocates the KV cache by, and what it sees beyond plain
attention (latent attention, a sliding window, hybrid or attention-free layers), or the error.

Beside those, the parameters of the model as vLLM builds it, the KV cache spec every attention
layer of the model reports (the model built on the meta device: no memory, no weights) and what
vLLM's own KV cache planning makes of them with
`block_size` tokens per block, as its CUDA backends take them, `max_num_batched_tokens` under async
scheduling (its GPU default) and `available` bytes: its groups, blocks, and the blocks one
max_model_len sequence takes. The checkpoint's quantization_config is left out of that build (this
CPU-only venv has no kernels for FP8 or MXFP4 layers; the KV cache stays in the model's dtype).

A hybrid model (Mamba or linear-attention layers beside attention) is planned as vLLM on a CUDA GPU
plans it with the prefix caching the operator renders (mamba_cache_mode "align"): the model built,
the block size raised until an attention page holds a layer's state
(Platform._align_hybrid_block_size, with FlashAttention's kernel block sizes), the state's dtype as
the CUDA platform leaves it (this CPU platform would store it in fp32), and, for a case with
"flashinfer_gdn", Gated DeltaNet's prefill on FlashInfer as vLLM runs it on Hopper GPUs. The state
and block size at tensor-parallel sizes 2, 4 and 8 come from the model class's own state shapes
(building the model needs its GPUs), and so do every model's KV heads per GPU at those sizes
(ModelConfig.get_num_kv_heads: copied where the GPUs outnumber them). A case with "weights_split"
reports the parameter bytes one GPU holds at those sizes, a token's K and V on it (kv_split) and, but
for a hybrid, vLLM's planning of AVAILABLE bytes on it (pool_split): the model built as rank 0 of a
tensor-parallel group that size (the group's size set, no other process).

A sparse-attention model (DeepSeek V3.2, GLM-5: an indexer's keys beside the latent) is built with the
sparse MLA backend CUDA's SM90 priorities give it, which the CPU platform refuses to pick (FlashAttention's,
FlashMLA's for an FP8 cache), and reported again under an FP8 KV cache, with the block sizes those
backends take and the compute capabilities CUDA's sparse backends run on (sparse). The classes built
are the generic ones this CPU platform resolves DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM to
(deepseek_v2.py); on CUDA vLLM 0.33 runs models/deepseek_v32/nvidia/model.py's, which subclasses them
with the same indexer, skip rule and cache specs.

A case with a "draft_model" (a small model's config.json) is planned again with it as vLLM's draft
model (SpeculativeConfig method "draft_model"), its KV cache in the case's "kv_cache_dtype" (auto
when it has none): the pool of the target's layers and the draft's,
both models built here as DraftModelProposer builds the draft (its own ModelConfig, prefix
"draft_model", no quantization).

A case with an "eagle_head" (an EAGLE head's config.json) is planned again with that head as vLLM's
EAGLE drafter (SpeculativeConfig method "eagle"): whether VllmConfig turns the hybrid KV cache
manager off, and the pool vLLM then plans of the target's layers and the head's one decoder layer
(a full-attention layer of the target's KV shape, as Llama 4's NoPE-layer head is: the head's own
module is not built here).

A case with "ngram" (a number of draft tokens) is planned again speculating with them (SpeculativeConfig
method "ngram"): the target's layers and pool then, a hybrid's state layers keeping room for the drafts.

The model folder holds only the config.json, so nothing is downloaded and no weights are read.
"""

from __future__ import annotations

import copy
import json
import socket
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
from vllm.model_executor.model_loader.utils import get_model_architecture
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import DeviceCapability, Platform
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    is_quantized_kv_cache,
)
from vllm.v1.worker.workspace import init_workspace_manager

BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
AVAILABLE = 40 * 1024**3
TP_SIZES = (2, 4, 8)
SPARSE_BACKEND = AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE
SPARSE_FP8_BACKEND = AttentionBackendEnum.FLASHMLA_SPARSE
# The sparse MLA backends CUDA's priorities list (platforms/cuda.py), on one capability or another.
CUDA_SPARSE_BACKENDS = (
    SPARSE_BACKEND,
    SPARSE_FP8_BACKEND,
    AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE_FA4,
    AttentionBackendEnum.FLASHINFER_MLA_SPARSE,
    AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM90,
    AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120,
)


def kv_spec(folder: Path) -> dict[str, Any]:
    config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    parallel = ParallelConfig()
    return {
        "layers": config.get_num_layers(parallel),
        "kv_heads": config.get_num_kv_heads(parallel),
        "head_size": config.get_head_size(),
        "use_mla": bool(config.use_mla),
        "sliding_window": config.get_sliding_window(),
        "hybrid": bool(getattr(config, "is_hybrid", False)),
        "attention_free": bool(getattr(config, "is_attention_free", False)),
        "multimodal": bool(config.is_multimodal_model),
        "max_model_len": config.max_model_len,
        "kv_heads_per_gpu": {
            str(tp): config.get_num_kv_heads(ParallelConfig(tensor_parallel_size=tp)) for tp in TP_SIZES
        },
    }


def _layer_specs(
    vllm_config: VllmConfig, flashinfer_gdn: bool = False
) -> tuple[torch.nn.Module, dict[str, KVCacheSpec]]:
    """The model built, and every attention layer's KV cache spec, at BLOCK_SIZE (the CPU backend picks
    its own), or, for a hybrid, at the block size vLLM aligns to its state pages once the layers are built."""
    hybrid = vllm_config.model_config.is_hybrid
    with ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        if flashinfer_gdn:
            on_flashinfer = mock.patch.object(
                qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend", lambda _: ("auto", "flashinfer")
            )
            stack.enter_context(on_flashinfer)
        sparse = _hopper_sparse(CpuPlatform.get_attn_backend_cls)
        stack.enter_context(mock.patch.object(CpuPlatform, "get_attn_backend_cls", sparse))
        model_class, _ = get_model_architecture(vllm_config.model_config)
        # In the model's dtype, as vLLM's loader builds it: what a layer holds in fp32 (routers) stays so.
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
            model = model_class(vllm_config=vllm_config, prefix="")
        if hybrid:
            cuda_backends = classmethod(lambda cls, config: [FlashAttentionBackend])
            stack.enter_context(mock.patch.object(Platform, "_find_non_ssm_backends", cuda_backends))
            Platform._align_hybrid_block_size(vllm_config, FlashAttentionBackend)
        specs = {
            name: module.get_kv_cache_spec(vllm_config) for name, module in model.named_modules() if _own_cache(module)
        }
    block_size = vllm_config.cache_config.block_size if hybrid else BLOCK_SIZE
    return model, {
        name: replace(spec, block_size=block_size) if isinstance(spec, AttentionSpec) else spec
        for name, spec in specs.items()
        if spec is not None
    }


def _hopper_sparse(cpu_choice: Any) -> classmethod:
    """The CPU platform's backend choice, but for sparse attention (DeepSeek V3.2, GLM-5), which it
    refuses: the backend CUDA's SM90 priorities give it (platforms/cuda.py: FlashAttention's sparse MLA,
    which takes a 16-bit cache only, then FlashMLA's, which serves an FP8 one as fp8_ds_mla)."""

    def choose(cls: type, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None) -> str:
        if not attn_selector_config.use_sparse:
            return cpu_choice(selected_backend, attn_selector_config, num_heads)
        quantized = is_quantized_kv_cache(attn_selector_config.kv_cache_dtype or "auto")
        return (SPARSE_FP8_BACKEND if quantized else SPARSE_BACKEND).get_path()

    return classmethod(choose)


def _own_cache(module: torch.nn.Module) -> bool:
    """An attention layer with a KV cache of its own: vLLM's runner gives none to a layer that reads
    another's (kv_sharing_target_layer_name: Gemma 4's last layers)."""
    return isinstance(module, AttentionLayerBase) and not getattr(module, "kv_sharing_target_layer_name", None)


def _layer(spec: KVCacheSpec, vllm_config: VllmConfig) -> dict[str, Any]:
    """What one layer's spec allocates: bytes per token of K and V, or a state's page per sequence."""
    attention, state = isinstance(spec, AttentionSpec), isinstance(spec, MambaSpec)
    return {
        "kind": type(spec).__name__,
        # Sparse attention's indexer keys (role "indexer") beside the latent ("sparse").
        "role": spec.cache_role.value if isinstance(spec, MLAAttentionSpec) else None,
        "bytes_per_token": spec.page_size_bytes // spec.block_size if attention else None,
        "sliding_window": getattr(spec, "sliding_window", None),
        "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
        "max_tp_shards": getattr(spec, "max_tp_shards", None),
        "state_bytes": spec.real_page_size_bytes if state else None,
        "page_bytes": spec.page_size_bytes if state else None,
        "pages_per_sequence": spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes if state else None,
    }


def _vllm_config(
    folder: Path,
    tp: int = 1,
    eagle_head: Path | None = None,
    draft: Path | None = None,
    cache_dtype: str = "auto",
    eagle_method: str = "eagle",
    mtp: bool = False,
    ngram: int = 0,
) -> VllmConfig:
    """vLLM's config of the model in `folder` as its CUDA GPUs take it, on `tp` of them, with the
    EAGLE head in `eagle_head` (under `eagle_method`), or the draft model in `draft`, or (`mtp`) its
    own MTP modules as its drafter, if any, or `ngram` prompt-lookup draft tokens, and its KV cache in
    `cache_dtype`."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    # A hybrid's prefix caching (as the operator renders it) keeps its states block by block.
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=model.is_hybrid, cache_dtype=cache_dtype)
    parallel = ParallelConfig(tensor_parallel_size=tp)
    speculative = None
    if eagle_head is not None or draft is not None:
        speculative = SpeculativeConfig(
            method=eagle_method if eagle_head is not None else "draft_model",
            model=str(eagle_head or draft),
            num_speculative_tokens=4,
            target_model_config=model,
            target_parallel_config=parallel,
        )
    if mtp or ngram:
        speculative = SpeculativeConfig(
            method="mtp" if mtp else "ngram",
            num_speculative_tokens=ngram or 1,
            target_model_config=model,
            target_parallel_config=parallel,
        )
    with mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", lambda: False):
        # This CPU platform would store a Gated DeltaNet's state in fp32 for its own kernels.
        vllm_config = VllmConfig(
            model_config=model, cache_config=cache, parallel_config=parallel, speculative_config=speculative
        )
    vllm_config.scheduler_config.async_scheduling = True
    # The engine core resolves it from the backends (FlashAttention: NHD). Neither this nor the layouts
    # CUDA's backends prefer is block-outermost, so pages of two sizes (Gemma 4's) are unified, not packed.
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    vllm_config.scheduler_config.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    return vllm_config


def kv_pool(folder: Path, flashinfer_gdn: bool = False) -> dict[str, Any]:
    """The parameters of the model as vLLM builds it on one GPU (its embedding and LM head padded to
    whole 64-row blocks), the layers' specs and vLLM's planning of AVAILABLE bytes with them."""
    vllm_config = _vllm_config(folder)
    model, specs = _layer_specs(vllm_config, flashinfer_gdn)
    built = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "layer_specs": [_layer(spec, vllm_config) for spec in specs.values()],
    }
    kinds = (AttentionSpec | MambaSpec) if vllm_config.model_config.is_hybrid else AttentionSpec
    if not specs or any(not isinstance(spec, kinds) for spec in specs.values()):
        return built
    return built | {"pool": _planned(vllm_config, specs)}


def sparse(folder: Path) -> dict[str, Any]:
    """A sparse-attention model's layers under an FP8 KV cache (fp8_ds_mla on FlashMLA's sparse backend)
    and vLLM's planning of AVAILABLE bytes with them in the blocks the sparse kernels take, the block
    sizes each of the two Hopper backends takes, and the CUDA compute capabilities (majors 7 to 12) each
    of CUDA's sparse backends runs on."""
    vllm_config = _vllm_config(folder, cache_dtype="fp8")
    _, specs = _layer_specs(vllm_config)
    blocks = _block_sizes(SPARSE_BACKEND)[0]
    vllm_config.cache_config.block_size = blocks
    return {
        "fp8_layer_specs": [_layer(spec, vllm_config) for spec in specs.values()],
        # The FP8 pool at the block size the sparse kernels take (the plan renders it).
        "fp8_pool": _planned(vllm_config, {name: replace(spec, block_size=blocks) for name, spec in specs.items()}),
        "kernel_block_sizes": {backend.name: _block_sizes(backend) for backend in (SPARSE_BACKEND, SPARSE_FP8_BACKEND)},
        "cuda_majors": {backend.name: _cuda_majors(backend) for backend in CUDA_SPARSE_BACKENDS},
    }


def _cuda_majors(backend: AttentionBackendEnum) -> list[int]:
    """The CUDA compute capabilities' majors, 7 to 12, `backend` runs on."""
    runs_on = backend.get_class().supports_compute_capability
    return [major for major in range(7, 13) if runs_on(DeviceCapability(major, 0))]


def _block_sizes(backend: AttentionBackendEnum) -> list[int]:
    """The block sizes `backend`'s kernels take, a MultipleOf by its base."""
    return [getattr(size, "base", size) for size in backend.get_class().get_supported_kernel_block_sizes()]


def with_eagle(folder: Path, head: dict[str, Any]) -> dict[str, Any]:
    """The model planned beside the EAGLE head `head`: whether vLLM turns its hybrid KV cache manager
    off, and the pool of the target's layers and the head's decoder layer."""
    (folder.parent / f"{folder.name}-eagle").mkdir()
    (folder.parent / f"{folder.name}-eagle" / "config.json").write_text(json.dumps(head))
    vllm_config = _vllm_config(folder, eagle_head=folder.parent / f"{folder.name}-eagle")
    _, specs = _layer_specs(vllm_config)
    full = next(spec for spec in specs.values() if type(spec) is FullAttentionSpec)
    # The head's layer after the target's (vLLM names it past the target's last layer).
    specs["draft_model.model.layers.0.self_attn.attn"] = full
    return {
        "hybrid_manager_off": bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
        "pool": _planned(vllm_config, specs),
    }


def drafter(vllm_config: VllmConfig, model_config: ModelConfig) -> tuple[torch.nn.Module, dict[str, KVCacheSpec]]:
    """The drafter `model_config` describes, built on the meta device under `vllm_config` as vLLM's
    proposers build it (prefix "draft_model"), and its attention layers' KV specs at BLOCK_SIZE, named
    as the layers register themselves (module names are the drafter's own, the target's too); sparse
    attention's layers on CUDA's backend, as the target's (_hopper_sparse)."""
    sparse = _hopper_sparse(CpuPlatform.get_attn_backend_cls)
    with set_current_vllm_config(vllm_config), mock.patch.object(CpuPlatform, "get_attn_backend_cls", sparse):
        model_class, _ = get_model_architecture(model_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            model = model_class(vllm_config=vllm_config, prefix="draft_model")
        return model, {
            f"draft_model.{name}": replace(spec, block_size=BLOCK_SIZE)
            for name, module in model.named_modules()
            if _own_cache(module) and (spec := module.get_kv_cache_spec(vllm_config)) is not None
        }


def with_draft(folder: Path, draft: dict[str, Any], cache_dtype: str = "auto") -> dict[str, Any]:
    """The model planned beside the draft model `draft` (a config.json; SpeculativeConfig method
    "draft_model"): the pool of the target's layers and the draft's, which DraftModelProposer builds
    under the prefix "draft_model" into the same forward context."""
    (folder.parent / f"{folder.name}-draft").mkdir()
    (folder.parent / f"{folder.name}-draft" / "config.json").write_text(json.dumps(draft))
    vllm_config = _vllm_config(folder, draft=folder.parent / f"{folder.name}-draft", cache_dtype=cache_dtype)
    _, specs = _layer_specs(vllm_config)
    speculative = vllm_config.speculative_config
    assert speculative is not None and speculative.method == "draft_model", speculative
    # A copy: building the draft's config settles the scheduler's anew (it is shared, not copied).
    draft_config = replace(copy.deepcopy(vllm_config), model_config=speculative.draft_model_config, quant_config=None)
    _, drafted = drafter(draft_config, draft_config.model_config)
    return {
        "draft_layers": [_layer(spec, vllm_config) for spec in drafted.values()],
        "pool": _planned(vllm_config, {**specs, **drafted}),
    }


# What vLLM's proposer shares with an MTP drafter after loading it (llm_base_proposer.py
# _maybe_share_embeddings, _maybe_share_lm_head): the target's embedding and LM head, in place of the
# drafter's own (DeepSeek's and GLM's in each module, Qwen3-Next's and Qwen3.5's beside them).
MTP_SHARED = ("model.embed_tokens.", ".shared_head.head.", "lm_head.")


def with_mtp(folder: Path) -> dict[str, Any]:
    """The model's MTP modules as vLLM drafts with them (SpeculativeConfig method "mtp"): the class
    it builds, the parameters it holds beside the target's (all but what it shares), its layers' KV
    specs, and the bytes of those parameters one GPU holds on each of TP_SIZES GPUs (rank 0); for a
    hybrid, vLLM's planning of AVAILABLE bytes with the target's layers and the drafter's, in the
    blocks it raises for the target's state pages (one GPU)."""
    found: dict[str, Any] = {"split": {}}
    group = parallel_state.get_tp_group()
    for tp in (1, *TP_SIZES):
        group.world_size = tp
        try:
            vllm_config = _vllm_config(folder, tp=tp, mtp=True)
            speculative = vllm_config.speculative_config
            assert speculative is not None and speculative.method == "mtp", speculative
            draft_config = replace(copy.deepcopy(vllm_config), model_config=speculative.draft_model_config)
            model, drafted = drafter(draft_config, draft_config.model_config)
            # The target built after the copy: its layers, registered in its config, are not copied.
            hybrid = vllm_config.model_config.is_hybrid
            if hybrid and tp == 1:
                _, specs = _layer_specs(vllm_config)
        except Exception as error:  # noqa: BLE001 - reported per size, for the test to show
            found["split"][str(tp)] = {"error": f"{type(error).__name__}: {error}"}
            continue
        held = [p for name, p in model.named_parameters() if not any(s in name for s in MTP_SHARED)]
        found["split"][str(tp)] = sum(p.numel() * p.element_size() for p in held)
        if tp == 1:
            found |= {
                "class": type(model).__name__,
                "parameters": sum(p.numel() for p in held),
                "draft_layers": [_layer(spec, vllm_config) for spec in drafted.values()],
            }
            if hybrid:
                block = vllm_config.cache_config.block_size
                raised = {name: replace(spec, block_size=block) for name, spec in drafted.items()}
                found["pool"] = _planned(vllm_config, {**specs, **raised})
    group.world_size = 1
    return found


def with_ngram(folder: Path, tokens: int, flashinfer_gdn: bool) -> dict[str, Any]:
    """The model speculating with `tokens` prompt-lookup draft tokens (SpeculativeConfig method "ngram":
    no drafter, so what changes is the target's own cache, a hybrid's state layers'): its layers' specs,
    vLLM's planning of AVAILABLE bytes with them, and, on Triton's kernels, a hybrid's state page and
    block size on each of TP_SIZES GPUs."""
    vllm_config = _vllm_config(folder, ngram=tokens)
    _, specs = _layer_specs(vllm_config, flashinfer_gdn)
    found = {
        "layer_specs": [_layer(spec, vllm_config) for spec in specs.values()],
        "pool": _planned(vllm_config, specs),
    }
    if flashinfer_gdn:
        return found
    return found | {"split": hybrid_split(folder, tokens)}


def _planned(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec]) -> dict[str, Any]:
    """vLLM's planning of AVAILABLE bytes with the layers' `specs`: its groups, blocks, and the blocks
    one max_model_len sequence takes."""
    groups = get_kv_cache_groups(vllm_config, specs)
    planned = get_kv_cache_config_from_groups(vllm_config, groups, AVAILABLE)
    per_request = sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes) for g in groups
    )
    return {
        "block_size": vllm_config.cache_config.block_size,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
        "available": AVAILABLE,
        "groups": [type(g.kv_cache_spec).__name__ for g in groups],
        "num_blocks": planned.num_blocks,
        "blocks_per_request": per_request,
        "max_model_len": vllm_config.model_config.max_model_len,
    }


def hybrid_split(folder: Path, ngram: int = 0) -> dict[str, Any]:
    """A hybrid's state page per GPU and the block size vLLM aligns to it at each of TP_SIZES (or why
    vLLM cannot split it so), speculating with `ngram` draft tokens."""
    split: dict[str, Any] = {}
    for tp in TP_SIZES:
        try:
            split[str(tp)] = _hybrid_on(folder, tp, ngram)
        except Exception as error:  # noqa: BLE001 - reported per size, for the test to show
            split[str(tp)] = {"error": f"{type(error).__name__}: {error}"}
    return split


def _hybrid_on(folder: Path, tp: int, ngram: int) -> dict[str, Any]:
    """A hybrid's state page per GPU and the block size vLLM aligns to it on `tp` GPUs, from the
    model class's state shapes and dtypes (Triton kernels: no checkpoint grid)."""
    vllm_config = _vllm_config(folder, tp=tp, ngram=ngram)
    model_class, _ = get_model_architecture(vllm_config.model_config)
    state = MambaSpec(
        shapes=model_class.get_mamba_state_shape_from_config(vllm_config),
        dtypes=model_class.get_mamba_state_dtype_from_config(vllm_config),
        block_size=-1,
    )
    with mock.patch.object(Platform, "_find_non_ssm_backends", classmethod(lambda cls, c: [FlashAttentionBackend])):
        Platform._align_hybrid_block_size(vllm_config, FlashAttentionBackend)
    return {"state_bytes": state.page_size_bytes, "block_size": vllm_config.cache_config.block_size}


def weights_split(folder: Path) -> dict[str, Any]:
    """The parameter bytes one GPU holds on each of TP_SIZES GPUs (the model built on the meta device
    as rank 0 of a tensor-parallel group that size) and a token's K and V there (its attention layers'
    specs), or why vLLM does not build it so."""
    group = parallel_state.get_tp_group()
    weights: dict[str, Any] = {}
    kv: dict[str, int] = {}
    pools: dict[str, Any] = {}
    for tp in TP_SIZES:
        group.world_size = tp
        try:
            vllm_config = _vllm_config(folder, tp=tp)
            model, specs = _layer_specs(vllm_config)
            weights[str(tp)] = sum(p.numel() * p.element_size() for p in model.parameters())
            kv[str(tp)] = sum(s.page_size_bytes // s.block_size for s in specs.values() if isinstance(s, AttentionSpec))
            if not vllm_config.model_config.is_hybrid:
                pools[str(tp)] = _planned(vllm_config, specs)
        except Exception as error:  # noqa: BLE001 - reported per size, for the test to show
            weights[str(tp)] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            group.world_size = 1
    return {"weights_split": weights, "kv_split": kv, "pool_split": pools}


def _init_distributed() -> None:
    """One rank of one: the parallel state building a model needs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    # FlashMLA's sparse backend takes its scratch from the runner's workspace as it is built.
    init_workspace_manager(torch.device("meta"))


def main() -> None:
    _init_distributed()
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            case = json.loads(line)
            folder = Path(scratch) / case["id"]
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(case["config"]))
            try:
                found: dict[str, Any] = kv_spec(folder)
                found |= kv_pool(folder, bool(case.get("flashinfer_gdn")))
                if found["hybrid"] and not case.get("flashinfer_gdn"):
                    found["split"] = hybrid_split(folder)
                if any(layer["role"] == "indexer" for layer in found["layer_specs"]):
                    found["sparse"] = sparse(folder)
                if case.get("weights_split"):
                    found |= weights_split(folder)
                if case.get("eagle_head"):
                    found["eagle"] = with_eagle(folder, case["eagle_head"])
                if case.get("ngram"):
                    found["ngram"] = with_ngram(folder, case["ngram"], bool(case.get("flashinfer_gdn")))
                if case.get("mtp"):
                    found["mtp"] = with_mtp(folder)
                if case.get("draft_model"):
                    found["draft"] = with_draft(folder, case["draft_model"], case.get("kv_cache_dtype", "auto"))
            except Exception as error:  # noqa: BLE001 - reported per case, for the test to show
                found = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps({"id": case["id"], **found}), flush=True)


if __name__ == "__main__":
    main()
