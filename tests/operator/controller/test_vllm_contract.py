"""The contract with vLLM: every pod the operator renders for `runtime: vllm` runs `vllm serve` with
arguments vLLM 0.33's own parser accepts and whose engine configuration, built by vLLM's own
`create_engine_config`, carries the plan's numbers.

Every catalog model on every catalog GPU, under each scheme (on load: auto, none, fp8; stored:
every model.quantization vLLM reads), each speculative choice and each tensor-parallel choice (the
planner's, and every size pinned), is planned for vLLM; each plan that fits is rendered, and its
container's command line goes to vLLM itself (tests/vllm/engine_configs.py, in the venv that
tests/vllm/env.py builds once) against a folder holding the model's config.json synthesized from the
catalog architecture (and the draft's), offline. Plans with spec.adapters also carry vLLM's LoRA flags,
which its config builder must configure as planned, with runtime LoRA updating on.
"""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import Architecture, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning import adapters
from kvpilot.operator.planning.gpus import GPUS, find_gpu
from kvpilot.operator.planning.model_config import read_config
from kvpilot.operator.planning.models import MODELS
from kvpilot.operator.planning.plan import plan
from kvpilot.operator.runtimes.vllm import VLLM_CAPABILITIES
from tests.vllm import env
from tests.vllm.model_configs import config_json, eagle_head

# Hybrids whose real config.json (tests/operator/planning/hf_configs) the pods' model folders hold.
HF_CONFIGS = Path(__file__).parents[1] / "planning" / "hf_configs"
# Qwen3.5 wraps its hybrid language model with a vision tower (vLLM's multimodal class plans it).
HYBRIDS = {
    "qwen3-next-80b": "Qwen--Qwen3-Next-80B-A3B-Thinking",
    "nemotron-h-56b": "nvidia--Nemotron-H-56B-Base-8K",
    "qwen3.5-35b-a3b": "Qwen--Qwen3.5-35B-A3B",
}
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
    """The plans that fit, over every model, GPU, scheme and tensor-parallel choice, each with one speculative
    mode: the one whose index is the sum of the four choices' indices modulo the modes' count. Any two of the
    four held, the other two still take every mode, so every mode meets every pair of them, without the full
    product's five-fold cost (32,000 specs and 22,000 vLLM configurations took 6 minutes of a CI run)."""
    choices = (MODELS, GPUS, SCHEMES, TENSOR_PARALLEL)
    specs = [
        _spec(model, gpu, scheme, SPECULATION[(m + g + s + t) % len(SPECULATION)], tp, {})
        for (m, model), (g, gpu), (s, scheme), (t, tp) in product(*map(enumerate, choices))
    ] + [
        _spec(model, gpu, scheme, {"speculative": "off"}, None, serving)
        for model, gpu, scheme, serving in product(MODELS, GPUS, SCHEMES, (SHORT, {"kvCacheDtype": "fp8"}))
    ]
    return [(spec, result) for spec in specs if (result := plan(spec)).fits]


def _expected(spec: InferenceServiceSpec, result: Plan) -> dict[str, Any]:
    scheme = f"stored:{spec.model.quantization}" if spec.model.quantization else result.quantization
    latent = spec.model.architecture is not None and spec.model.architecture.latent_dim is not None
    return {
        "model": spec.model.source,
        "served_model_name": [spec.model.name],
        "host": "0.0.0.0",
        "port": names.PORT,
        "max_model_len": result.max_model_len,
        "max_num_seqs": result.max_num_seqs,
        # This harness's CPU platform turns chunked prefill and prefix caching off under latent attention
        # (platforms/cpu.py: "MLA is enabled on a non-GPU platform"), steps of a whole context; CUDA's keeps both.
        "max_num_batched_tokens": result.max_model_len if latent else result.max_num_batched_tokens,
        "block_size": result.block_size,
        "enable_prefix_caching": not latent,
        # vLLM measures its own pool from the utilization: no pool of the plan's is imposed on it.
        "kv_cache_memory_bytes": None,
        "gpu_memory_utilization": result.gpu_memory_utilization,
        "kv_cache_dtype": {"model": "auto", "fp8": "fp8"}[result.kv_cache_dtype],
        "tensor_parallel_size": result.gpu_count,
        # A real config.json's own method (DeepSeek-V3's block-wise fp8), else the synthesized one's.
        "quantization": {method} if (method := _stored_method(spec)) else VLLM_QUANTIZATION[scheme],
        "speculative_method": {"off": None, "ngram": "ngram", "draft": "draft_model", "eagle": "eagle", "mtp": "mtp"}[
            result.speculative
        ],
        "num_speculative_tokens": result.num_speculative_tokens,
        # An MTP drafter is the target's own checkpoint.
        "draft_model": spec.model.source if result.speculative == "mtp" else result.draft_model,
        # spec.adapters' slots; a plan without adapters enables no LoRA.
        "max_loras": result.lora.max_loras if result.lora else None,
        "max_lora_rank": result.lora.max_lora_rank if result.lora else None,
        "max_cpu_loras": result.lora.max_cpu_loras if result.lora else None,
        # /v1/load_lora_adapter, which the operator loads adapters through, is served where there are
        # adapters (and the pods of a service without them keep the template they had).
        "runtime_lora_updating": result.lora is not None,
    }


