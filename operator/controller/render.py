"""The child objects of an InferenceService, as plain manifests (pure functions of spec and plan).

Every child carries an owner reference to the InferenceService, so deleting it garbage-collects
the children, and the same labels, which the Service, the PDB and the scale subresource's
selector all use.
"""

from __future__ import annotations

import base64
import copy
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvpilot.operator.api import names
from kvpilot.operator.api.model_paths import MODEL_CACHE_MOUNT, MODEL_MOUNT, hub_model_dir, source_path
from kvpilot.operator.api.names import (
    ADAPTERS_LOADED_CONDITION,
    API_KEY_ANNOTATION,
    API_KEY_SECRET_KEY,
    APP_NAME_LABEL,
    CONTAINER,
    ENGINE_TYPE,
    ENGINE_TYPE_LABEL,
    GATEWAY_APP,
    NVIDIA_GPU_RESOURCE,
    OPERATOR_APP,
    PORT,
    PORT_NAME,
    VARIANT_LABEL,
    api_key_secret,
    child_metadata,
    labels,
    selector_labels,
)
from kvpilot.operator.api.plan import MixedPlan, Plan, Variant
from kvpilot.operator.api.spec import (
    CPU_TYPE,
    PVC_SCHEME,
    HubSource,
    InferenceServiceSpec,
    hub_source,
)
from kvpilot.operator.controller.inference_pool import inference_pool
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.gpus import find_gpu
from kvpilot.operator.planning.startup import downloaded_bytes
from kvpilot.operator.planning.variants import fill
from kvpilot.operator.runtimes import RUNTIMES
from kvpilot.operator.runtimes.runtime import Launch

Manifest = dict[str, Any]

# The volumes of pvc:// sources: the model's, and the draft model's when it is on another claim.
MODEL_VOLUME = "model"
DRAFT_MODEL_VOLUME = "draft-model"
# pvc:// adapters on claims of their own: adapter-<its index in spec.adapters>.
ADAPTER_VOLUME = "adapter"
# hf:// sources: the volume the download init containers fill and the engine reads.
MODEL_CACHE_VOLUME = "model-cache"
DOWNLOAD_CONTAINER = "download"
DRAFT_DOWNLOAD_CONTAINER = "download-draft"
# One process streaming to disk needs little; these stay below the engine's requests, so the pod's
# scheduling request (the larger of any init container's and the sum of the app containers') is the
# engine's alone.
DOWNLOAD_REQUESTS = {"cpu": "1", "memory": "1Gi"}
# Unprivileged, fixed IDs so that files on a model PVC can be made readable to the engine.
RUN_AS_USER = 1000
# The engine image when neither spec.image nor the operator's configured default names one;
# tests/operator/controller/test_render.py keeps its tag equal to the chart's appVersion.
DEFAULT_ENGINE_IMAGE = "ghcr.io/kvpilot/kvpilot:0.1.0"


def download_args(source: HubSource) -> list[str]:
    """The `kvpilot download` arguments of the init container (engine/tools/download.py)."""
    return [source.repo, "--revision", source.revision, "--local-dir", hub_model_dir(source)]


def container_security() -> Manifest:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def pod_security() -> Manifest:
    """The pod's: a non-root uid of ours (the images' files are readable by it), the runtime's seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


class _ModelFiles(NamedTuple):
    """Where one model source's files are in the engine container, and what puts them there."""

    path: str  # --model or --draft-model
    volumes: list[Manifest]
    mounts: list[Manifest]  # the engine's, read-only
    download: HubSource | None  # an hf:// source, fetched by an init container


def download_disk_bytes(spec: InferenceServiceSpec, plan: Plan) -> tuple[int, int]:
    """(the ephemeral storage to request, the cache emptyDir's sizeLimit) for the hf:// checkpoints
    the pod downloads: their bytes and a margin for tokenizer and config files; the limit leaves
    room for a checkpoint stored at 32 bits, since passing it evicts the pod."""
    needed = int(downloaded_bytes(spec, plan) * 1.1) + DOWNLOAD_MARGIN_BYTES
    return needed, 2 * needed


def _gi(n: int) -> str:
    return f"{math.ceil(n / 1024**3)}Gi"


def _cache_on_pod(spec: InferenceServiceSpec) -> bool:
    """hf:// files go to an emptyDir of the pod (no model.cache claim), so to the node's disk."""
    return spec.model.cache is None or not spec.model.cache.claim_name


