"""The InferenceService status as pydantic models: the source of the CRD's `.status` schema (crd.py).

The reconcile (controller/status.py) and the autoscaler's loop write the status as dicts, each its
own parts, so every field is optional (a condition's type and status excepted); readers read it
through these types (`status_of`), and a writer carrying a part over writes its `dump()`. Field
descriptions and formats are the CRD's, declared here as in spec.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from kvpilot.operator.api.names import variant, variant_key
from kvpilot.operator.api.spec import (
    INT64,
    MAX_ADAPTERS,
    MAX_REPLICAS,
    Architecture,
    CheckpointQuantization,
)

# A timestamp as the status writes it (RFC 3339, e.g. 2025-01-31T12:00:00Z).
DateTime = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
Int64 = Annotated[int, Field(json_schema_extra=INT64)]


class _Status(BaseModel):
    # As spec.py's _Camel; extra="ignore": a status written by a newer operator still reads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        """As the status holds it, for a writer that carries a part over: camelCase, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class PlanStatus(_Status):
    """The plan's camelCase view (controller/status.py writes it from api/plan.py's Plan)."""

    fits: bool | None = Field(
        default=None,
        description="false: the spec does not plan (reason says why, the Planned condition's reason names it).",
    )
    reason: str | None = Field(
        default=None,
        description="The plan in a line (device, sequences, KV pool, predicted latencies), or why it failed.",
    )
    runtime: str | None = Field(default=None, description="The runtime planned for (spec.runtime).")
    gpu: str | None = Field(default=None, description="The GPU type planned for (a catalog name), or cpu.")
    gpu_count: int | None = Field(default=None, description="GPUs per replica: the tensor-parallel size.")
    device_profile: str | None = Field(default=None, description="A CPU plan's device profile (accelerator.profile).")
    cpus: int | None = Field(
        default=None, description="CPUs a CPU plan's replica requests: the threads its profile was measured with."
    )
    compile_decode: bool | None = Field(
        default=None,
        description="The engine compiles a lone sequence's decode step (CPU plans whose TPOT needs it).",
    )
    quantization: str | None = Field(default=None, description="The weights' quantization scheme the engines run.")
    speculative: str | None = Field(
        default=None, description="The speculative decoding mode the engines run (off, ngram, draft, eagle, mtp)."
    )
    weights_gib: float | None = Field(
        default=None, alias="weightsGiB", description="GiB of weights a replica holds (a draft model's included)."
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        description="Bytes of KV cache one token takes over all layers and KV heads (a draft model's included); "
        "each GPU of a replica holds its share.",
    )
    kv_cache_dtype: str | None = Field(default=None, description="The KV cache's values: model (16-bit) or fp8.")
    kv_pool_gib: float | None = Field(
        default=None, alias="kvPoolGiB", description="GiB of KV cache a replica has, all its GPUs together."
    )
    kv_blocks: int | None = Field(
        default=None, description="KV cache blocks (of serving.blockSize tokens) in a replica's pool."
    )
    max_model_len: int | None = Field(
        default=None, description="The longest sequence (prompt and output, in tokens) the engines accept."
    )
    max_num_seqs: int | None = Field(
        default=None,
        description="The most sequences an engine runs at once: those that fit the KV pool at the load's mean "
        "context (prompt and half the output), capped.",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        description="Tokens an engine step processes at most, sized so that a prefill chunk that long takes a "
        "share of the TPOT SLO and leaves room for the step's decodes.",
    )
    predicted_ttft_ms: float | None = Field(
        default=None,
        description="The predicted p95 time to first token, in ms, at the plan's replicas for spec.load "
        "(uncorrected by status.correction).",
    )
    predicted_tpot_ms: float | None = Field(
        default=None,
        description="The predicted p95 time per output token, in ms, at the plan's replicas for spec.load "
        "(uncorrected by status.correction).",
    )
    capacity_rps: float | None = Field(
        default=None, description="The most requests per second one replica serves within the SLO."
    )
    predicted_ready_seconds: float | None = Field(
        default=None,
        description="Seconds from a replica's pod starting to ready, typically: its downloads, the engine's "
        "process, reading the checkpoint and the runtime's warm-up.",
    )
    assumed_draft_acceptance: float | None = Field(
        default=None,
        description="The per-token draft acceptance the predicted TPOT assumes; status.latency.draftAcceptance is "
        "the observed one.",
    )
    assumed_prefix_share: float | None = Field(
        default=None,
        description="The share of prompt tokens the predicted TTFT assumes the prefix cache serves "
        "(spec.load.prefixShare); status.latency.prefixShare is the observed one.",
    )
    replicas: int | None = Field(
        default=None,
        description="The replicas spec.load needs within the SLO, by the plan: the count used while spec.replicas "
        "is unset.",
    )
    meets_slo: bool | None = Field(
        default=None, description="Whether the predicted latencies at those replicas are within spec.slo."
    )
    reasons: dict[str, str] | None = Field(
        default=None,
        description="Each decision (model, gpu, quantization, tensorParallel, kvCache, batching, speculative, "
        "replicas, startup, ...) with why, a line each.",
    )