def _stored_method(spec: InferenceServiceSpec) -> str | None:
    """The quant_method of the real config.json a spec's pod serves (MTP_TARGETS), if it has one."""
    real = str(spec.model.source).removeprefix("/models/")
    config = json.loads((HF_CONFIGS / f"{real}.json").read_text()) if real in MTP_TARGETS else {}
    return (config.get("quantization_config") or {}).get("quant_method")


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


def _config_of(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The config.json in the pod's model folder: a hybrid's real one, else one synthesized from the
    catalog's architecture."""
    if spec.model.name in HYBRIDS:
        return json.loads((HF_CONFIGS / f"{HYBRIDS[spec.model.name]}.json").read_text())
    real = str(spec.model.source).removeprefix("/models/")
    if real in MTP_TARGETS:
        return json.loads((HF_CONFIGS / f"{real}.json").read_text())
    return config_json(MODELS[spec.model.name], spec.model.quantization)


def _configured_as_planned(cases: list[tuple[InferenceServiceSpec, Plan]]) -> None:
    """Each plan's rendered container goes to vLLM's own parser and config builder, which must
    configure what the plan says."""
    lines, expected = [], {}
    for index, (spec, result) in enumerate(cases):
        container = render.deployment("svc", "ns", "uid", spec, result)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["vllm", "serve"], container["command"]
        models = {str(spec.model.source): _config_of(spec)}
        if result.draft_model:
            head = spec.serving.draft_model_architecture
            assert head is not None
            models[result.draft_model] = config_json(head)
        variables = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        lines.append(json.dumps({"id": str(index), "argv": container["args"], "models": models, "env": variables}))
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


def test_every_vllm_plan_that_fits_is_a_command_line_vllm_configures_as_planned() -> None:
    cases = _cases()
    _configured_as_planned(cases)
    # The matrix exercises what the runtime adds: tensor parallelism and every scheme.
    assert {r.gpu_count for _, r in cases} == set(VLLM_CAPABILITIES.tensor_parallel_sizes)
    assert {s.model.quantization or r.quantization for s, r in cases} >= {"none", "fp8", "int4", "awq", "gptq", "w8a8"}
    assert {r.kv_cache_dtype for _, r in cases} == set(VLLM_CAPABILITIES.kv_cache_dtypes)
    # Every speculative mode is configured on every GPU, tensor-parallel size and scheme.
    for choice in (lambda s, r: r.gpu, lambda s, r: r.gpu_count, lambda s, r: s.model.quantization or r.quantization):
        modes: dict[object, set[str]] = {}
        for spec, result in cases:
            modes.setdefault(choice(spec, result), set()).add(result.speculative)
        assert all(found == {"off", "ngram", "draft", "eagle"} for found in modes.values()), modes


def _hybrid_spec(
    model: str, gpu: str, tp: int | None, kv_cache_dtype: str, serving: dict[str, Any] | None = None
) -> InferenceServiceSpec:
    """`model` (HYBRIDS) on `gpu`, its 16-bit checkpoint's bytes known (its MTP modules' among them,
    where it has some), served as `serving` says besides."""
    config = json.loads((HF_CONFIGS / f"{HYBRIDS[model]}.json").read_text())
    read = read_config(config, HYBRIDS[model])
    assert not isinstance(read, str), read
    arch = read.architecture
    mtp = 2 * arch.mtp.parameters if arch.mtp else 0
    arch = arch.model_copy(update={"checkpoint_bytes": 2 * arch.parameters + mtp, "mtp_bytes": mtp or None})
    return InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {
                "name": model,
                "source": f"/models/{model}",
                "architecture": arch.model_dump(by_alias=True, exclude_none=True),
            },
            "accelerator": {"type": gpu, **({"count": tp} if tp else {})},
            "serving": {"kvCacheDtype": kv_cache_dtype, **(serving or {})},
        }
    )


