"""How long a replica takes to become ready, from what its plan knows: the download of its hf://
files (the pod's init containers), reading the checkpoint into the device, and the runtime's
warm-up.

Two figures each: the typical time (the plan's prediction, which the status sets beside what the
pods took and the autoscaler plans its lead with) and a bound no healthy start passes (the startup
probe's budget and the Deployment's progress deadline): a probe that gives up early kills a pod
that was nearly ready, and its replacement starts again from nothing.

vLLM, from 57 start-up logs of vLLM 0.19 on H100s (tests/operator/planning/vllm_startup_times.json,
from llm-d's planner accuracy runs; bench/RESULTS.md "Time to ready"):
- the process: imports, configuration, the engine core and the API server take ~21 s alone, ~36 s
  with tensor parallelism (a worker process per GPU, NCCL's set-up) and ~30 s more for a
  multimodal model (its processor and encoder warm-up);
- the checkpoint is read at 1.0-1.3 GiB/s in all, whatever the tensor-parallel size (the workers
  share the node's disk), 0.49 GiB/s at the slowest (a 212 GiB checkpoint on four GPUs);
- the warm-up (torch.compile, the memory profile, CUDA-graph capture) takes ~12 s and ~0.5 s per
  layer, ~7 s where vLLM's compile cache already held the graphs.
The kvpilot engine: ~10 s from the process's start to ready for the embedded model on 2 cores of a
Zen 4 (torch's import, the converted weights, the prebuilt CPU kernels); reading a checkpoint as
vLLM does; no warm-up beyond a compiled decode step's (~40 s cold on 2 cores, CPU plans only) and
building the CPU kernels where the image lacks them (~40 s).
Downloads: 105-460 MB/s from the Hugging Face Hub in those logs; typically 200 MB/s, at the
slowest 50 MB/s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import PVC_SCHEME, Architecture, InferenceServiceSpec, hub_source
from kvpilot.operator.planning import sizing

# The process until it loads weights and after its warm-up (vLLM's, by tensor parallelism).
VLLM_PROCESS_S = 21.0
VLLM_TP_PROCESS_S = 36.0
MULTIMODAL_PROCESS_S = 30.0
KVPILOT_PROCESS_S = 10.0
# vLLM's warm-up: a fixed part and a part per layer.
VLLM_WARMUP_S = 12.0
VLLM_WARMUP_PER_LAYER_S = 0.5
# The kvpilot engine's compiled decode step, and its CPU kernels where the image has none built.
COMPILE_DECODE_S = 40.0
CPU_KERNEL_BUILD_S = 40.0
# Reading the checkpoint, typically and at the slowest: from the node's disk (a download's
# emptyDir, the image), and from a claim (pvc:// or model.cache), which may be a network volume.
READ_BYTES_PER_S = 1.0 * sizing.GiB
SLOWEST_READ_BYTES_PER_S = 0.4 * sizing.GiB
SLOWEST_CLAIM_READ_BYTES_PER_S = 0.1 * sizing.GiB
# Downloading from the hub, typically and at the slowest.
DOWNLOAD_BYTES_PER_S = 200e6
SLOWEST_DOWNLOAD_BYTES_PER_S = 50e6
# The bound: the process and warm-up twice over, the read at the slowest, and a minute.
BOUND_FACTOR = 2.0
BOUND_MARGIN_S = 60.0


class Startup(NamedTuple):
    """Seconds of a replica's start: its downloads, then the engine's process, read and warm-up."""

    download_s: float
    process_s: float
    read_s: float
    warmup_s: float

    @property
    def engine_s(self) -> float:
        """From the engine container's start to ready."""
        return self.process_s + self.read_s + self.warmup_s

    @property
    def ready_s(self) -> float:
        """From the pod's start to ready."""
        return self.download_s + self.engine_s


class StartupPlan(NamedTuple):
    typical: Startup
    bound: Startup


