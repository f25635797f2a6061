"""The contract between the halves: every pod the operator renders runs `kvpilot serve` with
arguments the engine accepts, carrying the plan's numbers.

Every catalog model on every catalog GPU, under the CRD's defaults and every value a spec may pin
for quantization and speculation, is planned against the engine's real CAPABILITIES; each plan
that fits is rendered into its Deployment and the container's arguments are parsed by the engine's
own `serve` parser (built once: the matrix is a few thousand plans on CPU).
"""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stderr
from itertools import product
from typing import Any, get_args

import pytest

from kvpilot.engine.cli import (
    build_parser,
    engine_config_from_args,
    server_config_from_args,
)
from kvpilot.engine.contract.config import CAPABILITIES, EngineConfig
from kvpilot.operator.api import names
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import (
    InferenceServiceSpec,
    Quantization,
    Speculative,
    hub_source,
)
from kvpilot.operator.controller import render
from kvpilot.operator.planning.gpus import GPUS
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import plan

PARSER = build_parser("serve")
DOWNLOAD = build_parser("download")
# A catalog draft with each vocabulary (the engine drafts only with the target's tokens; the
# largest Qwen drafts for the 72B).
DRAFTS = {
    32000: "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    128256: "hf://meta-llama/Llama-3.2-1B-Instruct",
    152064: "hf://Qwen/Qwen2.5-7B-Instruct",
    49152: "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
}
# The model's own context and a short one, so that the large models fit on more GPUs; the short
# one also moves block size and memory share off their defaults.
SERVINGS: list[dict[str, Any]] = [{}, {"maxContextLength": 2048, "blockSize": 32, "gpuMemoryUtilization": 0.85}]
# Every value a spec may pin, and auto with a draft model to choose.
SPECULATION: list[dict[str, Any]] = [
    {"speculative": mode, **({"draftModel": True} if mode in ("draft", "eagle") else {})}
    for mode in get_args(Speculative)
] + [{"speculative": "auto", "draftModel": True}]
# Plan fields the rendered engine flags must carry; any further field the two models share (a
# speculative knob the engine grows, say) is compared too. Where the model and the draft model are
# in the pod is render's to say, checked apart.
CARRIED = {
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "gpu_memory_utilization",
    "quantization",
    "speculative",
}
SHARED = (set(Plan.model_fields) & set(EngineConfig.model_fields)) - {"model", "draft_model"}


def _specs(model: str) -> list[InferenceServiceSpec]:
    draft = DRAFTS[MODELS[model].vocab_size]
    return [
        InferenceServiceSpec.model_validate(
            {
                "model": {"name": model},
                "accelerator": {"type": gpu},
                "serving": {
                    **serving,
                    "quantization": quantization,
                    **speculation,
                    **({"draftModel": draft} if "draftModel" in speculation else {}),
                },
            }
        )
        for gpu, serving, quantization, speculation in product(GPUS, SERVINGS, get_args(Quantization), SPECULATION)
    ]


def _unsupported_pins(spec: InferenceServiceSpec) -> list[str]:
    """What the plan's reason must say for each value the spec pins that the engine lacks: the
    value, and the supported list."""
    return [
        text
        for field, value in (("quantization", spec.serving.quantization), ("speculative", spec.serving.speculative))
        if value != "auto" and value not in getattr(CAPABILITIES, field)
        for text in (
            f"serving.{field} {value!r} is not one runtime kvpilot runs",
            f"(supported: {', '.join(getattr(CAPABILITIES, field))}; or 'auto')",
        )
    ]


def _parse(args: list[str]) -> argparse.Namespace | str:
    """The parsed arguments, or argparse's error line (it exits rather than raising)."""
    complaint = io.StringIO()
    try:
        with redirect_stderr(complaint):
            return PARSER.parse_args(["serve", *args])
    except SystemExit:
        return complaint.getvalue().strip().splitlines()[-1]


