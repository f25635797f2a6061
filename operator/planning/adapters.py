"""LoRA adapters in a plan: the runtime's adapter settings, and the memory and step time their slots take.

vLLM 0.33 preallocates, as it loads the model, `max_loras` slots of rank `max_lora_rank` for every
module LoRA may target (`target_modules` unset: every linear layer, the embedding and the LM head),
whatever modules the adapters themselves target (vllm/lora/layers/*.create_lora_weights), in the
model's dtype (`lora_dtype` auto). Per slot and decoder layer: an A (rank x input) for each output
slice of the fused projections (q, k, v of qkv_proj; gate, up of gate_up_proj) and one for o_proj
and down_proj, and a B (output x rank) for each; beside the layers, the embedding's A (vocab x rank)
and B (hidden x rank) and the LM head's A (rank x hidden) and B (vocab x rank). Under tensor
parallelism the column-parallel layers (qkv, gate_up) split B's outputs and the row-parallel ones
(o, down) A's inputs; the embedding's and the LM head's slots are whole on every GPU. The slots are
allocated inside vLLM's "model loading" measurement, so its profile counts them with the weights:
the KV pool it finds is smaller by exactly their bytes. Our engine takes the same flags
(`--enable-lora --max-loras --max-lora-rank --max-cpu-loras`) and is planned the same way, an upper
bound where it holds fewer modules' slots.

Each decode step multiplies the batch's tokens with the low-rank A and B of the adapters in the batch:
it reads up to every resident slot (bandwidth-bound, like the weights), which the plan adds to the
bytes a decode step moves; prefill's extra FLOPs are the slots' parameters per token, under 1% of a
model's for the usual ranks, and not added.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvpilot.operator.api.spec import AdapterSpec, Architecture
from kvpilot.operator.planning import sizing
from kvpilot.operator.planning.reserve import mlp_width

# The max_lora_rank values vLLM 0.33 accepts (vllm/config/lora.py's MaxLoRARanks); our engine takes the
# same. The plan's is the smallest at or above the largest adapter's rank.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# An adapter whose rank the spec does not state is planned at vLLM's default max_lora_rank.
ASSUMED_RANK = 16
# Slots resident on the GPU (max_loras): each costs memory whether used or not, and a batch mixing
# more adapters than this waits for a slot; more adapters stay in the engine's CPU cache. Fixed, not
# one per adapter: the flags are in the pod's arguments, and adding an adapter must not roll the pods.
MAX_RESIDENT = 4
# Adapters cached in host memory (max_cpu_loras) at least, for the same reason: a service may grow to
# this many adapters without a restart (beyond it, the flag and so the pods change once).
CPU_CACHED = 16


class LoraSettings(NamedTuple):
    """The runtime's adapter flags, and how many adapters the spec lists."""

    adapters: int
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    unranked: int  # adapters planned at ASSUMED_RANK (no rank in the spec)


def lora_settings(adapters: Sequence[AdapterSpec]) -> LoraSettings | None:
    """The adapter flags for the spec's adapters, None when it lists none: MAX_RESIDENT slots, the
    rank of the largest (rounded up to one the runtime takes), all of them cached (at least
    CPU_CACHED): flags that stay as they are while adapters come and go within those bounds."""
    if not adapters:
        return None
    ranks = [a.rank or ASSUMED_RANK for a in adapters]
    rank = next(r for r in MAX_LORA_RANKS if r >= max(ranks))
    count = len(adapters)
    return LoraSettings(count, MAX_RESIDENT, rank, max(count, CPU_CACHED), sum(a.rank is None for a in adapters))


def adapter_problem(arch: Architecture) -> str | None:
    """Why the adapters' slots of this model cannot be sized, None when they can: a mixture of experts
    holds a slot per expert (the architecture does not say how many), latent attention and a hybrid's
    state layers other modules."""
    if arch.active_parameters is not None:
        return "LoRA slots of a mixture of experts are allocated per expert, which the architecture does not state"
    if arch.latent_dim is not None:
        return "latent attention's projections (not q/k/v) hold LoRA slots the planner does not size"
    if arch.state is not None:
        return f"{arch.state.kind} layers' projections (not q/k/v) hold LoRA slots the planner does not size"
    return None


def slot_bytes(arch: Architecture, rank: int, tp: int, bytes_per_value: int) -> int:
    """The bytes of one adapter slot of `rank`, on all of a replica's `tp` GPUs together (module
    docstring): what vLLM allocates per slot."""
    hidden, head = arch.hidden_size, arch.head_size
    q, kv = arch.attention_heads * head // tp, max(arch.kv_heads // tp, 1) * head
    mlp = mlp_width(arch) // tp
    # Column-parallel: an A of the whole input per output slice, B of the GPU's outputs.
    qkv = 3 * hidden + q + 2 * kv
    gate_up = 2 * hidden + 2 * mlp
    # Row-parallel: A of the GPU's inputs, B of the whole output.
    o = q + hidden
    down = mlp + hidden
    # Embedding (A vocab x rank, B hidden x rank) and LM head (A rank x hidden, B vocab x rank).
    ends = 2 * (arch.vocab_size + hidden)
    per_gpu = (arch.layers * (qkv + gate_up + o + down) + ends) * rank * bytes_per_value
    return per_gpu * tp


def resident_bytes(arch: Architecture, settings: LoraSettings, tp: int, bytes_per_value: int) -> int:
    """The GPU memory of the runtime's `max_loras` slots on a replica's GPUs."""
    return settings.max_loras * slot_bytes(arch, settings.max_lora_rank, tp, bytes_per_value)


def describe(settings: LoraSettings, memory_bytes: int, step_s: float, arch: Architecture) -> str:
    """The plan's `adapters` reason: the settings, the memory the slots take and their step cost."""
    resident = (
        f"{settings.max_loras} slots on the GPU for {settings.adapters} adapter(s), room for "
        f"{settings.max_cpu_loras} without a restart"
    )
    assumed = (
        f"; {settings.unranked} adapter(s) without a rank counted as rank {ASSUMED_RANK} (one above "
        "max_lora_rank is refused when loaded)"
        if settings.unranked
        else ""
    )
    # A token passes through its own adapter only: one slot's parameters beside the model's.
    share = slot_bytes(arch, settings.max_lora_rank, 1, 1) / arch.parameters_per_token
    return (
        f"max_loras {settings.max_loras}, max_lora_rank {settings.max_lora_rank}, max_cpu_loras "
        f"{settings.max_cpu_loras}: {resident}, all cached in host memory{assumed}; their slots take "
        f"{memory_bytes / sizing.MiB:.0f} MiB of GPU memory from the KV pool (A and B of every linear layer, "
        f"the embedding and the LM head, as vLLM preallocates them); a decode step reads them, +"
        f"{step_s * 1000:.2f} ms at most, and prefill's low-rank products add {share:.1%} to its FLOPs (not counted)"
    )