def test_every_vllm_plan_of_a_hybrid_is_a_command_line_vllm_configures_as_planned() -> None:
    # The real config.json of Qwen3-Next and Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba-2) on every GPU, each
    # tensor-parallel choice and KV dtype: vLLM keeps the block size the plan raised for the state pages.
    specs = [
        _hybrid_spec(model, gpu, tp, kv)
        for model, gpu, tp, kv in product(HYBRIDS, GPUS, TENSOR_PARALLEL, ("auto", *VLLM_CAPABILITIES.kv_cache_dtypes))
    ]
    cases = [(spec, result) for spec in specs if (result := plan(spec)).fits]
    _configured_as_planned(cases)
    assert {s.model.name for s, _ in cases} == set(HYBRIDS)
    assert {r.quantization for _, r in cases} == {"none", "fp8"}
    assert {r.gpu_count for _, r in cases} >= {2, 4, 8} and {r.kv_cache_dtype for _, r in cases} == {"model", "fp8"}
    # Every block is one vLLM raised beside the state pages, well beyond the 16 asked for.
    assert all(r.block_size > 64 for _, r in cases)


def test_a_speculating_hybrids_plan_is_a_command_line_vllm_configures_as_planned() -> None:
    # Prompt lookup beside Gated DeltaNet and Mamba-2 layers, and Qwen3-Next's and Qwen3.5's MTP modules, k
    # of 1 and 3, on Hopper (FlashInfer's 64-token grid) and elsewhere, under a 16-bit and an FP8 KV cache:
    # vLLM raises the blocks for state pages widened by the drafts to the block the plan asked for.
    gpus, kv_dtypes = ("H100-80GB", "H200", "A100-80GB"), ("auto", "fp8")
    specs = [
        _hybrid_spec(model, gpu, None, kv, {"speculative": mode, "numSpeculativeTokens": k})
        for model, gpu, mode, k, kv in product(HYBRIDS, gpus, ("ngram", "mtp"), (1, 3), kv_dtypes)
        if (mode == "ngram" or model != "nemotron-h-56b") and (kv == "auto" or gpu != "A100-80GB")
    ]
    cases = [(spec, result) for spec in specs if (result := plan(spec)).fits]
    assert len(cases) == len(specs), [plan(s).reason for s in specs if not plan(s).fits]
    _configured_as_planned(cases)
    assert {r.speculative for _, r in cases} == {"ngram", "mtp"} and all(r.block_size > 64 for _, r in cases)
    assert {r.kv_cache_dtype for _, r in cases} == {"model", "fp8"}


# Adapter sets: one small adapter; more than the resident slots and the cached minimum, of mixed and
# unstated ranks (max_loras 4, rank 64, all 18 cached); one whose rank vLLM rounds up to its 320.
ADAPTER_SETS: list[list[dict[str, Any]]] = [
    [{"name": "sql", "source": "hf://org/sql-lora", "rank": 8}],
    [
        {"name": f"a{i}", "source": f"/adapters/a{i}", **({"rank": r} if r else {})}
        for i, r in enumerate((12, 64, None, 8, 16, 1) * 3)
    ],
    [{"name": "wide", "source": "pvc://adapters/wide", "rank": 300}],
]


def _with_adapters(spec: InferenceServiceSpec, adapters: list[dict[str, Any]]) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {**spec.model_dump(by_alias=True, exclude_unset=True), "adapters": adapters}
    )


def test_every_vllm_plan_with_adapters_is_a_command_line_vllm_configures_as_planned() -> None:
    # Dense models (the planner sizes no mixture of experts' slots), on every GPU, the planner's
    # tensor-parallel size and 2, each speculative choice vLLM runs beside adapters.
    dense = [m for m, a in MODELS.items() if a.active_parameters is None]
    specs = [
        _with_adapters(_spec(model, gpu, ("auto", None), speculation, tp, {}), adapters)
        for model, gpu, tp, speculation, adapters in product(dense, GPUS, (None, 2), SPECULATION[:2], ADAPTER_SETS)
    ]
    cases = [(spec, result) for spec in specs if (result := plan(spec)).fits]
    _configured_as_planned(cases)
    assert all(r.lora is not None for _, r in cases)
    assert {r.lora.max_lora_rank for _, r in cases if r.lora} == {8, 64, 320}
    assert {(r.lora.max_loras, r.lora.max_cpu_loras) for _, r in cases if r.lora} == {(4, 16), (4, 18)}
    assert {r.gpu_count for _, r in cases} >= {1, 2}
    # Speculation beside adapters is in the matrix (vLLM then wants k + 1 tokens of every sequence per step).
    assert {r.speculative for _, r in cases} == {"off", "ngram"}