class KeptCheckpoint(_Status):
    architecture: Architecture | None = Field(
        default=None, description="The model's architecture as read from its config.json."
    )
    quantization: CheckpointQuantization | None = Field(
        default=None, description="The scheme the checkpoint is stored in, as read from its config.json."
    )


class InspectedCheckpoint(KeptCheckpoint):
    source: str = Field(
        max_length=1024,
        description="What the inspection Job read: the model.source (pvc://claim/path), or for a path in the "
        "engine image '<path> in <image>'; read again once either changes.",
    )


class LastGoodPlan(_Status):
    gpu: str | None = Field(default=None, description="The GPU type the plan chose, kept for later plans.")
    gpu_reason: str | None = Field(
        default=None, description="Why that GPU type (the plan's gpu reason), repeated by the later plans that keep it."
    )
    spec: dict[str, Any] | None = Field(
        default=None, description="The spec the plan was made for, without replicas and defaults."
    )
    checkpoint: KeptCheckpoint | None = Field(
        default=None,
        description="The model's config.json as read from the Hub when the plan was made (a model the spec and "
        "the catalog do not describe), so that its Deployment renders again while the Hub is unreachable.",
    )
    draft_checkpoint: KeptCheckpoint | None = Field(
        default=None,
        description="serving.draftModel's config.json as read when the plan was made (a draft that "
        "serving.draftModelArchitecture and the catalog do not describe), kept for the same reason.",
    )


class Latency(_Status):
    ttft_p95_ms: float | None = Field(
        default=None, description="The p95 time to first token, in ms (observed or predicted: see source)."
    )
    tpot_p95_ms: float | None = Field(
        default=None, description="The p95 time per output token, in ms (observed or predicted: see source)."
    )
    draft_acceptance: float | None = Field(
        default=None,
        description="Observed: draft tokens accepted over proposed in the autoscaler's window (speculative decoding).",
    )
    prefix_share: float | None = Field(
        default=None,
        description="Observed: prompt tokens served from the prefix cache over those looked up in the "
        "autoscaler's window.",
    )
    source: Literal["predicted", "observed"] | None = Field(
        default=None,
        description="observed: the engines' p95s over the autoscaler's window; predicted: the plan's, until the "
        "engines report.",
    )


class LatencyWindow(_Status):
    """One latency (TTFT or TPOT) of planAccuracy: predicted, observed and their ratio."""

    predicted_ms: float | None = Field(default=None, description="status.plan's predicted p95.")
    observed_ms: float | None = Field(default=None, description="The engines' p95 over the window.")
    ratio: float | None = Field(default=None, description="observedMs / predictedMs.")
    requests: int | None = Field(default=None, description="Requests in the window behind the observed p95.")
    time: DateTime | None = Field(default=None, description="The end of that window.")


