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

from kvpilot.operator.api.spec import INT64, Architecture, CheckpointQuantization

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

    fits: bool | None = None
    reason: str | None = None
    runtime: str | None = None
    gpu: str | None = None
    gpu_count: int | None = Field(default=None, description="GPUs per replica: the tensor-parallel size.")
    device_profile: str | None = Field(default=None, description="A CPU plan's device profile (accelerator.profile).")
    cpus: int | None = Field(
        default=None, description="CPUs a CPU plan's replica requests: the threads its profile was measured with."
    )
    compile_decode: bool | None = Field(
        default=None,
        description="The engine compiles a lone sequence's decode step (CPU plans whose TPOT needs it).",
    )
    quantization: str | None = None
    speculative: str | None = None
    weights_gib: float | None = Field(default=None, alias="weightsGiB")
    kv_bytes_per_token: int | None = None
    kv_cache_dtype: str | None = Field(default=None, description="The KV cache's values: model (16-bit) or fp8.")
    kv_pool_gib: float | None = Field(default=None, alias="kvPoolGiB")
    kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
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
    replicas: int | None = None
    meets_slo: bool | None = None
    reasons: dict[str, str] | None = None


class KeptCheckpoint(_Status):
    architecture: Architecture | None = None
    quantization: CheckpointQuantization | None = None


class LastGoodPlan(_Status):
    gpu: str | None = None
    gpu_reason: str | None = None
    spec: dict[str, Any] | None = Field(
        default=None, description="The spec the plan was made for, without replicas and defaults."
    )
    checkpoint: KeptCheckpoint | None = Field(
        default=None,
        description="The model's config.json as read from the Hub when the plan was made (a model the spec and "
        "the catalog do not describe), so that its Deployment renders again while the Hub is unreachable.",
    )


class Latency(_Status):
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    draft_acceptance: float | None = Field(
        default=None,
        description="Observed: draft tokens accepted over proposed in the autoscaler's window (speculative decoding).",
    )
    prefix_share: float | None = Field(
        default=None,
        description="Observed: prompt tokens served from the prefix cache over those looked up in the "
        "autoscaler's window.",
    )
    source: Literal["predicted", "observed"] | None = None


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


class PlanAccuracy(_Status):
    window_seconds: float | None = None
    band: list[float] | None = Field(
        default=None,
        max_length=2,
        description="The lowest and highest observed/predicted ratio of an accurate plan.",
    )
    ttft: LatencyWindow | None = None
    tpot: LatencyWindow | None = None
    draft_acceptance: DraftAcceptanceAccuracy | None = None
    prefix_share: PrefixShareAccuracy | None = None
    kv_blocks: KvBlocksAccuracy | None = None
    ready_seconds: ReadySecondsAccuracy | None = None
    outside_periods: int | None = Field(
        default=None, description="Periods in a row in which a ratio was outside the band."
    )
    outside_since: DateTime | None = None


class Correction(_Status):
    ttft: float | None = None
    tpot: float | None = None
    acceptance: dict[str, float] | None = Field(
        default=None,
        description="The draft acceptance per token the engines reported, by speculative mode: predictions of "
        "that mode use it, and serving.speculative auto drops a mode it makes no better than off.",
    )
    window: DateTime | None = Field(default=None, description="The end of the last window it follows.")
    basis: str | None = Field(default=None, description="A digest of the spec fields it was measured under.")


class AuthStatus(_Status):
    api_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    secret_name: str | None = Field(default=None, description="The Secret (key api-key) the engines read the key from.")


class Decision(_Status):
    time: DateTime | None = None
    action: Literal["up", "down", "hold"] | None = None
    replicas: int | None = None
    previous: int | None = None
    reason: str | None = None


class AutoscalerStatus(_Status):
    last_decision: Decision | None = None
    unknown_pods: list[str] | None = None
    scaled_to_zero_at: DateTime | None = Field(
        default=None,
        description="When the autoscaler set the present 0 replicas; the gateway wakes only such a zero.",
    )
    state: dict[str, Any] | None = None


class Condition(_Status):
    """A status condition as Kubernetes writes them (conditions.py); type is its key in the list."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: DateTime | None = None
    observed_generation: Int64 | None = None


class VariantStatus(_Status):
    """One GPU type of a mixed pool (spec.accelerator.variants): its Deployment, plan and cost."""

    gpu: str | None = None
    deployment: str | None = None
    replicas: int | None = Field(default=None, description="Its Deployment's desired replicas.")
    ready_replicas: int | None = None
    max_replicas: int | None = None
    gpu_count: int | None = Field(default=None, description="GPUs per replica.")
    quantization: str | None = None
    max_num_seqs: int | None = None
    capacity_rps: float | None = Field(
        default=None, description="The most requests per second one replica serves within the SLO."
    )
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    price_per_gpu_hour: float | None = Field(default=None, description="US dollars (the operator's GPU prices).")
    cost_per_hour: float | None = Field(default=None, description="At its desired replicas.")
    schedulable_replicas: int | None = Field(
        default=None,
        description="Set while this type's nodes are full: the replicas they held when its next pods stayed "
        "Pending; the rest go to the next type until fullSince is a few minutes old.",
    )
    full_since: DateTime | None = None


class InferenceServiceStatus(_Status):
    observed_generation: Int64 | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    desired_replicas: int | None = None
    selector: str | None = None
    url: str | None = Field(default=None, description="OpenAI-compatible base URL of the Service inside the cluster.")
    plan: PlanStatus | None = None
    variants: list[VariantStatus] | None = Field(
        default=None,
        description="A mixed pool's GPU types (spec.accelerator.variants), cheapest per request per second first.",
    )
    last_good_plan: LastGoodPlan | None = Field(
        default=None,
        description="The last plan that fit, kept while the spec stays the same apart from replicas (a scale does "
        "not re-plan, so a new node type does not roll the service and no GPU on the nodes does not stop a "
        "scale). While the spec does not plan, its Deployment is rendered from this.",
    )
    latency: Latency | None = None
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
    # A list-type map keyed by type: one condition of each type (the reconcile's Ready, the
    # autoscaler's PlanAccurate).
    conditions: list[Condition] | None = Field(
        default=None,
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
