"""`kvpilot plan`, `kvpilot render`, `kvpilot crd`, `kvpilot operator`, `kvpilot gateway` and
`kvpilot inspect-checkpoint`, registered into the engine's `kvpilot` command."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import random
import re
import sys
import urllib.parse
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, get_args

import kopf
import yaml
from kubernetes.config.config_exception import ConfigException
from pydantic import ValidationError

from kvpilot.engine.contract.device_profile import DeviceProfile, load_device_profile
from kvpilot.operator.api import names
from kvpilot.operator.api.crd import crd_yaml
from kvpilot.operator.api.inspection import TERMINATION_MESSAGE_LIMIT, TERMINATION_MESSAGE_PATH, UNSUPPORTED
from kvpilot.operator.api.plan import MixedPlan, Plan
from kvpilot.operator.api.spec import (
    CPU_TYPE,
    DNS_1123_LABEL,
    MAX_CLASS_NAME,
    InferenceServiceSpec,
    KvCacheDtype,
    Quantization,
    Runtime,
    Speculative,
    hub_source,
)
from kvpilot.operator.autoscaling.decisions import INTERVAL_SECONDS, WINDOW_PERIODS
from kvpilot.operator.autoscaling.gateways import GatewayPods
from kvpilot.operator.autoscaling.loop import prometheus_allowed
from kvpilot.operator.controller import render
from kvpilot.operator.controller.checkpoint import (
    Unreadable,
    as_draft,
    draft_to_read,
    inspect_folder,
    model_to_read,
    read_checkpoint,
    read_local,
    with_checkpoint,
)
from kvpilot.operator.gateway import main as gateway_main
from kvpilot.operator.gateway.limits import Limits
from kvpilot.operator.hub.client import DEFAULT_ENDPOINT, HubClient
from kvpilot.operator.kube.cluster import KubeCluster
from kvpilot.operator.planning import cpus, sizing
from kvpilot.operator.planning.gpus import GPUS, find_gpu
from kvpilot.operator.planning.model_config import ModelConfig
from kvpilot.operator.planning.plan import PlanContext, plan
from kvpilot.operator.planning.reasons import failed_plan
from kvpilot.operator.planning.sources import MODEL_SOURCE_REQUIRED, missing_source, with_model_source
from kvpilot.operator.planning.variants import VariantRequest, as_one_plan, plan_variants, requested

PEERING_NAME = "kvpilot"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # One piece: the commands' flags, one declaration each, read as the help reads.
    planner = subparsers.add_parser(
        "plan",
        help="size a model on a GPU (or a manifest): KV cache, batch limits, quantization, tensor parallelism, latency",
    )
    source = planner.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="catalog model, e.g. llama-2-7b, or hf://org/repo[@revision], whose config.json is read from the Hub "
        "(HF_ENDPOINT, HF_TOKEN) as the operator reads it",
    )
    source.add_argument(
        "-f", "--filename", type=argparse.FileType(), help="plan an InferenceService manifest as the operator would"
    )
    source.add_argument(
        "--model-config",
        metavar="CONFIG_JSON_OR_DIR",
        help="plan a model from its Hugging Face config.json (a file, or a checkpoint folder holding one), offline",
    )
    planner.add_argument(
        "--gpu",
        type=_gpu_types,
        metavar="TYPE[@CLASS][:MAX],...",
        help=f"one of {', '.join(GPUS)} (with --model or --model-config; or --device-profile); several, "
        "comma-separated, plan a mixed pool: a variant per type, each with at most MAX replicas (default "
        "--max-replicas), sharing the load cheapest per req/s first; TYPE@CLASS: the type on a --capacity-class's "
        "nodes (L4@spot,L4@on-demand: one type as two variants, each at its own price)",
    )
    _pool_arguments(planner, "for a mixed pool")
    planner.add_argument(
        "--device-profile",
        metavar="FILE_OR_NAME",
        help="plan for a CPU: a `kvpilot profile` output file, or a built-in profile "
        f"({', '.join(cpus.builtin_profiles())})",
    )
    planner.add_argument("--runtime", choices=get_args(Runtime), help="kvpilot (default) or vllm")
    planner.add_argument("--gpus", type=int, help="GPUs per replica (tensor-parallel size; default: the planner's)")
    planner.add_argument("--context", type=int, help="max context length (default: the model's)")
    planner.add_argument("--quantization", default="auto", choices=get_args(Quantization))
    planner.add_argument("--kv-cache-dtype", default="auto", choices=get_args(KvCacheDtype))
    planner.add_argument("--speculative", default="auto", choices=get_args(Speculative))
    planner.add_argument("--num-speculative-tokens", type=int, help="draft tokens per step (default: 4)")
    planner.add_argument(
        "--draft-model",
        metavar="SOURCE",
        help="serving.draftModel: hf://org/repo[@revision] (its config.json read from the Hub unless the catalog "
        "has it), pvc://claim/path or an absolute path",
    )
    planner.add_argument(
        "--draft-model-config",
        metavar="CONFIG_JSON_OR_DIR",
        help="plan the draft model from its config.json (a file, or a checkpoint folder holding one), offline; "
        "its source is --draft-model, else the folder",
    )
    planner.add_argument("--gpu-memory-utilization", type=float)
    planner.add_argument("--block-size", type=int)
    planner.add_argument("--rps", type=float, help="expected requests per second")
    planner.add_argument("--prompt-tokens", type=int, help="mean prompt tokens")
    planner.add_argument("--output-tokens", type=int, help="mean output tokens")
    planner.add_argument("--temperature", type=float, help="typical sampling temperature")
    planner.add_argument("--ttft-ms", type=float, help="TTFT p95 SLO")
    planner.add_argument("--tpot-ms", type=float, help="TPOT p95 SLO")
    planner.add_argument("--min-replicas", type=int)
    planner.add_argument("--max-replicas", type=int)
    planner.add_argument("--json", action="store_true", help="print the plan as JSON, with the runtime's argv as args")
    planner.set_defaults(func=run_plan)

    renderer = subparsers.add_parser(
        "render", help="print the objects the operator would apply for an InferenceService manifest (as helm template)"
    )
    renderer.add_argument("-f", "--filename", type=argparse.FileType(), required=True, help="InferenceService manifest")
    renderer.add_argument(
        "--engine-image",
        default=render.DEFAULT_ENGINE_IMAGE,
        help="the operator's engine image (the chart's engine.image)",
    )
    _pool_arguments(renderer, "as the operator's (the chart's gpuPrices and capacityClasses)")
    renderer.set_defaults(func=run_render)

    crd = subparsers.add_parser(
        "crd", help="print the InferenceService CRD (crds/inferenceservice.yaml), generated from the pydantic types"
    )
    crd.set_defaults(func=run_crd)

    operator = subparsers.add_parser("operator", help="run the InferenceService operator (kopf)")
    scope = operator.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n", "--namespace", action="append", dest="namespaces", help="watch this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true")
    operator.add_argument(
        "--peering", default=PEERING_NAME, help="kopf peering object shared by the operator's replicas"
    )
    operator.add_argument("--priority", type=int, help="peering priority (default: random, see below)")
    operator.add_argument(
        "--standalone", action="store_true", help="no peering: only for a single replica or local development"
    )
    operator.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    operator.add_argument(
        "--metrics",
        type=_address,
        metavar="HOST:PORT",
        help="serve the operator's own Prometheus /metrics there (per InferenceService: predicted, SLO and "
        "observed latencies, replicas, autoscaler decisions), e.g. 0.0.0.0:8081; by default none",
    )
    operator.add_argument(
        "--autoscale-interval",
        type=float,
        default=INTERVAL_SECONDS,
        metavar="SECONDS",
        help="how often the SLO autoscaler reads the engines (its window is "
        f"{WINDOW_PERIODS} periods; default %(default)s)",
    )
    operator.add_argument(
        "--prometheus-url-allow",
        action="append",
        default=[],
        type=_url_prefix,
        metavar="PREFIX",
        help="read an InferenceService's autoscaling.prometheusUrl only when it lies under this "
        "URL prefix (same scheme, host and port; the prefix's path segments first); "
        "repeatable; by default no prometheusUrl is read",
    )
    operator.add_argument(
        "--gateway-pods",
        type=_gateway_pods,
        metavar="NAMESPACE:SELECTOR",
        help="the gateway's pods (e.g. kvpilot-system:app.kubernetes.io/name=kvpilot-gateway): the autoscaler "
        "reads what they hold for each service as waiting work; by default no gateway is read",
    )
    _pool_arguments(
        operator, "in this cluster, which rank a mixed pool's variants (the chart's gpuPrices and capacityClasses)"
    )
    operator.add_argument("-v", "--verbose", action="store_true")
    operator.set_defaults(func=run_operator)
    register_gateway(subparsers)
    register_inspect(subparsers)


def register_inspect(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    inspect = subparsers.add_parser(
        "inspect-checkpoint",
        help="print a checkpoint folder's architecture as the planner reads it (the operator's inspection Job of "
        "a pvc:// model)",
    )
    inspect.add_argument("folder", type=Path, help="the checkpoint's folder, holding config.json")
    inspect.add_argument(
        "--termination-log",
        type=Path,
        default=Path(TERMINATION_MESSAGE_PATH),
        help="where the result (or the refusal) is written too, for the operator to read (default %(default)s; "
        "skipped where it cannot be written)",
    )
    inspect.set_defaults(func=run_inspect_checkpoint)


# Seconds a stopping gateway lets its streams run (the chart's grace period covers it).
DRAIN_SECONDS = 600.0


def register_gateway(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gateway = subparsers.add_parser(
        "gateway",
        help="run the OpenAI-compatible gateway: /namespaces/<namespace>/v1/... routes by the body's model "
        "within that namespace, holds requests while a service the autoscaler scaled to zero wakes",
    )
    gateway.add_argument("--listen", type=_address, default=("0.0.0.0", 8000), metavar="HOST:PORT")
    gateway.add_argument(
        "--drain-seconds",
        type=float,
        default=DRAIN_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM, how long streams in flight may finish (default %(default)s)",
    )
    # One flag per bound (gateway/limits.py), named after it, its default the model's.
    for name, field in Limits.model_fields.items():
        gateway.add_argument(
            f"--{name.replace('_', '-')}",
            type=field.annotation,
            default=field.default,
            dest=name,
            help="(default %(default)s)",
        )
    gateway.add_argument("-v", "--verbose", action="store_true")
    gateway.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        limits = Limits.model_validate({name: getattr(args, name) for name in Limits.model_fields})
    except ValidationError as error:
        print(f"kvpilot gateway: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(gateway_main.run(*args.listen, limits, args.drain_seconds))
    except ConfigException as error:
        print(f"kvpilot gateway: no credentials for the Kubernetes API: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the address is taken, or not this machine's
        print(f"kvpilot gateway: cannot listen on {args.listen[0]}:{args.listen[1]}: {error}", file=sys.stderr)
        return 2
    return 0


def _pool_arguments(parser: argparse.ArgumentParser, purpose: str) -> None:
    """--gpu-price and --capacity-class: a mixed pool's prices and node classes, the same flags for
    `kvpilot operator` (the chart renders them) as for `plan` and `render` (which plan as it would)."""
    parser.add_argument(
        "--gpu-price",
        type=_gpu_price,
        action="append",
        default=[],
        metavar="TYPE[@CLASS]=USD",
        help=f"what one GPU-hour of TYPE costs {purpose}; TYPE@CLASS: on that capacity class's nodes (default: "
        "the type's price, else an approximate on-demand list price)",
    )
    parser.add_argument(
        "--capacity-class",
        type=_capacity_class,
        action="append",
        default=[],
        metavar="CLASS=LABEL=VALUE[,LABEL=VALUE]",
        help="a class of nodes a mixed pool's variant may name (accelerator.variants[].capacityClass), by the node "
        "labels its pods then select, e.g. spot=karpenter.sh/capacity-type=spot; repeatable",
    )


def pool_settings(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """The prices and capacity classes of --gpu-price and --capacity-class; ValueError when a
    price names a class no --capacity-class declares (a typo would price nothing, silently)."""
    classes = dict(args.capacity_class)
    prices = dict(args.gpu_price)
    undeclared = sorted({key for key in prices if key.partition(names.CLASS_SEPARATOR)[2] not in ("", *classes)})
    if undeclared:
        known = ", ".join(sorted(classes)) or "none"
        raise ValueError(f"--gpu-price {', '.join(undeclared)}: no such --capacity-class (declared: {known})")
    return prices, classes


def _class_name(value: str, name: str) -> str:
    if not re.fullmatch(DNS_1123_LABEL, name) or len(name) > MAX_CLASS_NAME:
        raise argparse.ArgumentTypeError(
            f"{value!r}: the capacity class {name!r} is not a DNS-1123 label of at most {MAX_CLASS_NAME} characters"
        )
    return name


def _gpu_types(value: str) -> list[VariantRequest]:
    """--gpu: TYPE[@CLASS][:MAX] items, comma-separated."""
    wanted = []
    for item in value.split(","):
        named, _, most = item.strip().partition(":")
        gpu, at, capacity_class = named.partition(names.CLASS_SEPARATOR)
        if not gpu or (most and (not most.isdigit() or int(most) < 1)):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected TYPE[@CLASS] or TYPE[@CLASS]:MAX with MAX a positive integer"
            )
        wanted.append(
            VariantRequest(gpu, int(most) if most else None, None, _class_name(item, capacity_class) if at else None)
        )
    return wanted


def _gpu_price(value: str) -> tuple[str, float]:
    """--gpu-price: TYPE[@CLASS]=USD, a catalog GPU (on a capacity class's nodes) and its price per
    GPU-hour, keyed as the planner looks it up (L4, L4@spot)."""
    named, _, price = value.partition("=")
    name, at, capacity_class = named.partition(names.CLASS_SEPARATOR)
    gpu = find_gpu(name)
    try:
        usd = float(price)
    except ValueError:
        usd = -1.0
    if gpu is None or not usd >= 0:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected TYPE[@CLASS]=USD with TYPE one of {', '.join(GPUS)} and USD >= 0"
        )
    return names.variant_key(gpu.name, _class_name(value, capacity_class) if at else None), usd


def _capacity_class(value: str) -> tuple[str, dict[str, str]]:
    """--capacity-class: CLASS=LABEL=VALUE[,LABEL=VALUE], a class name and the node labels of its
    nodes (label keys and values hold no '=' or ',')."""
    name, _, pairs = value.partition("=")
    labels = dict(pair.partition("=")[::2] for pair in pairs.split(",") if pair)
    if not labels or any(not key or "=" in label for key, label in labels.items()):
        raise argparse.ArgumentTypeError(f"{value!r}: expected CLASS=LABEL=VALUE[,LABEL=VALUE]")
    return _class_name(value, name), labels


def _address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _url_prefix(value: str) -> str:
    if urllib.parse.urlsplit(value).scheme not in ("http", "https") or not prometheus_allowed(value, (value,)):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http(s)://host[:port][/path] prefix (no user, query or fragment)"
        )
    return value


def _gateway_pods(value: str) -> GatewayPods:
    try:
        return GatewayPods.parse(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _manifest(file: TextIO) -> dict[str, Any]:
    """An InferenceService manifest read from YAML; ValueError naming what is wrong."""
    try:
        manifest = yaml.safe_load(file)
    except yaml.YAMLError as error:
        raise ValueError(f"{file.name}: not YAML: {error}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("kind") != names.KIND
        or not isinstance(manifest.get("spec"), dict)
    ):
        raise ValueError(f"{file.name}: not an {names.KIND} manifest (kind: {names.KIND}, with a spec)")
    return manifest


def _config_json(path: str) -> Path:
    """The config.json `path` names: the file, or the one in the checkpoint folder."""
    return Path(path) / "config.json" if Path(path).is_dir() else Path(path)


def _config_file(path: str, flag: str) -> tuple[Path, ModelConfig]:
    """The config.json at `path` (_config_json) read as the operator reads a checkpoint's, with the
    bytes of the safetensors weights beside it; ValueError saying why it cannot be read (`flag`: the
    option that named it)."""
    file = _config_json(path)
    read = read_local(file, f"config.json {file}")
    if isinstance(read, Unreadable):
        raise ValueError(f"{flag} {path}: {read.failure}: {read.message}")
    return file, read


def _configured_model(path: str) -> dict[str, Any]:
    """spec.model for a model known by its config.json (_config_file), named after the checkpoint's
    folder, with its stored scheme."""
    file, read = _config_file(path, "--model-config")
    model = {"name": file.resolve().parent.name, "architecture": read.architecture.model_dump(by_alias=True)}
    return model | ({"quantization": read.quantization} if read.quantization else {})


def _named_model(model: str) -> dict[str, Any]:
    """spec.model for --model: a catalog name, or an hf:// repository (named after it) whose
    config.json is read from the Hub as the operator reads it."""
    source = hub_source(model)
    return {"name": model} if source is None else {"name": source.repo.rsplit("/", 1)[-1], "source": model}


def _read_checkpoints(spec: InferenceServiceSpec, draft_config: str | None) -> tuple[InferenceServiceSpec, PlanContext]:
    """The spec, and the plan context of the checkpoints whose config.json the operator would read
    from the Hub (here at HF_ENDPOINT with HF_TOKEN): the model's and its draft's, unless
    `draft_config` (--draft-model-config) gives the draft's; ValueError when one cannot be had."""
    hub, token = HubClient(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT), os.environ.get("HF_TOKEN") or None

    def read(source: str | None, draft: bool = False) -> ModelConfig | None:
        found = read_checkpoint(source, hub, token, None)
        found = as_draft(found) if draft else found
        if isinstance(found, Unreadable):
            raise ValueError(f"{found.failure}: {found.message}")
        return found

    checkpoint = read(model_to_read(spec))
    if draft_config is not None:
        draft: ModelConfig | None = _config_file(draft_config, "--draft-model-config")[1]
    else:
        draft = read(draft_to_read(spec), draft=True)
    context = PlanContext(checkpoint=checkpoint.architecture if checkpoint else None, draft_checkpoint=draft)
    return with_checkpoint(spec, checkpoint), context


def _spec(args: argparse.Namespace, profile: DeviceProfile | None) -> dict[str, Any]:
    def given(**fields: Any) -> dict[str, Any]:
        return {key: value for key, value in fields.items() if value is not None}

    if args.filename is not None:
        return _manifest(args.filename)["spec"]
    gpus: list[VariantRequest] = args.gpu or []
    if len(gpus) == 1 and gpus[0].max_replicas is not None:
        raise ValueError("--gpu TYPE:MAX bounds one type of several; for one type use --max-replicas")
    if not args.gpu and profile is None:
        raise ValueError("--gpu or --device-profile is required with --model or --model-config")
    if args.gpu and profile is not None:
        raise ValueError("--gpu and --device-profile: a plan is for a GPU or for a CPU")
    return {
        "model": _configured_model(args.model_config) if args.model_config is not None else _named_model(args.model),
        **given(runtime=args.runtime),
        "accelerator": _accelerator(gpus, args.gpus)
        if profile is None
        else {"type": CPU_TYPE, "profile": profile.name, **given(count=args.gpus)},
        "serving": given(
            maxContextLength=args.context,
            quantization=args.quantization,
            kvCacheDtype=args.kv_cache_dtype,
            speculative=args.speculative,
            numSpeculativeTokens=args.num_speculative_tokens,
            draftModel=args.draft_model or _draft_folder(args.draft_model_config),
            gpuMemoryUtilization=args.gpu_memory_utilization,
            blockSize=args.block_size,
        ),
        "slo": given(ttftP95Ms=args.ttft_ms, tpotP95Ms=args.tpot_ms),
        "load": given(
            requestsPerSecond=args.rps,
            meanPromptTokens=args.prompt_tokens,
            meanOutputTokens=args.output_tokens,
            temperature=args.temperature,
        ),
        "autoscaling": given(minReplicas=args.min_replicas, maxReplicas=args.max_replicas),
    }


def _draft_folder(config: str | None) -> str | None:
    """The draft's source for --draft-model-config without --draft-model: its checkpoint folder."""
    if config is None:
        return None
    return str(_config_json(config).parent.resolve())


def _accelerator(gpus: list[VariantRequest], count: int | None) -> dict[str, Any]:
    """accelerator of --gpu: one type, or several (or one on a capacity class) as a mixed pool's
    variants."""
    if len(gpus) == 1 and not gpus[0].capacity_class:
        return {"type": gpus[0].gpu, **({"count": count} if count else {})}
    return {
        "variants": [
            {
                "type": g.gpu,
                **({"capacityClass": g.capacity_class} if g.capacity_class else {}),
                **({"maxReplicas": g.max_replicas} if g.max_replicas else {}),
                **({"count": count} if count else {}),
            }
            for g in gpus
        ]
    }


def _device_rows(result: Plan) -> list[tuple[str, str]]:
    if result.device_profile:
        return [("device", f"cpu, profile {result.device_profile}, {result.cpus} CPUs per replica")]
    gpu = find_gpu(result.gpu) if result.gpu else None
    if gpu is None:
        return []
    figures = f"{gpu.memory_gib:g} GiB, {gpu.usable_memory_mib} MiB reported, {gpu.bandwidth_gbps:g} GB/s"
    return [("gpu", f"{gpu.name} ({figures}, {gpu.fp16_tflops:g} FP16 TFLOPS)")]


def _lora_rows(result: Plan) -> list[tuple[str, str]]:
    """The adapter slots of spec.adapters, none without adapters."""
    lora = result.lora
    if lora is None:
        return []
    return [
        (
            "LoRA adapters",
            f"{lora.adapters}: max_loras {lora.max_loras}, max_lora_rank {lora.max_lora_rank}, max_cpu_loras "
            f"{lora.max_cpu_loras}; slots {lora.slot_bytes / sizing.GiB:.2f} GiB (taken from the KV pool)",
        )
    ]


def format_plan(result: Plan, spec: InferenceServiceSpec) -> str:
    """The plan as a table a person reads: the numbers first, then why."""
    gib = sizing.GiB
    rows: list[tuple[str, str]] = [("model", result.model), *_device_rows(result), ("runtime", result.runtime)]
    if result.fits:
        rows.append(
            ("gpus per replica", f"{result.gpu_count}" + (" (tensor parallel)" if result.gpu_count > 1 else ""))
        )
    rows.append(("fits", "yes" if result.fits else f"NO ({result.failure})"))
    if result.quantization:
        rows += [("quantization", result.quantization), ("weights", f"{result.weight_bytes / gib:.1f} GiB")]
    if result.kv_bytes_per_token:
        dtype = " (fp8)" if result.kv_cache_dtype == "fp8" else ""
        rows.append(("KV per token", f"{result.kv_bytes_per_token / sizing.MiB:.3g} MiB{dtype}"))
    if result.fits:
        rows += [
            (
                "KV pool",
                f"{result.kv_pool_bytes / gib:.1f} GiB ({result.kv_blocks} blocks of {result.block_size} tokens)",
            ),
            ("max model len", str(result.max_model_len)),
            (
                "max num seqs",
                f"{result.max_num_seqs} "
                + (
                    "(the most whose step meets the TPOT SLO)"
                    if result.cpus
                    else "(sequences at the mean context that fit)"
                ),
            ),
            ("max batched tokens", str(result.max_num_batched_tokens)),
            *_lora_rows(result),
            (
                "speculative",
                result.speculative + (f" (k={result.num_speculative_tokens})" if result.num_speculative_tokens else ""),
            ),
            ("predicted TTFT", f"{result.predicted_ttft_ms:g} ms (SLO {spec.slo.ttft_p95_ms:g})"),
            ("predicted TPOT", f"{result.predicted_tpot_ms:g} ms (SLO {spec.slo.tpot_p95_ms:g})"),
            (
                "predicted latency",
                f"{result.predicted_latency_ms:g} ms for {spec.load.mean_output_tokens} output tokens",
            ),
            (
                "replicas",
                f"{result.replicas} for {spec.load.requests_per_second:g} req/s "
                f"({'meets' if result.meets_slo else 'MISSES'} the SLO)",
            ),
            ("capacity", f"{result.capacity_rps:g} req/s per replica within the SLO"),
            (
                "time to ready",
                f"~{result.predicted_ready_s:g} s (startup probe allows {result.startup_budget_s} s"
                + (f" after {result.download_budget_s} s for downloads)" if result.download_budget_s else ")"),
            ),
        ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += ["", "why:", *(f"  {key}: {why}" for key, why in result.reasons.items())]
    if not result.fits:
        lines.append(f"  {result.reason}")
    return "\n".join(lines)


def format_mixed_plan(mixed: MixedPlan, spec: InferenceServiceSpec) -> str:
    """A mixed pool's plan as a person reads it: a line per variant, why, then each variant's plan."""
    verdict = "meets" if mixed.meets_slo else "MISSES"
    rows = [
        (
            "variants",
            f"{len(mixed.variants)}, {mixed.replicas} replica(s), ${mixed.cost_per_hour:g}/h, {verdict} the SLO",
        )
    ]
    for v in mixed.variants:
        per = f"${v.cost_per_rps_hour:g}/h per req/s" if v.cost_per_rps_hour is not None else "misses the SLO alone"
        served = (
            f"{v.plan.replicas} x {v.plan.gpu_count} GPU(s) serve {v.requests_per_second:g} req/s"
            if v.plan.replicas
            else "stands by"
        )
        rows.append(
            (
                v.key,
                f"{served} (max {v.max_replicas}); {v.plan.capacity_rps:g} req/s per replica at "
                f"${v.price_per_gpu_hour:g}/GPU-h: {per}; ${v.cost_per_hour:g}/h",
            )
        )
    rows += [(gpu, f"left out: {why}") for gpu, why in mixed.left_out.items()]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += ["", f"why: {mixed.reason}"]
    for v in mixed.variants:
        at = spec.model_copy(
            update={"load": spec.load.model_copy(update={"requests_per_second": v.requests_per_second})}
        )
        lines += ["", f"== {v.key} ==", format_plan(v.plan, at)]
    return "\n".join(lines)


def _runtime_args(spec: InferenceServiceSpec, result: Plan) -> list[str]:
    """The engine container's arguments the operator would render for this plan."""
    deployment = render.deployment("plan", "default", "", spec, result)
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def _device_profile(args: argparse.Namespace) -> DeviceProfile | None:
    """--device-profile: a built-in profile by name, else a profile file; ValueError when neither."""
    if not args.device_profile:
        return None
    builtin = cpus.builtin_profiles()
    if args.device_profile in builtin:
        return builtin[args.device_profile]
    try:
        return load_device_profile(args.device_profile)
    except ValueError as error:
        raise ValueError(f"--device-profile: not a built-in profile ({', '.join(builtin)}), and {error}") from None


def run_plan(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Exit 0 when the model fits, 1 when it does not, 2 for invalid arguments."""
    try:
        prices, classes = pool_settings(args)
        profile = _device_profile(args)
        spec = with_model_source(InferenceServiceSpec.model_validate(_spec(args, profile)))
        spec, context = _read_checkpoints(spec, args.draft_model_config)
    except (ValidationError, ValueError) as error:
        print(f"kvpilot plan: {error}", file=sys.stderr)
        return 2
    profiles = {profile.name: profile} if profile else {}
    context = replace(context, device_profiles=profiles)
    if spec.accelerator.variants:
        mixed = plan_variants(spec, requested(spec), context, prices, classes)
        if args.json:
            body = mixed.model_dump(mode="json")
            for variant, shown in zip(mixed.variants, body["variants"], strict=True):
                shown["args"] = _runtime_args(spec, variant.plan)
            out.write(json.dumps(body, indent=2) + "\n")
        else:
            out.write(format_mixed_plan(mixed, spec) + "\n")
        return 0 if mixed.fits else 1
    result = plan(spec, context)
    if args.json:
        body = result.model_dump(mode="json") | ({"args": _runtime_args(spec, result)} if result.fits else {})
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        out.write(format_plan(result, spec) + "\n")
    return 0 if result.fits else 1


def run_render(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """The objects `reconcile` would apply for the manifest (on a cluster whose nodes carry no GPU
    label: set accelerator.type); exit 1 when the plan does not fit (only the Service and PDB then),
    2 for an invalid manifest."""
    try:
        prices, classes = pool_settings(args)
        manifest = _manifest(args.filename)
        spec = with_model_source(InferenceServiceSpec.model_validate(manifest["spec"]))
    except (ValidationError, ValueError) as error:
        print(f"kvpilot render: {error}", file=sys.stderr)
        return 2
    metadata = manifest.get("metadata") or {}
    missing = missing_source(spec)
    wanted = spec.accelerator.variants and not missing
    mixed = plan_variants(spec, requested(spec), prices=prices, classes=classes) if wanted else None
    if missing:
        result = failed_plan(spec, MODEL_SOURCE_REQUIRED, missing)
    else:
        result = plan(spec) if mixed is None else as_one_plan(spec, mixed)
    objects = render.children(
        str(metadata.get("name", "unnamed")),
        str(metadata.get("namespace", "default")),
        str(metadata.get("uid", "")),
        spec,
        result,
        default_image=args.engine_image,
        mixed=mixed,
    )
    if not result.fits:
        print(f"kvpilot render: no Deployment: {result.failure}: {result.reason}", file=sys.stderr)
    yaml.safe_dump_all(objects, out, sort_keys=False)
    return 0 if result.fits else 1


def run_inspect_checkpoint(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """The folder's CheckpointInspection as compact JSON on `out` and in the termination log; a
    refusal (`UnsupportedArchitecture: ...` or why the folder cannot be read) on stderr and there,
    with exit status 1."""
    found = inspect_folder(args.folder)
    try:
        if isinstance(found, Unreadable):
            raise ValueError(f"{found.failure}: {found.message}" if found.failure == UNSUPPORTED else found.message)
        result = found.message()
    except ValueError as error:
        # Cut to what the kubelet keeps, at a character's boundary.
        refusal = str(error).encode()[:TERMINATION_MESSAGE_LIMIT].decode(errors="ignore")
        _termination_log(args.termination_log, refusal)
        print(refusal, file=sys.stderr)
        return 1
    _termination_log(args.termination_log, result)
    out.write(result + "\n")
    return 0


def _termination_log(path: Path, message: str) -> None:
    """Write the message where the kubelet reads it; outside a pod (no such file's folder, or no
    right to it) stdout and stderr are enough."""
    with suppress(OSError):
        path.write_text(message)


def run_crd(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """crds/inferenceservice.yaml as operator/api/crd.py generates it from the pydantic types."""
    out.write(crd_yaml())
    return 0


def run_operator(args: argparse.Namespace) -> int:
    try:
        prices, classes = pool_settings(args)
    except ValueError as error:
        print(f"kvpilot operator: {error}", file=sys.stderr)
        return 2
    # Registers the handlers in kopf's default registry; only this command wants that. The
    # reconcile handlers first: their startup handler completes the memo the others use.
    importlib.import_module("kvpilot.operator.controller.handlers")
    importlib.import_module("kvpilot.operator.process")
    # main() gave the root logger a plain stream handler; kopf adds its own, which would print
    # every line twice.
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if type(h) is not logging.StreamHandler]
    # log_prefix: every per-object line says which InferenceService it is about.
    kopf.configure(verbose=args.verbose, log_prefix=True)
    namespaces = None if args.all_namespaces else list(args.namespaces)
    # The operator's one client: the peering here, then every handler and the autoscaler through
    # kopf's memo.
    cluster = KubeCluster.connect()
    if not args.standalone:
        cluster.ensure_peering(args.peering, namespaces)
    # kopf pauses every operator that sees a live peer of the same or higher priority, so
    # replicas with equal priorities would all stand still: each draws its own, and only the
    # highest acts until its peering record lapses.
    priority = args.priority if args.priority is not None else random.SystemRandom().randrange(1, 2**31)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=namespaces or (),
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(
            cluster=cluster,
            autoscale_interval=args.autoscale_interval,
            prometheus_url_allow=tuple(args.prometheus_url_allow),
            gateway_pods=args.gateway_pods,
            metrics_address=args.metrics,
            gpu_prices=prices,
            capacity_classes=classes,
        ),
    )
    return 0