class DraftAcceptanceAccuracy(_Status):
    assumed: float | None = Field(default=None, description="status.plan.assumedDraftAcceptance.")
    observed: float | None = Field(default=None, description="Draft tokens accepted over proposed in the window.")


class PrefixShareAccuracy(_Status):
    assumed: float | None = Field(default=None, description="status.plan.assumedPrefixShare.")
    observed: float | None = Field(
        default=None, description="Prompt tokens served from the prefix cache over those looked up in the window."
    )


class KvBlocksAccuracy(_Status):
    predicted: int | None = Field(
        default=None, description="status.plan.kvBlocks: the KV blocks a replica's pool holds."
    )
    observed: int | None = Field(
        default=None, description="The fewest KV blocks an engine allocated (vllm:cache_config_info's num_gpu_blocks)."
    )
    ratio: float | None = Field(default=None, description="observed / predicted.")


class ReadySecondsAccuracy(_Status):
    predicted: float | None = Field(default=None, description="status.plan.predictedReadySeconds.")
    observed: float | None = Field(
        default=None,
        description="Seconds from the newest ready engine pod's start (status.startTime) to its Ready condition.",
    )
    ratio: float | None = Field(default=None, description="observed / predicted.")
    pod: str | None = Field(default=None, description="The pod observed.")


class VariantAccuracy(_Status):
    """One GPU type of a mixed pool: its own plan's predictions beside its own pods' p95s, and its
    share of the requests beside its share of the pool's planned capacity (shown, not judged)."""

    gpu: str | None = Field(default=None, max_length=63, description="The GPU type (status.variants[].gpu).")
    capacity_class: str | None = Field(
        default=None, max_length=63, description="Its capacity class (status.variants[].capacityClass), if any."
    )
    variant: str | None = Field(
        default=None, max_length=63, description="Its pods' kvpilot.dev/gpu-variant label value."
    )
    ttft: LatencyWindow | None = Field(
        default=None, description="p95 time to first token: its plan's prediction against its pods' p95."
    )
    tpot: LatencyWindow | None = Field(
        default=None, description="p95 time per output token: its plan's prediction against its pods' p95."
    )
    planned_share: float | None = Field(
        default=None,
        description="Its replicas' planned capacity (replicas x capacityRps) over the pool's: the share of the "
        "requests the gateway's capacity weights give it.",
    )
    observed_share: float | None = Field(
        default=None, description="Its pods' share of the requests the pool's engines started in the window."
    )
    requests: int | None = Field(default=None, description="Requests its pods started in the window.")


class PlanAccuracy(_Status):
    window_seconds: float | None = Field(default=None, description="The autoscaler's window, in seconds.")
    band: list[float] | None = Field(
        default=None,
        max_length=2,
        description="The lowest and highest observed/predicted ratio of an accurate plan.",
    )
    ttft: LatencyWindow | None = Field(
        default=None, description="p95 time to first token: predicted against observed, of the last judged window."
    )
    tpot: LatencyWindow | None = Field(
        default=None, description="p95 time per output token: predicted against observed, of the last judged window."
    )
    draft_acceptance: DraftAcceptanceAccuracy | None = Field(
        default=None, description="The draft acceptance the plan assumed beside the observed one (shown, not judged)."
    )
    prefix_share: PrefixShareAccuracy | None = Field(
        default=None, description="The prefix share the plan assumed beside the observed one (shown, not judged)."
    )
    kv_blocks: KvBlocksAccuracy | None = Field(
        default=None, description="The KV blocks the plan predicted beside those the engines allocated."
    )
    ready_seconds: ReadySecondsAccuracy | None = Field(
        default=None, description="The predicted time to ready beside the newest engine pod's."
    )
    variants: list[VariantAccuracy] | None = Field(
        default=None,
        description="A mixed pool: each GPU type's predicted and observed p95s and its share of the traffic. "
        "PlanAccurate judges these ratios, each type's pods against its own plan, not the pool's merged p95s.",
    )
    outside_periods: int | None = Field(
        default=None, description="Periods in a row in which a ratio was outside the band."
    )
    outside_since: DateTime | None = Field(
        default=None, description="When the present run of periods outside the band began."
    )