def downloaded_bytes(spec: InferenceServiceSpec, plan: Plan) -> int:
    """The bytes a new pod downloads: its hf:// checkpoints (the model's as stored, a draft's) and
    adapters (each at most a slot's bytes: a slot holds every module at the largest rank)."""
    adapters = sum(1 for a in spec.adapters if hub_source(a.source))
    return (
        (plan.checkpoint_bytes if hub_source(spec.model.source) else 0)
        + (plan.draft_weight_bytes if hub_source(plan.draft_model) else 0)
        + (adapters * plan.lora.slot_bytes // max(plan.lora.max_loras, 1) if plan.lora else 0)
    )


def read_bytes(plan: Plan) -> int:
    """The bytes the engine reads at start: the checkpoint as stored (which a scheme applied on load
    then shrinks) and a draft's: a draft model's own, or, for MTP modules, the checkpoint once more
    (vLLM 0.33 loads DeepSeek's and GLM-4.5's drafter through every shard: their classes filter none)."""
    checkpoint = plan.checkpoint_bytes or plan.weight_bytes - plan.draft_weight_bytes
    return checkpoint + (checkpoint if plan.speculative == "mtp" else plan.draft_weight_bytes)


def _reads_a_claim(spec: InferenceServiceSpec) -> bool:
    source = spec.model.source or ""
    claimed_cache = spec.model.cache is not None and bool(spec.model.cache.claim_name)
    return source.startswith(PVC_SCHEME) or (hub_source(source) is not None and claimed_cache)


def predict_startup(spec: InferenceServiceSpec, arch: Architecture, plan: Plan) -> StartupPlan:
    """The typical start of one of `plan`'s replicas, and the bound no healthy one exceeds."""
    downloaded = downloaded_bytes(spec, plan)
    if spec.runtime == "vllm":
        multimodal = MULTIMODAL_PROCESS_S if arch.vision_parameters else 0.0
        process = (VLLM_TP_PROCESS_S if plan.gpu_count > 1 else VLLM_PROCESS_S) + multimodal
        warmup = VLLM_WARMUP_S + VLLM_WARMUP_PER_LAYER_S * arch.layers
        kernels = 0.0
    else:
        process = KVPILOT_PROCESS_S
        warmup = COMPILE_DECODE_S if plan.compile_decode else 0.0
        kernels = CPU_KERNEL_BUILD_S if plan.cpus else 0.0
    typical = Startup(downloaded / DOWNLOAD_BYTES_PER_S, process, read_bytes(plan) / READ_BYTES_PER_S, warmup)
    bound = Startup(
        downloaded / SLOWEST_DOWNLOAD_BYTES_PER_S,
        BOUND_FACTOR * (process + kernels) + BOUND_MARGIN_S,
        read_bytes(plan) / (SLOWEST_CLAIM_READ_BYTES_PER_S if _reads_a_claim(spec) else SLOWEST_READ_BYTES_PER_S),
        BOUND_FACTOR * warmup,
    )
    return StartupPlan(typical, bound)


def startup_fields(spec: InferenceServiceSpec, arch: Architecture, plan: Plan) -> tuple[dict[str, object], str]:
    """The plan's start-up fields, and the reason for them."""
    typical, bound = predict_startup(spec, arch, plan)
    download = f"download {typical.download_s:.0f} s + " if typical.download_s else ""
    reason = (
        f"ready ~{typical.ready_s:.0f} s after the pod starts: {download}process {typical.process_s:.0f} s + "
        f"reading {read_bytes(plan) / sizing.GiB:.1f} GiB {typical.read_s:.0f} s + warm-up {typical.warmup_s:.0f} s "
        f"(runtime {spec.runtime}); the startup probe allows {math.ceil(bound.engine_s)} s"
        + (f" after downloads allowed {math.ceil(bound.download_s)} s" if bound.download_s else "")
    )
    fields = {
        "predicted_ready_s": round(typical.ready_s, 1),
        "startup_budget_s": math.ceil(bound.engine_s),
        "download_budget_s": math.ceil(bound.download_s),
    }
    return fields, reason