def _model_files(spec: InferenceServiceSpec, plan: Plan, source: str, pvc_volume: str) -> _ModelFiles:
    """A source's files: pvc://claim/path mounts the claim read-only (as `pvc_volume`); hf:// mounts
    the cache volume that a download init container fills, read-only as well; a path in the image
    (or the embedded model's name) needs nothing."""
    hub = hub_source(source)
    if hub is not None:
        cache = spec.model.cache
        volume = (
            {"emptyDir": {"sizeLimit": _gi(download_disk_bytes(spec, plan)[1])}}
            if _cache_on_pod(spec)
            else {"persistentVolumeClaim": {"claimName": cache.claim_name}}
        )
        return _ModelFiles(
            source_path(source),
            [{"name": MODEL_CACHE_VOLUME, **volume}],
            [{"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}],
            hub,
        )
    if not source.startswith(PVC_SCHEME):
        return _ModelFiles(source, [], [], None)
    claim = source.removeprefix(PVC_SCHEME).partition("/")[0]
    mount = f"{MODEL_MOUNT}/{claim}"
    volume = {"name": pvc_volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return _ModelFiles(
        source_path(source), [volume], [{"name": pvc_volume, "mountPath": mount, "readOnly": True}], None
    )


def _pod_files(spec: InferenceServiceSpec, plan: Plan) -> tuple[_ModelFiles, _ModelFiles | None, list[_ModelFiles]]:
    """The model's files, the draft model's when the plan runs one, and each adapter's (loaded
    while the engine runs, from where these put them)."""
    model = _model_files(spec, plan, spec.model.source or spec.model.name, MODEL_VOLUME)
    draft = _model_files(spec, plan, plan.draft_model, DRAFT_MODEL_VOLUME) if plan.draft_model else None
    adapters = [_model_files(spec, plan, a.source, f"{ADAPTER_VOLUME}-{i}") for i, a in enumerate(spec.adapters)]
    return model, draft, adapters


def _volumes_and_mounts(
    files: list[_ModelFiles], compiled: _CompileCache | None
) -> tuple[list[Manifest], list[Manifest]]:
    """The sources' volumes and engine mounts, each mount path once: two hf:// sources share the
    cache volume, two pvc:// sources on one claim share the first one's volume; the compile cache
    is a folder of the cache volume."""
    mounts: dict[str, Manifest] = {}
    for mount in [*(m for f in files for m in f.mounts), *([compiled.mount] if compiled else [])]:
        mounts.setdefault(mount["mountPath"], mount)
    used = {m["name"] for m in mounts.values()}
    volumes: dict[str, Manifest] = {}
    for volume in [*(v for f in files for v in f.volumes), *([compiled.volume] if compiled else [])]:
        if volume["name"] in used:
            volumes.setdefault(volume["name"], volume)
    return list(volumes.values()), list(mounts.values())


def _download_container(
    spec: InferenceServiceSpec, source: HubSource, image: str, name: str, guaranteed: bool
) -> Manifest:
    """An init container that downloads an hf:// source into the cache volume before the engine
    starts (it resumes, verifies and skips what is complete: a restarted pod does not download
    again when the cache is a PVC). It gets the pod's env and envFrom (HF_ENDPOINT, proxies), and the
    token Secret as HF_TOKEN. `guaranteed`: limits equal to its requests, for a pod that is
    Guaranteed only when every container, init containers too, is (a CPU replica's pinned CPUs)."""
    env = [{"name": "HOME", "value": "/tmp"}, *spec.env]
    token = spec.model.token_secret
    if token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    container: Manifest = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpilot", "download"],
        "args": download_args(source),
        "env": env,
        "resources": {
            "requests": dict(DOWNLOAD_REQUESTS),
            **({"limits": dict(DOWNLOAD_REQUESTS)} if guaranteed else {}),
        },
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if spec.env_from:
        container["envFrom"] = list(spec.env_from)
    return container


# Seconds the pod keeps serving after it is told to stop, before the engine starts to drain: time
# for the endpoints controller and every kube-proxy or gateway to stop sending it new requests.
PRESTOP_SLEEP_S = 5
# Probe timeout: one Python process serves probes beside the engine thread, so a busy step can hold
# an answer back for a while; Kubernetes' default of 1 s would fail healthy pods under load.
PROBE_TIMEOUT_S = 5
# Where a CPU engine keeps its built C++ kernels (engine/cpu/kernels.py, tens of seconds to
# build) and a compiled decode step its compiled code (engine/cpu/compile_cache.py) without a
# model.cache claim: the pod's writable /tmp emptyDir, so a restarted engine container starts warm
# instead of building again; a new pod builds again.
COMPILE_CACHE_DIR = "/tmp/kvpilot-compiled"
# With a claim: a folder of it, mounted writable on its own (the model files stay read-only), so
# new pods, replicas and rollouts start warm too. Pods and engine versions share it safely: an
# entry is keyed by the torch and Python builds, the CPU's ISA, dtype, quantization and model, is
# published whole by a rename and is checked against its sha256 manifest when read.
COMPILE_CACHE_SUBPATH = "kvpilot-compiled"
COMPILE_CACHE_MOUNT = "/compile-cache"
COMPILE_CACHE_CONTAINER = "compile-cache"
# A mkdir: little, with limits equal to requests (a pod is Guaranteed only when every container,
# init containers too, is).
COMPILE_CACHE_RESOURCES = {"cpu": "50m", "memory": "32Mi"}
# Host memory beside the weights (they are loaded through host memory): tokenizer, Python, CUDA
# context, transfer buffers.
HOST_MEMORY_MARGIN_BYTES = 2 * 1024**3
ENGINE_CPU_REQUEST = "2"
# Beside a download's weights: tokenizer, config and the downloader's partial files.
DOWNLOAD_MARGIN_BYTES = 1024**3
# The startup probe's period; its budget is the plan's (planning/startup.py): how long a healthy
# engine may take to load and warm up.
STARTUP_PERIOD_S = 10
# Tensor parallelism shares tensors between the GPUs' worker processes through /dev/shm, which a
# container's default 64 MiB cannot hold: a memory-backed emptyDir replaces it.
SHM_VOLUME = "dshm"
SHM_SIZE = "16Gi"
# A Deployment reports ProgressDeadlineExceeded after this long without a new ready pod: the
# plan's bounds on the downloads and the engine's start, and a margin, so a healthy long load
# never shows as a failed rollout.
PROGRESS_MARGIN_S = 300


def compile_cache_dir(spec: InferenceServiceSpec) -> str:
    """The engine's --compile-cache-dir: the claim's folder where model.cache has a claim."""
    return COMPILE_CACHE_DIR if _cache_on_pod(spec) else COMPILE_CACHE_MOUNT


class _CompileCache(NamedTuple):
    """The model.cache claim's folder for a CPU engine's kernels and compiled step, and what creates it."""

    volume: Manifest
    mount: Manifest  # the engine's, writable
    init: Manifest


def _compile_cache(spec: InferenceServiceSpec, plan: Plan, image: str) -> _CompileCache | None:
    """The engine mounts the folder alone (a subPath), writable. An init container creates it first
    as the engine's user: a missing subPath is created by the kubelet as root, which the engine can
    write only where the volume applies fsGroup. On a claim whose root that user cannot write (a
    volume filled by hand) the step says so and the pod still starts: the engine warns and builds
    at every start (compile_cache.py). Every CPU engine has one: its C++ kernels are kept there."""
    if plan.gpu != CPU_TYPE or _cache_on_pod(spec):
        return None
    folder = f"{MODEL_CACHE_MOUNT}/{COMPILE_CACHE_SUBPATH}"
    unwritable = 'echo "cannot create $1 on model.cache: the engine builds its CPU kernels at every start" >&2'
    init: Manifest = {
        "name": COMPILE_CACHE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["sh", "-c", f'mkdir -p "$1" || {unwritable}', "sh", folder],
        "resources": {"requests": dict(COMPILE_CACHE_RESOURCES), "limits": dict(COMPILE_CACHE_RESOURCES)},
        "securityContext": container_security(),
        "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT}],
    }
    return _CompileCache(
        {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": spec.model.cache.claim_name}},
        {"name": MODEL_CACHE_VOLUME, "mountPath": COMPILE_CACHE_MOUNT, "subPath": COMPILE_CACHE_SUBPATH},
        init,
    )


def drain_seconds(spec: InferenceServiceSpec, plan: Plan) -> int:
    """How long the engine waits for requests in flight after SIGTERM: long enough for the longest
    request it accepts (its first token, then max_model_len tokens at the predicted TPOT; a mean
    request's time would cut every long stream), at least 10 s, at most rollout.maxDrainSeconds."""
    longest = (plan.predicted_ttft_ms + plan.max_model_len * plan.predicted_tpot_ms) / 1000
    return min(spec.rollout.max_drain_seconds, max(10, math.ceil(longest)))


def engine_args(spec: InferenceServiceSpec, plan: Plan, model: str, draft_model: str | None = None) -> list[str]:
    """The runtime's arguments carrying the plan's numbers; `model` and `draft_model` are where the
    pod holds their files. A plan the runtime would refuse raises here (a ValueError: pydantic's
    ValidationError is one) instead of becoming a pod that exits at start."""
    gpu = find_gpu(str(plan.gpu))
    launch = Launch(
        spec,
        plan,
        model,
        draft_model,
        float16=gpu is not None and not gpu.bf16,
        drain_seconds=drain_seconds(spec, plan),
        compile_cache_dir=compile_cache_dir(spec),
    )
    return RUNTIMES[spec.runtime].args(launch)


def _cpu_resources(spec: InferenceServiceSpec, plan: Plan) -> Manifest:
    """A CPU replica: the CPUs its profile was measured with, as requests and limits both (the
    engine runs a thread per CPU of its quota, and a Guaranteed pod keeps them), and memory for its
    weights, its planned KV pool and the process beside them."""
    memory_gib = math.ceil((plan.weight_bytes + plan.kv_pool_bytes + HOST_MEMORY_MARGIN_BYTES) / 1024**3)
    planned = {"cpu": str(plan.cpus), "memory": f"{memory_gib}Gi"}
    return {
        "requests": {**planned, **{k: str(v) for k, v in spec.resources.requests.items()}},
        "limits": {**planned, **{k: str(v) for k, v in spec.resources.limits.items()}},
    }


def _resources(spec: InferenceServiceSpec, plan: Plan, gpu: Device | None) -> Manifest:
    if gpu is None:
        return _cpu_resources(spec, plan)
    # Extended resources cannot be overcommitted: requests must equal limits.
    gpus = {gpu.resource: str(plan.gpu_count)}
    # The weights (the draft model's too) pass through host memory on their way to the GPU: request
    # room for them, so the scheduler does not place the pod where it would be OOM-killed while loading.
    memory_gib = math.ceil((plan.weight_bytes + HOST_MEMORY_MARGIN_BYTES) / 1024**3)
    defaults = {"cpu": ENGINE_CPU_REQUEST, "memory": f"{memory_gib}Gi"}
    if _downloads(spec, plan) and _cache_on_pod(spec):
        # The emptyDir the downloads fill is the node's disk: schedule where the weights fit.
        defaults["ephemeral-storage"] = _gi(download_disk_bytes(spec, plan)[0])
    requests = {**defaults, **{k: str(v) for k, v in spec.resources.requests.items()}}
    return {
        "requests": {**requests, **gpus},
        "limits": {**{k: str(v) for k, v in spec.resources.limits.items()}, **gpus},
    }


def _downloads_first_to_last(
    spec: InferenceServiceSpec,
    plan: Plan,
    image: str,
    model: _ModelFiles,
    draft: _ModelFiles | None,
    adapters: list[_ModelFiles],
) -> list[Manifest]:
    """One download init container per hf:// source, the model's first, then the draft's and the
    adapters': init containers run one after the other."""
    sources = [(model, DOWNLOAD_CONTAINER), (draft, DRAFT_DOWNLOAD_CONTAINER)]
    sources += [(files, f"{DOWNLOAD_CONTAINER}-{ADAPTER_VOLUME}-{i}") for i, files in enumerate(adapters)]
    return [
        _download_container(spec, files.download, image, container, guaranteed=plan.cpus > 0)
        for files, container in sources
        if files is not None and files.download is not None
    ]


def _downloads(spec: InferenceServiceSpec, plan: Plan) -> bool:
    sources = (spec.model.source, plan.draft_model, *(a.source for a in spec.adapters))
    return any(hub_source(source) for source in sources)


def _startup_failures(plan: Plan) -> int:
    """The startup probe's failures before the kubelet restarts the engine: the plan's bound on a
    healthy start, in probe periods."""
    if plan.startup_budget_s < 1:
        raise ValueError("the plan has no start-up budget (planning.plan sets it): its probe would kill every pod")
    return math.ceil(plan.startup_budget_s / STARTUP_PERIOD_S)


def progress_deadline_seconds(plan: Plan) -> int:
    return STARTUP_PERIOD_S * _startup_failures(plan) + plan.download_budget_s + PROGRESS_MARGIN_S


def _tolerations(spec: InferenceServiceSpec, gpu: Device | None) -> list[Manifest]:
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if gpu is not None and gpu.resource == NVIDIA_GPU_RESOURCE:
        # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule (GKE, the GPU operator's
        # examples) to keep CPU-only pods off them; the engine belongs there.
        tolerations.append({"key": NVIDIA_GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _gpu_node_selector(spec: InferenceServiceSpec, gpu: Device | None) -> dict[str, str]:
    """The spec's own accelerator node selector, else the product label when the GPU has one
    product string (several need node affinity: see _affinity); a CPU plan has no label of its own."""
    if spec.accelerator.node_selector or gpu is None:
        return dict(spec.accelerator.node_selector)
    return {gpu.product_label: gpu.product} if len(gpu.products) == 1 else {}


def _affinity(spec: InferenceServiceSpec, gpu: Device | None) -> Manifest | None:
    """The spec's affinity, with the GPU's product strings required in every node selector term
    (terms are alternatives: the requirement must hold in each)."""
    if spec.accelerator.node_selector or gpu is None or len(gpu.products) == 1:
        return spec.affinity
    requirement = {"key": gpu.product_label, "operator": "In", "values": list(gpu.products)}
    affinity = copy.deepcopy(spec.affinity or {})
    required = affinity.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*term.get("matchExpressions", []), requirement]} for term in terms
    ]
    return affinity


def operator_api_key(spec: InferenceServiceSpec) -> bool:
    """The operator makes and hands out the service's API key: auth.apiKey, unless the spec's env
    already gives the engine a key of the user's own (which the gateway then does not check)."""
    key_env = RUNTIMES[spec.runtime].api_key_env
    return spec.auth.api_key and not any(e.get("name") == key_env for e in spec.env)


def _api_key_env(name: str, spec: InferenceServiceSpec) -> list[Manifest]:
    if not operator_api_key(spec):
        return []
    ref = {"secretKeyRef": {"name": api_key_secret(name), "key": API_KEY_SECRET_KEY}}
    return [{"name": RUNTIMES[spec.runtime].api_key_env, "valueFrom": ref}]


def _engine_container(
    name: str,
    spec: InferenceServiceSpec,
    plan: Plan,
    gpu: Device | None,
    image: str,
    model: _ModelFiles,
    draft: _ModelFiles | None,
    mounts: list[Manifest],
) -> Manifest:
    """The engine container: the runtime serving the plan's arguments, probes and resources."""
    http = {"port": PORT_NAME}
    runtime = RUNTIMES[spec.runtime]
    fixed = (*runtime.env, *(runtime.lora_env if plan.lora else ()))
    ready, env = runtime.ready_path, [{"name": name, "value": value} for name, value in fixed]
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(runtime.command),
        "args": engine_args(spec, plan, model.path, draft.path if draft else None),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        # Loading weights can take minutes: the startup probe waits for the model, and holds the
        # liveness probe off until then.
        "startupProbe": {
            "httpGet": {"path": ready, **http},
            "periodSeconds": STARTUP_PERIOD_S,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": _startup_failures(plan),
        },
        "readinessProbe": {
            "httpGet": {"path": ready, **http},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", **http},
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT_S,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "resources": _resources(spec, plan, gpu),
        # Caches that libraries write (Hugging Face, Triton, torch) go to the writable /tmp.
        "env": [{"name": "HOME", "value": "/tmp"}, *env, *_api_key_env(name, spec), *spec.env],
        "securityContext": container_security(),
        "volumeMounts": [
            *mounts,
            {"name": "tmp", "mountPath": "/tmp"},
            *([{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if plan.gpu_count > 1 else []),
        ],
    }
    if spec.env_from:
        container["envFrom"] = list(spec.env_from)
    return container


def _pod_metadata(name: str, spec: InferenceServiceSpec, api_key_sha256: str | None) -> Manifest:
    return {
        # Ours last: the selector depends on them. The engine type before the spec's: a user may
        # name another for their endpoint picker.
        "labels": {ENGINE_TYPE_LABEL: ENGINE_TYPE, **spec.pod_labels, **labels(name)},
        "annotations": {
            **spec.pod_annotations,
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(PORT),
            "prometheus.io/path": "/metrics",
            # A new key in the Secret rolls the pods: the engines read it when they start.
            **({API_KEY_ANNOTATION: api_key_sha256} if api_key_sha256 and operator_api_key(spec) else {}),
        },
    }


def engine_image(spec: InferenceServiceSpec, default_image: str) -> str:
    """The engine container's image: the spec's, else its runtime's (vLLM's official), else the
    operator's default."""
    return spec.image or RUNTIMES[spec.runtime].image or default_image


def _pod_template(
    name: str,
    spec: InferenceServiceSpec,
    plan: Plan,
    gpu: Device | None,
    default_image: str,
    api_key_sha256: str | None,
) -> Manifest:
    """The engine pod: init containers (the compile cache's folder; the downloads, `kvpilot download`
    in the engine's image or, where the runtime's lacks it, the operator's), the engine, volumes."""
    image = engine_image(spec, default_image)
    downloader = image if RUNTIMES[spec.runtime].ships_downloader else default_image
    model, draft, adapters = _pod_files(spec, plan)
    compiled = _compile_cache(spec, plan, image)
    volumes, mounts = _volumes_and_mounts([model, *([draft] if draft else []), *adapters], compiled)
    init = [
        *([compiled.init] if compiled else []),
        *_downloads_first_to_last(spec, plan, downloader, model, draft, adapters),
    ]
    pod: Manifest = {
        "metadata": _pod_metadata(name, spec, api_key_sha256),
        "spec": {
            # The engine never talks to the API server: no token of the namespace's default account.
            "automountServiceAccountToken": False,
            "securityContext": pod_security(),
            **({"initContainers": init} if init else {}),
            "containers": [_engine_container(name, spec, plan, gpu, image, model, draft, mounts)],
            "volumes": [
                *volumes,
                {"name": "tmp", "emptyDir": {}},
                *(
                    [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
                    if plan.gpu_count > 1
                    else []
                ),
            ],
            # preStop pause + the engine's drain + a margin for the process to exit.
            "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + drain_seconds(spec, plan) + 5,
            "nodeSelector": {**spec.node_selector, **_gpu_node_selector(spec, gpu)},
            "tolerations": _tolerations(spec, gpu),
        },
    }
    optional = {
        "imagePullSecrets": [s.model_dump() for s in spec.image_pull_secrets],
        "affinity": _affinity(spec, gpu),
        "topologySpreadConstraints": spec.topology_spread_constraints,
        "priorityClassName": spec.priority_class_name,
        # Out of the Service until the adapter sync has loaded the adapters (api/names.py).
        "readinessGates": [{"conditionType": ADAPTERS_LOADED_CONDITION}] if spec.adapters else [],
    }
    pod["spec"].update({key: value for key, value in optional.items() if value})
    return pod


def deployment(
    name: str,
    namespace: str,
    uid: str,
    spec: InferenceServiceSpec,
    plan: Plan,
    *,
    default_image: str = DEFAULT_ENGINE_IMAGE,
    api_key_sha256: str | None = None,
    variant: tuple[Variant, int] | None = None,
) -> Manifest:
    """The engines' Deployment; `default_image` is the operator's image for specs without one,
    `api_key_sha256` the digest of the key in the service's API-key Secret; `variant`: (the mixed
    pool's variant, its replicas) for one Deployment of a mixed pool's."""
    gpu = find_gpu(str(plan.gpu))
    if not plan.fits or (gpu is None and plan.gpu != CPU_TYPE):
        raise ValueError(f"no Deployment for a plan that does not fit: {plan.reason}")
    replicas = spec.replicas if spec.replicas is not None else plan.replicas
    selector, template = selector_labels(name), _pod_template(name, spec, plan, gpu, default_image, api_key_sha256)
    metadata = child_metadata(name, namespace, uid)
    if variant is not None:
        metadata, selector, replicas = _as_variant(name, metadata, selector, template, *variant)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "progressDeadlineSeconds": progress_deadline_seconds(plan),
            # spec.rollout's default surges one pod so a single replica keeps serving (see the CRD).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable},
            },
            "template": template,
        },
    }


def _as_variant(
    name: str, metadata: Manifest, selector: dict[str, str], template: Manifest, variant: Variant, replicas: int
) -> tuple[Manifest, dict[str, str], int]:
    """One mixed-pool variant's Deployment metadata, selector and replicas; its pod `template` gets
    the variant's label and its capacity class's node labels (beside the GPU's own selector, which
    they narrow: the class's labels win where both name a key, as the admin said where the class is)."""
    label = variant.label
    template["metadata"]["labels"][VARIANT_LABEL] = label
    if variant.node_selector:
        template["spec"]["nodeSelector"] = {**template["spec"].get("nodeSelector", {}), **variant.node_selector}
    # Its own name, its owner's reference: the garbage collector deletes a child whose reference
    # names no object of that uid (it did, over and over, once it rechecked owners).
    metadata = {
        **metadata,
        "name": names.variant_deployment(name, variant.gpu, variant.capacity_class),
        "labels": {**metadata["labels"], VARIANT_LABEL: label},
    }
    return metadata, {**selector, VARIANT_LABEL: label}, replicas


def service(name: str, namespace: str, uid: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(name: str, namespace: str, uid: str) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(name, namespace, uid),
        # maxUnavailable, not minAvailable: a single-replica service must not block node drains;
        # and a pod that is not ready (crash-looping, still loading) serves nothing, so evicting it
        # never counts against the budget.
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def api_key_secret_manifest(name: str, namespace: str, uid: str, key: str) -> Manifest:
    """The service's API-key Secret, created once with a new random `key`: afterwards the key is
    the Secret's (an admin may rotate it), never rendered again."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**child_metadata(name, namespace, uid), "name": api_key_secret(name)},
        "type": "Opaque",
        "data": {API_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


# The namespace label the API server sets on every namespace to its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def network_policy(
    name: str, namespace: str, uid: str, spec: InferenceServiceSpec, operator_namespace: str | None
) -> Manifest:
    """Who may open a connection to the engine port: the chart's gateway and operator pods (in the
    operator's namespace; any namespace when it is not known), pods in the namespaces the spec
    allows, and with `network.policy: false` everyone (the policy stays, so turning it off needs
    no delete). Kubelet probes are the node's own traffic, which policies do not stop."""
    system: Manifest = {
        "podSelector": {
            "matchExpressions": [{"key": APP_NAME_LABEL, "operator": "In", "values": [GATEWAY_APP, OPERATOR_APP]}]
        },
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}} if operator_namespace else {},
    }
    allowed = sorted(set(spec.network.allowed_namespaces))
    peers = [system] + (
        [
            {
                "namespaceSelector": {
                    "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": allowed}]
                }
            }
        ]
        if allowed
        else []
    )
    rule: Manifest = {"from": peers, "ports": [{"port": PORT, "protocol": "TCP"}]} if spec.network.policy else {}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"], "ingress": [rule]},
    }