class GpuCorrection(_Status):
    """One GPU type's factors in a mixed pool's correction."""

    gpu: str | None = Field(default=None, max_length=63, description="The GPU type (status.variants[].gpu).")
    ttft: float | None = Field(
        default=None, description="Its pods' observed / its plan's predicted p95 TTFT (planAccuracy.variants)."
    )
    tpot: float | None = Field(
        default=None, description="Its pods' observed / its plan's predicted p95 TPOT (planAccuracy.variants)."
    )


class Correction(_Status):
    ttft: float | None = Field(
        default=None,
        description="The factor the plan's TTFT is multiplied by when choosing replicas (observed / "
        "predicted p95, smoothed).",
    )
    tpot: float | None = Field(
        default=None,
        description="The factor the plan's TPOT is multiplied by when choosing replicas (observed / "
        "predicted p95, smoothed).",
    )
    acceptance: dict[str, float] | None = Field(
        default=None,
        description="The draft acceptance per token the engines reported, by speculative mode: predictions of "
        "that mode use it, and serving.speculative auto drops a mode it makes no better than off.",
    )
    by_gpu: list[GpuCorrection] | None = Field(
        default=None,
        description="A mixed pool's factors per GPU type, in place of ttft and tpot: each type's plans are "
        "corrected by what its own pods showed of its own plan.",
    )
    window: DateTime | None = Field(default=None, description="The end of the last window it follows.")
    basis: str | None = Field(default=None, description="A digest of the spec fields it was measured under.")


class AuthStatus(_Status):
    api_key_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="The SHA-256 (hex) of the service's API key, which the gateway checks requests' keys against.",
    )
    secret_name: str | None = Field(default=None, description="The Secret (key api-key) the engines read the key from.")


class Decision(_Status):
    time: DateTime | None = Field(default=None, description="When the autoscaler decided.")
    action: Literal["up", "down", "hold"] | None = Field(
        default=None, description="Scale up, scale down, or keep the replicas."
    )
    replicas: int | None = Field(default=None, description="The replicas it decided on.")
    previous: int | None = Field(default=None, description="The replicas before the decision.")
    reason: str | None = Field(default=None, description="Why, with the signals' numbers against their targets.")


class AutoscalerStatus(_Status):
    last_decision: Decision | None = Field(default=None, description="The autoscaler's latest decision.")
    unknown_pods: list[str] | None = Field(
        default=None,
        description="The engine pods whose metrics could not be read or trusted in the latest period (left out "
        "of the signals; the operator's log says why).",
    )
    scaled_to_zero_at: DateTime | None = Field(
        default=None,
        description="When the autoscaler set the present 0 replicas; the gateway wakes only such a zero.",
    )
    state: dict[str, Any] | None = Field(
        default=None,
        description="The state the autoscaler's next period continues from (windows, cool-downs, the learned "
        "request rate), so that a restarted operator carries on; not for people.",
    )