def _llama(hidden: int, mlp: int, layers: int, heads: tuple[int, int], vocab: int, tied: bool) -> dict[str, Any]:
    """A Llama config.json and the planner's Architecture of it (its parameters counted as HF counts them)."""
    attention, kv_heads = heads
    head = hidden // attention
    per_layer = hidden * (attention + 2 * kv_heads) * head + attention * head * hidden + 3 * hidden * mlp + 2 * hidden
    parameters = vocab * hidden * (1 if tied else 2) + hidden + layers * per_layer
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": attention,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
    }
    arch = Architecture(
        layers=layers,
        hidden_size=hidden,
        attention_heads=attention,
        kv_heads=kv_heads,
        vocab_size=vocab,
        parameters=parameters,
        max_context=256,
        tie_word_embeddings=tied,
    )
    return {"config": config, "arch": arch}


def test_the_planned_lora_slots_are_the_bytes_vllm_allocates() -> None:
    # vLLM's own LoRAModelManager wraps a Llama built by vLLM itself on the CPU; the bytes of every slot
    # tensor it allocates are what the planner counts (planning/adapters.py), per shape and setting.
    shapes = [
        _llama(64, 192, 2, (4, 2), 512, False),
        _llama(128, 352, 3, (8, 8), 1000, True),
        _llama(96, 256, 2, (6, 1), 320, False),
    ]
    cases = [
        {"id": str(index), "config": shape["config"], "max_loras": slots, "max_lora_rank": rank}
        for index, (shape, slots, rank) in enumerate(product(shapes, (1, 3), (8, 64, 320)))
    ]
    out = env.run("lora_slots", "\n".join(json.dumps(case) for case in cases) + "\n")
    answers = {a["id"]: a for a in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert len(answers) == len(cases), out[-3000:]
    for index, (shape, slots, rank) in enumerate(product(shapes, (1, 3), (8, 64, 320))):
        answer = answers[str(index)]
        assert answer["modules"] == ["down_proj", "embed_tokens", "gate_up_proj", "lm_head", "o_proj", "qkv_proj"]
        assert slots * adapters.slot_bytes(shape["arch"], rank, 1, 2) == answer["bytes"], (shape["config"], slots, rank)


# Targets that draft with their own multi-token-prediction modules (speculative mtp), from their real
# config.json: latent attention and experts stored in FP8 (DeepSeek-V3: its repository's total_size, and
# its MTP layer's bytes as its parts' stored dtypes make them, experts in FP8 and its own embedding and
# head in 16 bits), and grouped-query attention at 16 bits (GLM-4.5-Air: every value and its MTP
# layer's embedding and head in 16 bits).
MTP_TARGETS = {"deepseek-ai--DeepSeek-V3": (688_586_727_753, 14_981_005_312), "zai-org--GLM-4.5-Air": None}


def _mtp_spec(name: str, gpu: str, tp: int | None, k: int) -> InferenceServiceSpec:
    read = read_config(json.loads((HF_CONFIGS / f"{name}.json").read_text()), name)
    assert not isinstance(read, str) and read.architecture.mtp is not None, read
    arch = read.architecture
    copies = 2 * arch.vocab_size * arch.hidden_size  # the MTP layer's own embedding and head, as stored
    total, mtp = MTP_TARGETS[name] or (
        (arch.parameters + arch.mtp.parameters + copies) * 2,
        (arch.mtp.parameters + copies) * 2,
    )
    architecture = arch.model_copy(update={"checkpoint_bytes": total, "mtp_bytes": mtp})
    return InferenceServiceSpec.model_validate(
        {
            "runtime": "vllm",
            "model": {
                "name": name.split("--")[1].lower(),
                "source": f"/models/{name}",
                "architecture": architecture.model_dump(by_alias=True, exclude_none=True),
                **({"quantization": read.quantization} if read.quantization else {}),
            },
            "accelerator": {"type": gpu, **({"count": tp} if tp else {})},
            "serving": {"speculative": "mtp", "numSpeculativeTokens": k},
        }
    )


def test_an_mtp_plan_is_a_command_line_vllm_configures_as_planned() -> None:
    cases = [
        (spec, result)
        for name, gpu, tp, k in product(MTP_TARGETS, ("H100-80GB", "H200"), (None, 8), (1, 3))
        if (result := plan(spec := _mtp_spec(name, gpu, tp, k))).fits
    ]
    # All but DeepSeek-V3 on H100s: its 688 GB do not fit 8 of them.
    assert {(s.model.source, r.gpu, r.num_speculative_tokens) for s, r in cases} == {
        (f"/models/{n}", g, k)
        for n in MTP_TARGETS
        for g in ("H100-80GB", "H200")
        for k in (1, 3)
        if (n, g) != ("deepseek-ai--DeepSeek-V3", "H100-80GB")
    }
    assert all(r.speculative == "mtp" and r.draft_weight_bytes > 0 for _, r in cases)
    _configured_as_planned(cases)