def children(
    name: str,
    namespace: str,
    uid: str,
    spec: InferenceServiceSpec,
    plan: Plan,
    *,
    default_image: str = DEFAULT_ENGINE_IMAGE,
    api_key_sha256: str | None = None,
    operator_namespace: str | None = None,
    mixed: MixedPlan | None = None,
    room: Mapping[str, int] | None = None,
) -> list[Manifest]:
    """What should exist: no Deployment when the plan does not fit, a Deployment per variant (GPU
    type, or type and capacity class) of a mixed pool (`mixed`, whose variants share the service's
    replicas cheapest first, each within the `room` its nodes were found to have, by Variant.key); the
    InferencePool when the spec asks for one. The API-key Secret is not among them: its key is made
    once (reconcile)."""
    objects = [
        service(name, namespace, uid),
        pod_disruption_budget(name, namespace, uid),
        network_policy(name, namespace, uid, spec, operator_namespace),
    ]
    if spec.inference_pool.enabled:
        objects.append(inference_pool(name, namespace, uid, spec.inference_pool.endpoint_picker))
    if mixed is not None and mixed.fits:
        total = spec.replicas if spec.replicas is not None else mixed.replicas
        objects[:0] = [
            deployment(
                name,
                namespace,
                uid,
                spec,
                v.plan,
                default_image=default_image,
                api_key_sha256=api_key_sha256,
                variant=(v, replicas),
            )
            for v, replicas in zip(mixed.variants, fill(mixed, total, room), strict=True)
        ]
    elif plan.fits:
        objects.insert(
            0,
            deployment(name, namespace, uid, spec, plan, default_image=default_image, api_key_sha256=api_key_sha256),
        )
    return objects
