"""The InferenceService spec as pydantic models, mirroring crds/inferenceservice.yaml.

The API server validates and defaults with the CRD's schema and CEL rules; these models repeat the
rules so that planning (and `kvpilot plan`) never sees a spec the cluster would have refused.
tests/operator/api/test_crd.py keeps the two in step (same fields, types, bounds, enums, lengths,
patterns and defaults).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

Quantization = Literal["auto", "none", "int8", "fp8", "w8a8", "int4"]
# eagle: serving.draftModel is an EAGLE head (trained on the target's hidden states), pinned only.
Speculative = Literal["auto", "off", "ngram", "draft", "eagle"]
# What runs the model in the pods (operator/runtimes/ declares what each runs).
Runtime = Literal["kvpilot", "vllm"]
# How a checkpoint may already be quantized (model.quantization): compressed-tensors W8A16, FP8,
# W8A8 and W4A16 (int8, fp8, w8a8, int4), or AutoAWQ / GPTQ 4-bit files.
CheckpointQuantization = Literal["int8", "fp8", "w8a8", "int4", "awq", "gptq"]

# The most replicas a service may ask for (spec.replicas, autoscaling.min/maxReplicas). A bound keeps
# every planner search and every rendered Deployment finite; a fleet beyond it is several services.
MAX_REPLICAS = 1000

# CEL has no bit operations, so the CRD lists the powers of two; this is the same list.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Architecture(BaseModel):
    """Also the CRD's `spec.model.architecture`, hence the camelCase aliases."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="forbid")

    layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    attention_heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    vocab_size: int = Field(gt=0)
    parameters: int = Field(gt=0)
    active_parameters: int | None = Field(default=None, gt=0)
    max_context: int = Field(gt=0)
    # config.json's tie_word_embeddings: the LM head is the embedding (counted once in parameters).
    tie_word_embeddings: bool = False
    source: str = ""

    @model_validator(mode="after")
    def _heads_divide(self) -> Architecture:
        if self.attention_heads % self.kv_heads:
            raise ValueError(f"attentionHeads {self.attention_heads} is not a multiple of kvHeads {self.kv_heads}")
        return self

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.attention_heads

    @property
    def parameters_per_token(self) -> int:
        return self.active_parameters if self.active_parameters is not None else self.parameters


class _Camel(BaseModel):
    # extra="ignore": objects written by a newer CRD version must still plan with this operator.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


# Where a model's files come from (the CRD's CEL rule on model.source has the same expression):
# hf://org/repo[@revision] (downloaded by an init container), pvc://claim[/path], or an absolute path
# in the engine image. Repository names as the hub allows them; a revision is a branch, tag or commit.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[^@ ]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|/.*)$"
)
# A Kubernetes object name that can name a Service (DNS-1035 label) and a namespace (DNS-1123 label).
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# accelerator.type of a CPU node pool, planned from a measured device profile.
CPU_TYPE = "cpu"
HF_SCHEME = "hf://"
PVC_SCHEME = "pvc://"


class HubSource(NamedTuple):
    repo: str
    revision: str


def check_source(field: str, source: str | None) -> None:
    """Raise ValueError naming `field` and the accepted forms unless `source` is unset or one."""
    if source is not None and not re.fullmatch(SOURCE_PATTERN, source):
        raise ValueError(
            f"{field} {source!r} must be hf://org/repo[@revision], pvc://claim/path or an "
            "absolute path in the engine image"
        )


def hub_source(source: str | None) -> HubSource | None:
    """hf://org/repo[@revision] as (repo, revision); None for other sources."""
    if source is None or not source.startswith(HF_SCHEME):
        return None
    repo, _, revision = source.removeprefix(HF_SCHEME).partition("@")
    return HubSource(repo, revision or "main")


class SecretKeyRef(_Camel):
    name: str = Field(min_length=1)
    key: str = Field(default="token", min_length=1)


class ModelCacheSpec(_Camel):
    # A PersistentVolumeClaim to download into, shared by restarts and replicas (ReadWriteMany for
    # replicas on several nodes); unset: an emptyDir, so every new pod downloads again.
    claim_name: str | None = Field(default=None, min_length=1)


