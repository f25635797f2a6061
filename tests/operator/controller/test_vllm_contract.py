"""The contract with vLLM: every pod the operator renders for `runtime: vllm` runs `vllm serve` with
arguments vLLM 0.33's own parser accepts and whose engine configuration, built by vLLM's own
`create_engine_config`, carries the plan's numbers.

Every catalog model on every catalog GPU, under each scheme (on load: auto, none, fp8; stored:
every model.quantization vLLM reads), each speculative choice and each tensor-parallel choice (the
planner's, and every size pinned), is planned for vLLM; each plan that fits is rendered, and its
container's command line goes to vLLM itself (tests/vllm/engine_configs.py, in the venv that
tests/vllm/env.py builds once) against a folder holding the model's config.json synthesized from the
catalog architecture (and the draft's), offline.
"""

from __future__ import annotations

import json
from itertools import product
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning.gpus import GPUS, find_gpu
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.runtimes.vllm import VLLM_CAPABILITIES
from tests.vllm import env
from tests.vllm.model_configs import config_json, eagle_head

# A catalog draft per vocabulary (vLLM drafts with the target's tokens), as test_contract's.
DRAFTS = {32000: "tinyllama-1.1b", 128256: "llama-3.2-1b", 152064: "qwen2.5-7b", 49152: "smollm2-135m"}
# (serving.quantization, model.quantization): each on-load choice, and each stored scheme under auto.
SCHEMES = [(q, None) for q in ("auto", *VLLM_CAPABILITIES.quantization)] + [
    ("auto", stored) for stored in VLLM_CAPABILITIES.checkpoint_quantization
]
SPECULATION: list[dict[str, Any]] = [
    {"speculative": "off"},
    {"speculative": "ngram"},
    {"speculative": "draft"},
    {"speculative": "eagle"},
    {"speculative": "auto", "draft": True},
]
TENSOR_PARALLEL = [None, *VLLM_CAPABILITIES.tensor_parallel_sizes]
# Off the defaults: a short context, another block size and memory share.
SHORT = {"maxContextLength": 2048, "blockSize": 32, "gpuMemoryUtilization": 0.85}
# What vLLM names each scheme once it has read the checkpoint (on its CPU platform, where the Marlin
# variants of AWQ and GPTQ are not offered, and GPTQ is `auto_gptq`; on a GPU it may pick the Marlin ones).
VLLM_QUANTIZATION = {
    "none": {None},
    "fp8": {"fp8"},
    "stored:int8": {"compressed-tensors"},
    "stored:fp8": {"compressed-tensors"},
    "stored:w8a8": {"compressed-tensors"},
    "stored:int4": {"compressed-tensors"},
    "stored:awq": {"awq", "awq_marlin"},
    "stored:gptq": {"gptq", "gptq_marlin", "auto_gptq"},
}


def _spec(
    model: str,
    gpu: str,
    scheme: tuple[str, str | None],
    speculation: dict[str, Any],
    tp: int | None,
    serving: dict[str, Any],
) -> InferenceServiceSpec:
    quantization, stored = scheme
    drafts = {
        "draft": (f"/drafts/{DRAFTS[MODELS[model].vocab_size]}", MODELS[DRAFTS[MODELS[model].vocab_size]]),
        "eagle": (f"/eagle/{model}", eagle_head(MODELS[model])),
    }
    mode = "draft" if speculation.get("draft") else speculation["speculative"]
    return InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {"name": model, "source": f"/models/{model}", **({"quantization": stored} if stored else {})},
            "accelerator": {"type": gpu, **({"count": tp} if tp else {})},
            "serving": {
                **serving,
                "quantization": quantization,
                "speculative": speculation["speculative"],
                **(
                    {"draftModel": drafts[mode][0], "draftModelArchitecture": drafts[mode][1].model_dump(by_alias=True)}
                    if mode in drafts
                    else {}
                ),
            },
        }
    )