def _broken_contract(spec: InferenceServiceSpec, result: Plan) -> str | None:
    """What is wrong with the rendered engine container of a plan that fits, None when nothing."""
    try:
        deployment = render.deployment("svc", "ns", "uid", spec, result)
    except ValueError as error:  # pydantic's ValidationError: the engine's config refused it
        return f"no Deployment renders: {error}"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    if container["command"] != ["kvpilot", "serve"]:
        return f"command {container['command']}"
    parsed = _parse(args)
    if isinstance(parsed, str):
        return f"kvpilot serve {' '.join(args)} exits: {parsed}"
    engine, server = engine_config_from_args(parsed), server_config_from_args(parsed)
    wanted = {name: getattr(result, name) for name in SHARED if getattr(result, name) is not None}
    got = {name: getattr(engine, name) for name in wanted}
    if got != wanted or engine.model != spec.model.name:
        return f"{args} parse to {got}, model {engine.model!r}; the plan has {wanted}"
    if (server.host, server.port, server.served_model_name) != ("0.0.0.0", names.PORT, spec.model.name):
        return f"{args} serve {server.served_model_name!r} on {server.host}:{server.port}"
    # A draft model is where its download init container puts it (the catalog drafts are hf://).
    downloads = {
        parsed.repo: parsed.local_dir
        for parsed in (
            DOWNLOAD.parse_args(["download", *init["args"]])
            for init in deployment["spec"]["template"]["spec"].get("initContainers", [])
        )
    }
    if result.speculative == "draft":
        draft = hub_source(spec.serving.draft_model)
        if draft is None or engine.draft_model is None or downloads.get(draft.repo) != engine.draft_model:
            return f"draft model {engine.draft_model!r}, downloads {downloads}, for {spec.serving.draft_model}"
    elif engine.draft_model is not None or downloads:
        return f"no draft runs, yet --draft-model {engine.draft_model!r} and downloads {downloads}"
    return None


def test_the_plan_fields_that_reach_the_engine_are_all_compared() -> None:
    assert CARRIED <= SHARED


def test_serve_accepts_the_operators_rendered_args() -> None:
    # The CRD's defaults (quantization and speculative auto), as `kubectl apply` leaves them.
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
            "accelerator": {"type": "A10G"},
            "serving": {"maxContextLength": 4096},
        }
    )
    p = plan(spec)
    args = PARSER.parse_args(["serve", *render.engine_args(spec, p, "meta-llama/Llama-2-7b-hf")])
    config = engine_config_from_args(args)
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 8000, "llama-2-7b")
    assert config.model == "meta-llama/Llama-2-7b-hf"
    assert config.max_model_len == 4096
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (p.max_num_seqs, p.max_num_batched_tokens)
    assert (config.quantization, config.speculative) == (p.quantization, p.speculative)


@pytest.mark.parametrize("model", MODELS)
def test_every_plan_that_fits_renders_arguments_kvpilot_serve_accepts(model: str) -> None:
    """Every catalog model the engine builds is planned into arguments it parses; every other one
    (Mixtral, Qwen2.5) is refused by its class, never rendered into a pod that would not start."""
    problems: list[str] = []
    fitting = 0
    built = MODELS[model].hf_architecture
    loaded = CAPABILITIES.architectures is None or built in CAPABILITIES.architectures
    for spec in _specs(model):
        result = plan(spec)
        where = f"{model} on {spec.accelerator.type} {spec.serving.model_dump(exclude_none=True)}"
        pins = _unsupported_pins(spec)
        if pins:
            if result.failure != "UnsupportedByRuntime" or not all(p in result.reason for p in pins):
                problems.append(
                    f"{where}: plans {result.failure}: {result.reason!r}, not UnsupportedByRuntime saying {pins}"
                )
            continue
        if not loaded:
            if result.failure != "UnsupportedByRuntime" or f"it is a {built}" not in result.reason:
                problems.append(f"{where}: plans {result.failure}: {result.reason!r}, not UnsupportedByRuntime")
            continue
        if not result.fits:
            if result.failure == "UnsupportedByRuntime":
                problems.append(f"{where}: pins nothing unsupported but {result.reason}")
            continue
        fitting += 1
        if result.quantization not in CAPABILITIES.quantization or result.speculative not in CAPABILITIES.speculative:
            problems.append(f"{where}: chose {result.quantization}/{result.speculative}")
        broken = _broken_contract(spec, result)
        if broken:
            problems.append(f"{where}: {broken}")
    assert not problems, "\n".join(problems)
    assert fitting or not loaded, f"no plan for {model} fits on any GPU: the matrix tests nothing"