class ModelSpec(_Camel):
    name: str = Field(min_length=1)
    # Unset: the engine's --model is `name` (the embedded model's name, say). See SOURCE_PATTERN.
    source: str | None = None
    # For every hf:// source of the service (this one and serving.draftModel): the Secret key holding
    # a hub token (HF_TOKEN of the downloads), for gated or private repositories; and the volume the
    # downloads go to.
    token_secret: SecretKeyRef | None = None
    cache: ModelCacheSpec | None = None
    served_model_name: str | None = None
    architecture: Architecture | None = None
    # The scheme the checkpoint is already quantized in (a compressed-tensors checkpoint, e.g.
    # written by `kvpilot quantize` or llm-compressor; AWQ or GPTQ files): the runtime serves it as
    # stored and refuses another --quantization, so the plan takes it as the scheme. Which of these
    # a runtime reads is in its capabilities (runtimes.py).
    quantization: CheckpointQuantization | None = None

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        check_source("model.source", self.source)
        return self


class AcceleratorSpec(_Camel):
    type: str | None = None
    # GPUs per replica (the tensor-parallel size); unset: the planner picks the smallest that fits
    # and meets the SLO among the runtime's sizes (1 for kvpilot).
    count: int | None = Field(default=None, ge=1)
    # Where the GPU nodes are, when they are not found by the GPU product label (GKE's
    # cloud.google.com/gke-accelerator, Karpenter's instance labels): replaces that selector.
    node_selector: dict[str, str] = Field(default_factory=dict)
    # type cpu: the device profile to plan from (`kvpilot profile`'s output): a built-in CPU family
    # or a profile ConfigMap of that name in the operator's namespace (planning/cpus.py).
    profile: str | None = Field(default=None, max_length=63, pattern=DNS_1123_LABEL)

    @model_validator(mode="after")
    def _selector_needs_type(self) -> AcceleratorSpec:
        if self.node_selector and not self.type:
            raise ValueError("accelerator.nodeSelector needs accelerator.type: the planner sizes for a known GPU")
        cpu = self.type == CPU_TYPE
        if cpu != (self.profile is not None):
            raise ValueError(
                "accelerator.type cpu needs accelerator.profile (the CPU's device profile), and only it takes one"
            )
        if cpu and self.count not in (None, 1):
            raise ValueError("accelerator.count: a CPU replica is one engine process (count 1)")
        return self


class ServingSpec(_Camel):
    max_context_length: int | None = Field(default=None, gt=0)
    quantization: Quantization = "auto"
    speculative: Speculative = "auto"
    # Where the draft model's files are, in the forms of model.source; the engine loads it beside
    # the target (unquantized, its KV cache slot for slot with the target's). Its size comes from the
    # catalog (by the repository or folder name) or from draftModelArchitecture.
    draft_model: str | None = None
    draft_model_architecture: Architecture | None = None
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int = 16

    @model_validator(mode="after")
    def _rules(self) -> ServingSpec:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"blockSize {self.block_size} is not a power of two up to 1024")
        if self.speculative in ("draft", "eagle") and not self.draft_model:
            raise ValueError(f"speculative {self.speculative!r} needs serving.draftModel")
        check_source("serving.draftModel", self.draft_model)
        if self.draft_model_architecture and not self.draft_model:
            raise ValueError("serving.draftModelArchitecture needs serving.draftModel")
        return self


class SLOSpec(_Camel):
    ttft_p95_ms: float = Field(default=2000, gt=0)
    tpot_p95_ms: float = Field(default=100, gt=0)


class LoadSpec(_Camel):
    requests_per_second: float = Field(default=1, ge=0)
    mean_prompt_tokens: int = Field(default=512, gt=0)
    mean_output_tokens: int = Field(default=256, gt=0)
    # The share of a prompt's tokens the engines' prefix cache serves (a system prompt or few-shot
    # examples every request repeats): prefill computes only the rest. The engines report it
    # (prefix cache hits / queries), shown beside this in status.planAccuracy.
    prefix_share: float = Field(default=0, ge=0, le=0.99)
    # The traffic's typical sampling temperature: speculation pays off only at low temperature.
    temperature: float = Field(default=0.7, ge=0)


class AutoscalingSpec(_Camel):
    # slo: the operator sets replicas from the engines' metrics (operator/autoscaling/);
    # external: an HPA or KEDA does and the operator never writes replicas; off: nobody does.
    mode: Literal["slo", "external", "off"] = "slo"
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(default=4, ge=1, le=MAX_REPLICAS)
    scale_up_stabilization_seconds: int = Field(default=0, ge=0)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0)
    # Replicas added or removed by one decision, at most.
    max_step: int = Field(default=2, ge=1)
    # Signals within 1 +- tolerance of their targets move nothing (noise).
    tolerance: float = Field(default=0.1, ge=0, le=0.5)
    max_waiting_per_replica: float = Field(default=4, gt=0)
    target_kv_cache_usage: float = Field(default=0.9, gt=0, le=1)
    # Read the engines' series from this Prometheus (labels namespace and pod, as a ServiceMonitor
    # gives them) instead of each pod's /metrics: for clusters where the operator cannot reach pods.
    prometheus_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://[^\s/]+(/\S*)?$")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        return self


