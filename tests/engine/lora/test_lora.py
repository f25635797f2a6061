"""LoRA adapters in the engine: greedy output of every request equals HF + PEFT with its adapter,
however requests of several adapters and of the base model share a batch; prefix-cached KV is never
shared across adapters; adapters load and unload while requests run; a malformed adapter is refused
with a clear error while the others keep serving."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.lora.adapter import AdapterError, AdapterNotFoundError, load_adapter
from kvpilot.engine.lora.registry import UnknownAdapterError
from tests.engine.conftest import make_prompts
from tests.engine.lora_fixtures import SPECS, make_adapter
from tests.engine.oracle import Reference, check_greedy, greedy_reference

KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (its folder, the PEFT model it came from)."""
    root = tmp_path_factory.mktemp("adapters")
    return {spec.name: (root / spec.name, make_adapter(model_dir, spec, root / spec.name)) for spec in SPECS}


@pytest.fixture(scope="module")
def reference(adapters, hf_model):
    """(adapter or None, prompt, max tokens) -> HF's (+ PEFT's) greedy continuation, cached."""
    cache: dict[tuple[str | None, tuple[int, ...], int], Reference] = {}

    def run(lora: str | None, prompt: list[int], max_tokens: int) -> Reference:
        key = (lora, tuple(prompt), max_tokens)
        if key not in cache:
            model = hf_model if lora is None else adapters[lora][1]
            cache[key] = greedy_reference(model, prompt, max_tokens)
        return cache[key]

    return run


def lora_llm(adapters, **overrides: object) -> LLM:
    options = {
        "enable_lora": True,
        "max_loras": 2,
        "lora_modules": [f"{name}={folder}" for name, (folder, _) in adapters.items()],
        "dtype": "float32",
        "kv_cache_memory_bytes": KV_BYTES,
    }
    return LLM(**(options | overrides))


def count_adapters_per_step(llm: LLM) -> list[int]:
    """A list that gets the number of adapters of every step the engine runs from now on."""
    counts: list[int] = []
    resident = llm.engine.runner.resident
    activate = resident.activate

    def counted(step_adapters):
        counts.append(len(step_adapters))
        return activate(step_adapters)

    resident.activate = counted
    return counts


def check_all(outputs, prompts, loras, max_tokens, reference) -> None:
    reports = []
    for i, (out, prompt, lora) in enumerate(zip(outputs, prompts, loras)):
        ref = reference(lora, prompt, max_tokens[i])
        label = f"prompt {i} ({len(prompt)} tokens, adapter {lora})"
        report = check_greedy(out.outputs[0].token_ids, ref.tokens, ref.logits, label)
        if report:
            reports.append(report)
    for report in reports:
        warnings.warn(report, stacklevel=2)


def test_two_adapters_and_the_base_model_in_one_batch_equal_hf_peft(adapters, reference, corpus_ids):
    lengths = [5, 40, 17, 64, 9, 100, 31, 23, 48]
    prompts = make_prompts(corpus_ids, lengths)
    loras = ["alpha", "beta", None] * 3
    max_tokens = [8 + (3 * i) % 9 for i in range(len(prompts))]
    # A small token budget: chunked prefills of one adapter share steps with decodes of the others.
    llm = lora_llm(adapters, max_num_batched_tokens=64)
    adapters_per_step = count_adapters_per_step(llm)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outputs = llm.generate(prompts, params, lora_name=loras)
    check_all(outputs, prompts, loras, max_tokens, reference)
    assert 2 in adapters_per_step, "no step ran both adapters together"
    # The adapters matter: each changes the greedy tokens of some prompt.
    for name in ("alpha", "beta"):
        differs = [reference(name, p, 12).tokens != reference(None, p, 12).tokens for p in prompts[:3]]
        assert any(differs), f"adapter {name} changes no prompt's tokens: the test would not see a missing delta"


def test_max_loras_keeps_one_adapter_per_step(adapters, reference, corpus_ids):
    prompts = make_prompts(corpus_ids, [12, 30, 7, 25])
    loras = ["alpha", "beta", "beta", None]
    llm = lora_llm(adapters, max_loras=1)
    seen = count_adapters_per_step(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), lora_name=loras)
    check_all(outputs, prompts, loras, [10] * 4, reference)
    assert seen and max(seen) == 1, f"steps ran {max(seen)} adapters with max_loras=1"


def test_prefix_cache_is_not_shared_across_adapters(adapters, reference, corpus_ids):
    prompt = corpus_ids[:80]
    llm = lora_llm(adapters)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    cached = {}
    for lora in (None, "alpha", "beta", "alpha"):
        out = llm.generate([prompt], params, lora_name=lora)[0]
        check_all([out], [prompt], [lora], [6], reference)
        cached.setdefault(lora, []).append(out.num_cached_tokens)
    assert cached["alpha"][0] == 0 and cached["beta"][0] == 0, f"an adapter got another model's KV: {cached}"
    assert cached["alpha"][1] >= 64, f"alpha's second request should reuse alpha's own blocks: {cached}"