class Condition(_Status):
    """A status condition as Kubernetes writes them (conditions.py); type is its key in the list."""

    type: str = Field(
        description="Planned, Progressing, Ready, Degraded (the reconcile's) or PlanAccurate (the autoscaler's)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str | None = Field(default=None, description="Why, as a CamelCase code.")
    message: str | None = Field(default=None, description="Why, for people, with the numbers.")
    last_transition_time: DateTime | None = Field(default=None, description="When status last changed.")
    observed_generation: Int64 | None = Field(
        default=None, description="The metadata.generation the condition was written for."
    )


class VariantStatus(_Status):
    """One GPU type (on one capacity class of nodes, when it names one) of a mixed pool
    (spec.accelerator.variants): its Deployment, plan and cost."""

    gpu: str | None = Field(default=None, description="The GPU type (spec.accelerator.variants[].type).")
    capacity_class: str | None = Field(
        default=None,
        description="The capacity class its pods run on (spec.accelerator.variants[].capacityClass); unset: any "
        "node of the type.",
    )
    deployment: str | None = Field(
        default=None, description="Its Deployment's name (<service>-<gpu type>[-<capacity class>])."
    )
    replicas: int | None = Field(default=None, description="Its Deployment's desired replicas.")
    ready_replicas: int | None = Field(default=None, description="Its Deployment's ready replicas.")
    max_replicas: int | None = Field(
        default=None, description="The most replicas of this type (its maxReplicas, else autoscaling.maxReplicas)."
    )
    gpu_count: int | None = Field(default=None, description="GPUs per replica.")
    quantization: str | None = Field(default=None, description="The weights' quantization scheme its plan runs.")
    max_num_seqs: int | None = Field(default=None, description="The most sequences one of its engines runs at once.")
    capacity_rps: float | None = Field(
        default=None, description="The most requests per second one replica serves within the SLO."
    )
    predicted_ttft_ms: float | None = Field(
        default=None, description="Predicted p95 time to first token, in ms, for the share of the load it serves."
    )
    predicted_tpot_ms: float | None = Field(
        default=None, description="Predicted p95 time per output token, in ms, for the share of the load it serves."
    )
    price_per_gpu_hour: float | None = Field(default=None, description="US dollars (the operator's GPU prices).")
    cost_per_hour: float | None = Field(default=None, description="At its desired replicas.")
    schedulable_replicas: int | None = Field(
        default=None,
        description="Set while this type's nodes are full: the replicas they held when its next pods stayed "
        "Pending; the rest go to the next type until fullSince is a few minutes old.",
    )
    full_since: DateTime | None = Field(
        default=None, description="When this type's nodes were found full (its pods Pending as Unschedulable)."
    )

    @property
    def key(self) -> str:
        """How the planner's prices and full types name it: L4, L4@spot (names.variant_key)."""
        return variant_key(self.gpu or "", self.capacity_class)

    @property
    def label(self) -> str:
        """Its pods' variant label value (names.VARIANT_LABEL): l4, l4-spot."""
        return variant(self.gpu or "", self.capacity_class)


class AdapterError(_Status):
    """The last failed load of an adapter on a pod (autoscaling/adapter_sync.py)."""

    pod: str | None = Field(default=None, max_length=253, description="The engine pod that refused or failed it.")
    message: str | None = Field(
        default=None,
        max_length=1024,
        description="What the engine answered (its status and message), or why it could not be asked.",
    )
    time: DateTime | None = Field(default=None, description="When that load was tried.")


class AdapterStatus(_Status):
    """One of spec.adapters as the engines hold it (the operator loads and unloads them on every
    ready engine pod, autoscaling/adapter_sync.py)."""

    name: str = Field(max_length=63, description="The adapter's model name (spec.adapters[].name).")
    source: str | None = Field(default=None, max_length=512, description="Its spec.adapters[].source.")
    loaded_on: list[Annotated[str, Field(max_length=253)]] | None = Field(
        default=None,
        max_length=MAX_REPLICAS,
        description="The ready engine pods that hold it from this source; the gateway sends its requests only "
        "to these.",
    )
    pods: int | None = Field(default=None, description="The ready engine pods read: loadedOn of pods.")
    error: AdapterError | None = Field(
        default=None, description="While a pod does not hold it: its last failed load there (retried with backoff)."
    )


class InferenceServiceStatus(_Status):
    observed_generation: Int64 | None = Field(
        default=None, description="The metadata.generation the last reconcile acted on."
    )
    replicas: int | None = Field(
        default=None, description="The engine pods the Deployment has (its status.replicas; the scale subresource's)."
    )
    ready_replicas: int | None = Field(default=None, description="The Deployment's ready engine pods.")
    desired_replicas: int | None = Field(
        default=None,
        description="The replicas the service wants: spec.replicas, else the plan's (a mixed pool: its types' sum; "
        "a spec that does not plan: the running Deployment's).",
    )
    selector: str | None = Field(
        default=None, description="The engine pods' label selector, for the scale subresource (an HPA, KEDA)."
    )
    url: str | None = Field(default=None, description="OpenAI-compatible base URL of the Service inside the cluster.")
    plan: PlanStatus | None = Field(
        default=None,
        description="The plan for the present spec: the device, what the engines run with, the predicted latencies "
        "and replicas, and each decision's reason.",
    )
    variants: list[VariantStatus] | None = Field(
        default=None,
        description="A mixed pool's GPU types (spec.accelerator.variants), cheapest per request per second first.",
    )
    cost_per_hour: float | None = Field(
        default=None,
        description="What the service's desired replicas cost an hour, in US dollars at the operator's GPU prices: "
        "a mixed pool's variants' costPerHour summed; one GPU type's replicas x GPUs per replica x its price. "
        "Unset on CPU.",
    )
    last_good_plan: LastGoodPlan | None = Field(
        default=None,
        description="The last plan that fit, kept while the spec stays the same apart from replicas (a scale does "
        "not re-plan, so a new node type does not roll the service and no GPU on the nodes does not stop a "
        "scale). While the spec does not plan, its Deployment is rendered from this.",
    )
    inspected_checkpoint: InspectedCheckpoint | None = Field(
        default=None,
        description="The architecture of a model on a claim or in the engine image that the spec and the "
        "catalog do not describe, as its inspection Job read it from its config.json (docs/model-sources.md).",
    )
    inspected_draft_checkpoint: InspectedCheckpoint | None = Field(
        default=None,
        description="The same for serving.draftModel on a claim or in the engine image, when "
        "serving.draftModelArchitecture and the catalog do not describe it.",
    )
    latency: Latency | None = Field(
        default=None,
        description="The p95 latencies the engines reported over the autoscaler's window, else the plan's "
        "predicted ones.",
    )
    plan_accuracy: PlanAccuracy | None = Field(
        default=None,
        description="The plan's predicted p95 latencies beside the ones the engines reported over the autoscaler's "
        "window (of at least 20 requests), their ratio, and the draft acceptance and prefix share the plan "
        "assumed beside the observed ones. The PlanAccurate condition goes False when a ratio stays outside the "
        "band for several periods in a row.",
    )
    correction: Correction | None = Field(
        default=None,
        description="While PlanAccurate is False: how much slower (or faster) than predicted the engines run, "
        "observed / predicted p95 smoothed over windows. The plan chooses replicas with its latencies "
        "multiplied by these (its reasons say so); status.plan's predictions stay uncorrected. Dropped when "
        "PlanAccurate is True again or the model, accelerator, serving, runtime or image change.",
    )
    auth: AuthStatus | None = Field(
        default=None,
        description="The service's API key, as the gateway checks it: the SHA-256 (hex) of the key in the "
        "service's API-key Secret. The gateway never reads the Secret; without this field it asks for no key "
        "(the engine still may).",
    )
    autoscaler: AutoscalerStatus | None = Field(
        default=None,
        description="The SLO autoscaler's last decision with its reason, the pods whose metrics could not be read, "
        "and the state its next period continues from.",
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        max_length=MAX_ADAPTERS,
        description="spec.adapters as the ready engine pods hold them: where each is loaded and its last load "
        "error (the operator's autoscaling loop loads and unloads them on running engines every period).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    # A list-type map keyed by type: one condition of each type (the reconcile's Ready, the
    # autoscaler's PlanAccurate).
    conditions: list[Condition] | None = Field(
        default=None,
        description="Planned, Progressing, Ready and Degraded (the reconcile's) and PlanAccurate (the autoscaler's).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )

    def condition(self, type_: str) -> Condition | None:
        """The condition of `type_`, None when the status has none."""
        return next((c for c in self.conditions or () if c.type == type_), None)


def status_of(body: Mapping[str, Any]) -> InferenceServiceStatus:
    """An InferenceService object's status, as types. The API server checks every write against the
    CRD's schema, which is generated from these types; a status that still does not read (written
    under another version of the CRD) reads as empty, as a new service's."""
    try:
        return InferenceServiceStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return InferenceServiceStatus()