class ResourcesSpec(_Camel):
    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)


class Toleration(_Camel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class RolloutSpec(_Camel):
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    # The most a stopping engine waits for its requests in flight (the drain is sized for the
    # longest request it accepts, which for long contexts can be far longer than anyone waits).
    max_drain_seconds: int = Field(default=600, ge=0, le=3600)


class RoutingSpec(_Camel):
    # How the gateway picks an engine: the least loaded, or the one a hash of the prompt's
    # beginning names (consistent hashing with bounded loads: shared prefixes hit one KV cache).
    strategy: Literal["LeastLoad", "PrefixHash"] = "LeastLoad"


class EndpointPickerSpec(_Camel):
    # A Service in the InferenceService's namespace; unset: `<name>-epp`, the name the extension's
    # inferencepool chart gives its picker when installed under the InferenceService's name.
    name: str | None = Field(default=None, max_length=63, pattern=DNS_1035_LABEL)
    port: int = Field(default=9002, ge=1, le=65535)
    # What the Gateway does while the picker does not answer: refuse the request, or route it anyway.
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class InferencePoolSpec(_Camel):
    # Render an InferencePool (Gateway API Inference Extension) of the engine pods, for a Gateway
    # and an endpoint picker (llm-d's, the extension's) to route to them.
    enabled: bool = False
    endpoint_picker: EndpointPickerSpec = EndpointPickerSpec()


class AuthSpec(_Camel):
    # The operator creates the Secret `<name>-api-key` (key `api-key`) with a random key, the
    # engines require it as `Authorization: Bearer <key>` on /v1, and the gateway checks it before
    # it reads a body or wakes the service. False: open to whoever reaches it.
    api_key: bool = True


class NetworkSpec(_Camel):
    # A NetworkPolicy: the engine port takes connections only from the gateway, the operator
    # (metrics) and pods in the namespaces listed (a Prometheus, clients that skip the gateway).
    policy: bool = True
    allowed_namespaces: list[Annotated[str, Field(max_length=63, pattern=DNS_1123_LABEL)]] = Field(
        default_factory=list, max_length=64
    )


class ImagePullSecret(_Camel):
    name: str


class InferenceServiceSpec(_Camel):
    model: ModelSpec
    runtime: Runtime = "kvpilot"
    accelerator: AcceleratorSpec = AcceleratorSpec()
    serving: ServingSpec = ServingSpec()
    slo: SLOSpec = SLOSpec()
    load: LoadSpec = LoadSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    # Written by `kubectl scale` / the autoscaler through the scale subresource; when absent the
    # plan's replica count for the stated load is used.
    replicas: int | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    # Unset: the operator's default engine image (the chart's engine.image), so a cluster can
    # move every InferenceService that does not pin an image with one chart upgrade.
    image: str | None = Field(default=None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: ResourcesSpec = ResourcesSpec()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    rollout: RolloutSpec = RolloutSpec()
    routing: RoutingSpec = RoutingSpec()
    inference_pool: InferencePoolSpec = InferencePoolSpec()
    auth: AuthSpec = AuthSpec()
    network: NetworkSpec = NetworkSpec()
    # Passed through to the engine pods as written (Kubernetes' own types, validated by the API server).
    env: list[dict[str, Any]] = Field(default_factory=list)
    env_from: list[dict[str, Any]] = Field(default_factory=list)
    image_pull_secrets: list[ImagePullSecret] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list)
    priority_class_name: str | None = None
    pod_labels: dict[str, str] = Field(default_factory=dict)
    pod_annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _replicas_within_the_autoscaler_bounds(self) -> InferenceServiceSpec:
        # In slo mode the autoscaler owns replicas within [min, max]; more is a typo or a scale
        # that the next period would undo. In external and off modes someone else owns them.
        if (
            self.autoscaling.mode == "slo"
            and self.replicas is not None
            and self.replicas > self.autoscaling.max_replicas
        ):
            raise ValueError(
                f"replicas {self.replicas} > autoscaling.maxReplicas {self.autoscaling.max_replicas} "
                "(autoscaling.mode slo)"
            )
        return self

    @model_validator(mode="after")
    def _hub_settings_need_a_hub_source(self) -> InferenceServiceSpec:
        if (self.model.token_secret or self.model.cache) and not any(
            hub_source(s) for s in (self.model.source, self.serving.draft_model)
        ):
            raise ValueError(
                "model.tokenSecret and model.cache apply only to hf:// sources (model.source or serving.draftModel)"
            )
        return self