def test_load_and_unload_while_requests_run(adapters, reference, corpus_ids):
    llm = lora_llm(adapters, lora_modules=[f"alpha={adapters['alpha'][0]}"])
    engine = llm.engine
    prompts = make_prompts(corpus_ids, [20, 33, 14])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = engine.add_request(prompts[0], params, lora_name="alpha")
    base = engine.add_request(prompts[1], params)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_lora("beta", str(adapters["beta"][0]))  # loaded while alpha's request runs
    late = engine.add_request(prompts[2], params, lora_name="beta")
    engine.remove_lora("alpha")  # unloaded while its request runs: that request finishes with it
    with pytest.raises(UnknownAdapterError, match="cannot be found"):
        engine.add_request(prompts[2], params, lora_name="alpha")
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for request, lora, prompt in ((first, "alpha", prompts[0]), (base, None, prompts[1]), (late, "beta", prompts[2])):
        ref = reference(lora, prompt, 12)
        check_greedy(tokens[request.request_id], ref.tokens, ref.logits, f"{request.request_id} ({lora})")
    assert engine.loras.names() == {"beta": str(adapters["beta"][0])}


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _q(layer: int = 0, rank: int = 4, out: int = 576) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.ones(rank, 576), f"{prefix}.lora_B.weight": torch.ones(out, rank)}


GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", "use_dora": False}
MALFORMED = {
    "dora": ({**GOOD, "use_dora": True}, _q(), "use_dora=True is not supported"),
    "bias": ({**GOOD, "bias": "all"}, _q(), "bias='all' is not supported"),
    "rank above the maximum": ({**GOOD, "r": 32}, _q(rank=32), "rank 32 is above max_lora_rank=16"),
    "rank pattern": ({**GOOD, "rank_pattern": {"q_proj": 2}}, _q(), "rank_pattern is not supported"),
    "not lora": ({**GOOD, "peft_type": "IA3"}, _q(), "is not LORA"),
    "embedding target": (
        GOOD,
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 49152)},
        "not a LoRA weight of a decoder projection",
    ),
    "lm_head target": (
        GOOD,
        {"base_model.model.lm_head.lora_A.weight": torch.ones(4, 576)},
        "not a LoRA weight of a decoder projection",
    ),
    "wrong shape": (GOOD, _q(out=100), "do not fit rank 4"),
    "layer past the model": (GOOD, _q(layer=30), "the base model has 30 layers"),
    "A without B": (GOOD, {k: v for k, v in _q().items() if "lora_A" in k}, "without its pair"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_adapters_are_refused_with_what_is_wrong(case, tmp_path, hf_model):
    config, tensors, message = MALFORMED[case]
    folder = _write(tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=message):
        load_adapter("bad", str(folder), hf_model.config, 16, torch.float32)


def test_missing_and_unreadable_adapters(tmp_path, hf_model):
    with pytest.raises(AdapterNotFoundError, match="No adapter found"):
        load_adapter("gone", str(tmp_path / "nowhere"), hf_model.config, 16, torch.float32)
    folder = tmp_path / "garbage"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(GOOD))
    (folder / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(AdapterError, match="cannot be read as safetensors"):
        load_adapter("garbage", str(folder), hf_model.config, 16, torch.float32)


def test_a_malformed_adapter_is_refused_while_the_others_keep_serving(adapters, reference, corpus_ids, tmp_path):
    llm = lora_llm(adapters)
    prompt = make_prompts(corpus_ids, [21])[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    running = llm.engine.add_request(prompt, params, lora_name="beta")
    tokens = [t for out in llm.engine.step() for t in out.new_token_ids]
    bad = _write(tmp_path / "dora", {**GOOD, "use_dora": True}, _q())
    with pytest.raises(AdapterError, match="use_dora"):
        llm.engine.add_lora("dora", str(bad))
    with pytest.raises(AdapterError, match="already been loaded"):
        llm.engine.add_lora("alpha", str(adapters["alpha"][0]))
    assert set(llm.engine.loras.names()) == {"alpha", "beta"}
    while llm.engine.has_unfinished():
        tokens += [t for out in llm.engine.step() if out.request_id == running.request_id for t in out.new_token_ids]
    ref = reference("beta", prompt, 8)
    check_greedy(tokens, ref.tokens, ref.logits, "beta after a refused load")
    out = llm.generate([prompt], params, lora_name="alpha")[0]
    check_all([out], [prompt], ["alpha"], [8], reference)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="compile_decode is not supported"):
        EngineConfig(enable_lora=True, compile_decode=True)
    with pytest.raises(ValueError, match="not name=path"):
        EngineConfig(enable_lora=True, lora_modules=["nopath"])
    assert EngineConfig(enable_lora=True, max_loras=3).cpu_loras == 3


def test_unknown_adapter_and_lora_off(corpus_ids):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=KV_BYTES)
    assert llm.engine.runner.lora_batch is None, "without enable_lora the model must stay unwrapped"
    with pytest.raises(UnknownAdapterError, match="cannot be found"):
        llm.engine.add_request(corpus_ids[:5], lora_name="alpha")
    with pytest.raises(ValueError, match="need enable_lora"):
        llm.engine.add_lora("alpha", "/nowhere")
