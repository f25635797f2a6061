"""What one option of a plan is made of: the replica (the model on its GPUs at one quantization), its
draft model, and the sizes a Plan reports of it."""

from __future__ import annotations

from typing import NamedTuple

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.context import NO_CORRECTION, Correction
from kvpilot.operator.planning.device import Device

# Verifying k + 1 tokens costs more than a plain decode step: 1.15x is an assumption for a
# bandwidth-bound GPU (no GPU was at hand; on this project's 2-core CPU, where decode is
# compute-bound, it measured ~1.5x, and a measured device computes it as a step of k + 1 rows).
# Draft acceptance (assumed and observed) is the engines' unit: planning/speculation.py.
# The modes that run a drafter with weights and KV of its own beside the target (auto chooses only "draft").
DRAFTED = ("draft", "eagle", "mtp")
# Of them, the modes whose drafter is serving.draftModel (mtp drafts with the checkpoint's own modules).
DRAFT_MODEL_MODES = ("draft", "eagle")


class Inputs(NamedTuple):
    """What every option of one plan is sized from: the spec, the model, the context a sequence may
    reach, the runtime's capabilities, and the draft model sized beside the target (None: the target
    alone)."""

    spec: InferenceServiceSpec
    arch: Architecture
    context: int
    capabilities: EngineCapabilities
    draft: Draft | None
    # What the service's engines showed: the replicas are chosen with it, the plan's own latencies not.
    correction: Correction
    kv_cache_dtype: str = "model"  # the option's: "model" (16-bit) or "fp8"
    # Sized for a speculative mode: a hybrid's state layers then keep a page and a convolution row
    # more per sequence for each of serving.numSpeculativeTokens (planning/recurrent.py).
    speculating: bool = False

    @property
    def speculative_tokens(self) -> int:
        """The draft tokens each step verifies where the replica is sized speculating, else 0."""
        return self.spec.serving.num_speculative_tokens if self.speculating else 0


class Draft(NamedTuple):
    """A draft model as the engine runs it beside the target: unquantized in the target's dtype (the
    engine loads it so), with a KV cache of one slot per slot of the target's."""

    source: str
    arch: Architecture
    weights: int
    kv_per_token: int
    head_copy: int = 0  # of `weights`, a tied head's packed copy, which a step reads in place of the rows
    # Values of the target's that each draft step computes with too (MTP modules: the target's LM head).
    shared_values: int = 0
    # A checkpoint stored quantized, which the runtime (vLLM) holds as stored: its safetensors' bytes.
    stored: int | None = None

    def on(self, gpu: Device, tp: int = 1, kv_cache_dtype: str = "model") -> Draft:
        """The draft as the engine holds it on `tp` GPUs of type `gpu`: as stored, else 4 bytes per value
        on a CPU that computes in fp32, a tied head twice where the engine packs weights for oneDNN
        (sizing.weight_bytes); its KV in the target's cache dtype (vLLM gives the draft's layers the
        target's cache config), its KV heads copied where the GPUs outnumber them, and what it holds
        whole on every GPU (replicatedParameters) once per GPU."""
        plain = sizing.weight_bytes(self.arch, "none", held=sizing.HeldAs(gpu.bytes_per_value))
        held = sizing.weight_bytes(self.arch, "none", held=sizing.HeldAs(gpu.bytes_per_value, gpu.packs_weights))
        return self._replace(
            weights=sizing.held_by_group(self.arch, held_weights(self.arch, self.stored, held), tp),
            kv_per_token=sizing.kv_bytes_per_token(self.arch, kv_bytes_per_value(gpu, kv_cache_dtype), tp),
            head_copy=0 if self.stored else held - plain,
        )


def kv_bytes_per_value(gpu: Device, kv_cache_dtype: str) -> int:
    """One value of the KV cache on `gpu`: a byte in an FP8 cache, else the GPU's unquantized value."""
    return sizing.FP8_BYTES_PER_VALUE if kv_cache_dtype == "fp8" else gpu.bytes_per_value


def held_weights(arch: Architecture, stored: int | None, counted: int) -> int:
    """A draft's weights as the runtime holds them: as stored (quantized), else as counted, or an
    EAGLE-3 head's checkpoint bytes where fewer (vLLM gives a head without an embedding the target's)."""
    if stored:
        return stored
    return min(counted, arch.loaded_checkpoint_bytes or counted) if arch.eagle3_head else counted


class Replica(NamedTuple):
    """What one engine replica is: the model on its GPUs at one quantization, with its draft."""

    arch: Architecture
    gpu: Device  # the tensor-parallel group as one device (tp_group)
    tp: int
    decode_weight_bytes: int  # the target's weight bytes one decode step moves (sizing.decode_weight_bytes)
    kv_per_token: int  # the target's
    quantization: str  # the GEMMs' rate: gpu.matmul_flops(quantization, tokens)
    max_num_seqs: int
    draft: Draft | None
    compiled: bool = False  # a lone sequence's decode step is compiled (compile_decode)
    # Observed / predicted p95 latencies and draft acceptance the predictions are multiplied by or made with.
    correction: Correction = NO_CORRECTION
    # A hybrid's state of one sequence (planning/recurrent.py), which every decode step reads and writes.
    state_per_sequence: int = 0


class Sizes(NamedTuple):
    """The numbers of a (GPU, quantization) pair a Plan reports, whether it fits or not."""

    gpu: str
    quantization: str
    weight_bytes: int  # the target's and the draft's
    draft_weight_bytes: int
    kv_bytes_per_token: int  # the target's and the draft's: what every KV slot holds
    draft_kv_bytes_per_token: int
    checkpoint_bytes: int
    kv_pool_bytes: int
    max_model_len: int
    kv_cache_dtype: str
    kv_layout: sizing.KVLayout  # how a sequence holds kv_bytes_per_token in the pool's blocks
    adapter_bytes: int = 0  # the LoRA slots' (planning/adapters.py), beside the weights; a Plan's lora reports it
    # Tokens per block: serving.blockSize, or what vLLM raises a hybrid's to (planning/recurrent.py).
    block_size: int = 16
    state_bytes: int = 0  # a hybrid's state of one layer and sequence on one GPU, before its padding

    def reported(self) -> dict[str, object]:
        """The fields a Plan reports (the layout, the block and the state are the planner's own)."""
        own = ("kv_layout", "adapter_bytes", "block_size", "state_bytes")
        return {k: v for k, v in self._asdict().items() if k not in own}