def _cases() -> list[tuple[InferenceServiceSpec, Plan]]:
    specs = [
        _spec(model, gpu, scheme, speculation, tp, {})
        for model, gpu, scheme, speculation, tp in product(MODELS, GPUS, SCHEMES, SPECULATION, TENSOR_PARALLEL)
    ] + [
        _spec(model, gpu, scheme, {"speculative": "off"}, None, serving)
        for model, gpu, scheme, serving in product(MODELS, GPUS, SCHEMES, (SHORT, {"kvCacheDtype": "fp8"}))
    ]
    return [(spec, result) for spec in specs if (result := plan(spec)).fits]


def _expected(spec: InferenceServiceSpec, result: Plan) -> dict[str, Any]:
    scheme = f"stored:{spec.model.quantization}" if spec.model.quantization else result.quantization
    return {
        "model": spec.model.source,
        "served_model_name": [spec.model.name],
        "host": "0.0.0.0",
        "port": names.PORT,
        "max_model_len": result.max_model_len,
        "max_num_seqs": result.max_num_seqs,
        "max_num_batched_tokens": result.max_num_batched_tokens,
        "block_size": result.block_size,
        "enable_prefix_caching": True,
        # vLLM measures its own pool from the utilization: no pool of the plan's is imposed on it.
        "kv_cache_memory_bytes": None,
        "gpu_memory_utilization": result.gpu_memory_utilization,
        "kv_cache_dtype": {"model": "auto", "fp8": "fp8"}[result.kv_cache_dtype],
        "tensor_parallel_size": result.gpu_count,
        "quantization": VLLM_QUANTIZATION[scheme],
        "speculative_method": {"off": None, "ngram": "ngram", "draft": "draft_model", "eagle": "eagle"}[
            result.speculative
        ],
        "num_speculative_tokens": result.num_speculative_tokens,
        "draft_model": result.draft_model,
    }


def _mismatches(expected: dict[str, Any], got: dict[str, Any], gpu: str) -> list[str]:
    wrong = [
        f"{key}: vLLM configured {got.get(key)!r}, the plan {want!r}"
        for key, want in expected.items()
        if (got.get(key) not in want if isinstance(want, set) else got.get(key) != want)
    ]
    gpu_type = find_gpu(gpu)
    if gpu_type is not None and not gpu_type.bf16 and got.get("dtype") != "float16":
        wrong.append(f"dtype: vLLM configured {got.get('dtype')!r} on {gpu}, which has no bf16")
    return wrong


def test_every_vllm_plan_that_fits_is_a_command_line_vllm_configures_as_planned() -> None:
    cases = _cases()
    lines, expected = [], {}
    for index, (spec, result) in enumerate(cases):
        container = render.deployment("svc", "ns", "uid", spec, result)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["vllm", "serve"], container["command"]
        models = {str(spec.model.source): config_json(MODELS[spec.model.name], spec.model.quantization)}
        if result.draft_model:
            head = spec.serving.draft_model_architecture
            assert head is not None
            models[result.draft_model] = config_json(head)
        lines.append(json.dumps({"id": str(index), "argv": container["args"], "models": models}))
        expected[str(index)] = (spec, result, container["args"])
    out = env.run("engine_configs", "\n".join(lines) + "\n")
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(answers) == len(cases), out[-3000:]
    broken = []
    for answer in answers:
        spec, result, args = expected[answer["id"]]
        where = f"{spec.model.name} on {result.gpu} x{result.gpu_count} ({result.quantization}, {result.speculative})"
        if not answer["ok"]:
            broken.append(f"{where}: vllm serve {' '.join(args)} is refused: {answer['error']}")
        else:
            broken += [f"{where}: {m}" for m in _mismatches(_expected(spec, result), answer, str(result.gpu))]
    assert not broken, f"{len(broken)} of {len(cases)} plans:\n" + "\n".join(broken[:20])
    # The matrix exercises what the runtime adds: tensor parallelism and every scheme.
    assert {r.gpu_count for _, r in cases} == set(VLLM_CAPABILITIES.tensor_parallel_sizes)
    assert {s.model.quantization or r.quantization for s, r in cases} >= {"none", "fp8", "int4", "awq", "gptq", "w8a8"}
    assert {r.kv_cache_dtype for _, r in cases} == set(VLLM_CAPABILITIES.kv_cache_dtypes)
