"""The Plan: what the planner decided for one InferenceService, the one input of rendering.

A data type only (operator/planning/ makes it): the runtimes render their argv from it and the
status shows its camelCase view (controller/status.py), so it lives beside the spec.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from kvpilot.operator.api.names import variant, variant_key


class LoraPlan(BaseModel):
    """The runtime's LoRA settings for spec.adapters (planning/adapters.py), and the memory they take."""

    model_config = ConfigDict(frozen=True)

    adapters: int  # how many spec.adapters lists
    max_loras: int  # adapter slots resident on the GPU
    max_lora_rank: int
    max_cpu_loras: int  # adapters cached in host memory: all of them
    slot_bytes: int  # the GPU memory of the max_loras slots, all GPUs of a replica together


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    fits: bool
    failure: str | None = None  # CamelCase code when fits is False; a condition reason
    reason: str
    model: str
    runtime: str = "kvpilot"
    gpu: str | None = None  # a catalog GPU, or "cpu" (accelerator.type cpu)
    gpu_count: int = 1  # per replica: the tensor-parallel size
    device_profile: str | None = None  # a CPU plan's device profile (accelerator.profile)
    cpus: int = 0  # CPUs a CPU plan's replica requests: the threads its profile was measured with
    compile_decode: bool = False  # the engine compiles a lone sequence's decode step (CPU plans)
    quantization: str | None = None
    speculative: str = "off"
    draft_model: str | None = None  # serving.draftModel, when the plan runs it
    # serving.draftModel is an EAGLE-3 head (its config.json's architectures), which vLLM runs as method eagle3.
    eagle3_head: bool = False
    num_speculative_tokens: int | None = None
    # The share of drafts accepted the plan's TPOT assumes, in the engines' unit (status.latency shows the
    # observed one beside it).
    assumed_draft_acceptance: float | None = None
    # The share of prompt tokens the prefill assumes the prefix cache serves (load.prefixShare;
    # status.planAccuracy shows the observed one beside it).
    assumed_prefix_share: float = 0.0
    block_size: int = 16
    kv_cache_dtype: str = "model"  # "model" (16-bit) or "fp8"
    gpu_memory_utilization: float = 0.9
    # Both include the draft model's share when the plan runs one (the engine's own totals).
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0  # all KV heads' (each GPU holds 1/gpu_count of them)
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    # The model's files as its checkpoint stores them (16-bit, or model.quantization's scheme): what
    # an hf:// download writes to the pod's disk (a draft's are its 16-bit draft_weight_bytes).
    checkpoint_bytes: int = 0
    kv_pool_bytes: int = 0  # all GPUs' of a replica together
    kv_blocks: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    predicted_batch: float = 0.0
    predicted_ttft_ms: float = 0.0
    predicted_tpot_ms: float = 0.0
    predicted_latency_ms: float = 0.0
    replicas: int = 0
    # The most requests per second one replica serves within the SLO at the load's request shape:
    # what a mixed pool shares the load by (0.0 where even a lone request misses the SLO).
    capacity_rps: float = 0.0
    meets_slo: bool = False
    # Seconds from a replica's pod starting to ready, typically (its downloads, then the engine's
    # start: planning/startup.py), and the bounds no healthy start passes: the engine container's
    # (its startup probe) and the downloads' (with the engine's, the rollout's progress deadline).
    predicted_ready_s: float = 0.0
    startup_budget_s: int = 0
    download_budget_s: int = 0
    # One line per choice: model, gpu, quantization, kvCache, batching, speculative, replicas.
    reasons: dict[str, str] = {}
    lora: LoraPlan | None = None  # spec.adapters' settings; None: the spec lists no adapter

    @model_serializer(mode="wrap")
    def _without_absent_lora(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A plan without adapters reads as it did before adapters existed (`kvpilot plan --json`, status).
        dumped: dict[str, Any] = handler(self)
        if dumped.get("lora", "") is None:
            del dumped["lora"]
        return dumped


class Variant(BaseModel):
    """One GPU type (on one capacity class of nodes, when it names one) of a mixed pool: its own plan
    (made for the whole load, then held at the share it serves: its replicas and latencies are those
    of that share) and what it costs."""

    model_config = ConfigDict(frozen=True)

    gpu: str
    plan: Plan
    # The operator's capacity class it runs on (spot, on-demand) and that class's node labels, which
    # its pods select beside the GPU's own; None: any node of the type.
    capacity_class: str | None = None
    node_selector: dict[str, str] = {}
    max_replicas: int
    requests_per_second: float  # the share of the load it serves
    price_per_gpu_hour: float
    # A replica-hour's price over its capacity: what ranks the variants (None: it cannot meet the SLO).
    cost_per_rps_hour: float | None
    cost_per_hour: float  # at its replicas

    @property
    def key(self) -> str:
        """How prices, messages and the full types' map name it: L4, L4@spot."""
        return variant_key(self.gpu, self.capacity_class)

    @property
    def label(self) -> str:
        """Its pods' variant label value and its Deployment's name suffix: l4, l4-spot."""
        return variant(self.gpu, self.capacity_class)


class MixedPlan(BaseModel):
    """One service across several GPU types: a variant per type that can serve the model, cheapest
    per unit of capacity first, and the types left out with why."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    failure: str | None = None
    reason: str
    model: str
    variants: list[Variant] = []
    left_out: dict[str, str] = {}  # GPU type (L4, L4@spot) -> why it cannot serve the model
    replicas: int = 0
    meets_slo: bool = False
    cost_per_hour: float = 0.0
