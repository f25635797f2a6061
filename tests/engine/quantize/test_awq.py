"""AWQ for INT4 checkpoints: the folded scales keep the model's function, the search lowers each
layer's output error against round-to-nearest, and the result is a plain W4A16 checkpoint."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer
from transformers import LlamaForCausalLM as HFLlama

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cli import main
from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import load_config, load_model
from kvpilot.engine.quantize.awq import apply_awq, prefill_batch
from kvpilot.engine.quantize.calibration import PASSAGES
from kvpilot.engine.quantize.writer import int4_round_trip, weight_args
from kvpilot.engine.tools.eval_tasks import CAPITALS
from kvpilot.engine.tools.evaluation import corpus_text
from tests.engine.oracle import check_greedy, greedy_reference
from tests.engine.test_tiny_llama import GQA_BIASES, make_tiny_llama

GROUP = 32
ROUND_TRIP = functools.partial(int4_round_trip, args=weight_args("int4", GROUP))
ARCHS = {
    # Grouped queries: o_proj's scales are shared by the query heads of a kv head.
    "gqa-biases": GQA_BIASES,
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16),
}


def _tiny_model_folder(folder: Path, tokenizer_dir: Path, **arch: object) -> Path:
    """A tiny random Llama with the activation outliers real models have (a few channels of each
    norm and of up_proj much larger), so the search has something to find; biases (HF starts them
    at zero) random, so that folding into them shows."""
    model = make_tiny_llama(folder, tokenizer_dir, **arch)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.uniform_(-0.5, 0.5)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] *= 12
            layer.mlp.up_proj.weight[[5, 77]] *= 8
    model.save_pretrained(folder)
    return folder


def _calibration_ids(tokenizer_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer.encode(passage, add_special_tokens=False) for passage in PASSAGES]


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(folder, load_config(folder), dtype, torch.device("cpu"))


def _logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    return model.logits(model(*prefill_batch(model, prompts)))


def _linear_inputs(model: LlamaForCausalLM, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """What each body linear layer reads on `prompts`."""
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, name=name: captured.__setitem__(name, args[0].clone()))
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module is not model.lm_head
    ]
    _logits(model, prompts)
    for hook in hooks:
        hook.remove()
    return captured


def _decoder_layer_outputs(
    model: LlamaForCausalLM, prompts: list[list[int]], inputs: list[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each decoder layer's input and output on `prompts`; given `inputs`, each layer reads those
    instead of the previous layer's output, so its error is its own."""
    seen: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []

    def feed(_module: torch.nn.Module, args: tuple, index: int) -> tuple:
        args = args if inputs is None else (inputs[index], *args[1:])
        seen.append(args[0].clone())
        return args

    hooks = [
        hook
        for index, layer in enumerate(model.model.layers)
        for hook in (
            layer.register_forward_pre_hook(lambda m, args, index=index: feed(m, args, index)),
            layer.register_forward_hook(lambda _m, _args, output: outputs.append(output.clone())),
        )
    ]
    _logits(model, prompts)
    for hook in hooks:
        hook.remove()
    return seen, outputs


def test_calibration_text_is_not_what_eval_scores():
    words = corpus_text().split()
    eval_phrases = {tuple(words[i : i + 8]) for i in range(len(words) - 7)}
    for passage in PASSAGES:
        passage_words = passage.split()
        shared = [
            p for p in (tuple(passage_words[i : i + 8]) for i in range(len(passage_words) - 7)) if p in eval_phrases
        ]
        assert not shared, shared[:3]
        assert not re.search(r"\bcapital\b", passage, re.IGNORECASE)
        assert not any(re.search(rf"\b{re.escape(city)}\b", passage) for _, city in CAPITALS)


@pytest.mark.parametrize("arch", ARCHS)
def test_folded_scales_leave_the_unquantized_function_unchanged(arch, tmp_path, model_dir):
    # In float64: in fp32 the logits themselves are only good to ~1e-4 of their range (fp32 against
    # fp64 differs by 1.6e-3 at a largest logit of 13 on this model); in float64 (attention and
    # norms still reduce in fp32 on CPU) the fold moves them by < 1e-5 of it, where a fold 1 % off
    # in a single channel moves them by far more (checked below).
    model = _load(_tiny_model_folder(tmp_path, model_dir, **ARCHS[arch]), torch.float64)
    prompts = _calibration_ids(model_dir)
    before = _logits(model, prompts)
    report = apply_awq(model, prompts, ROUND_TRIP, GROUP, clip=False)
    # Every kind of fold was exercised: norm -> qkv, v -> o, norm -> gate/up, up -> down.
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert any(g.alpha > 0 for g in report.groups if g.name.endswith(kind)), kind
    tolerance = 1e-5 * before.abs().max().item()
    assert (_logits(model, prompts) - before).abs().max() <= tolerance
    model.model.layers[1].post_attention_layernorm.weight.data[17] *= 1.01
    assert (_logits(model, prompts) - before).abs().max() > 10 * tolerance


def _round_to_nearest(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with each body linear weight replaced by what an INT4 checkpoint stores for it."""
    for module in model.modules():
        if isinstance(module, Linear) and module is not model.lm_head:
            module.weight.data = ROUND_TRIP(module.weight.data)
    return model


@pytest.mark.parametrize("clip", [False, True], ids=["scales", "scales+clip"])
def test_awq_lowers_each_layers_output_error_against_round_to_nearest(clip, tmp_path, model_dir):
    folder = _tiny_model_folder(tmp_path, model_dir, **ARCHS["gqa-biases"])
    original, model = _load(folder), _load(folder)
    prompts = _calibration_ids(model_dir)
    report = apply_awq(model, prompts, ROUND_TRIP, GROUP, clip=clip)
    assert len(report.groups) == 2 * 4 and report.tokens == sum(map(len, prompts))
    # What the search minimises, per group of linear layers: never above round-to-nearest, and
    # clearly below it over the model (the outliers cost RTN).
    assert all(g.awq_error <= g.rtn_error for g in report.groups)
    assert sum(g.awq_error for g in report.groups) < 0.9 * sum(g.rtn_error for g in report.groups)
    # The search's error, measured apart from it where a layer's weights are final as searched (v's
    # and up's rows are divided later by o's and down's scales): the output on the calibration
    # inputs against the full-precision layer's.
    inputs, scaled_inputs = _linear_inputs(original, prompts), _linear_inputs(model, prompts)
    for result in report.groups:
        name = result.name
        if clip or not name.endswith(("o_proj", "down_proj")):
            continue  # clipping changes the layers' inputs downstream; the measure is the same
        weight = original.get_submodule(name).weight
        reference = inputs[name] @ weight.T
        rtn = ((inputs[name] @ ROUND_TRIP(weight).T - reference) ** 2).mean().item()
        awq = ((scaled_inputs[name] @ ROUND_TRIP(model.get_submodule(name).weight).T - reference) ** 2).mean().item()
        assert (awq, rtn) == pytest.approx((result.awq_error, result.rtn_error), rel=1e-3), name
    # Each decoder layer quantized, on the full-precision model's inputs to it: its output error.
    layer_inputs, reference = _decoder_layer_outputs(original, prompts)
    _, rtn = _decoder_layer_outputs(_round_to_nearest(_load(folder)), prompts, layer_inputs)
    _, awq = _decoder_layer_outputs(_round_to_nearest(model), prompts, layer_inputs)
    for index, (ref, r, a) in enumerate(zip(reference, rtn, awq)):
        assert ((a - ref) ** 2).mean() < ((r - ref) ** 2).mean(), f"decoder layer {index}"


def _read_back_with_compressed_tensors(checkpoint: Path, folder: Path) -> HFLlama:
    """The checkpoint as a plain HF Llama: each quantized module decompressed by compressed-tensors'
    own decompressor, every other tensor as stored."""
    raw = json.loads((checkpoint / "config.json").read_text())
    (group,) = QuantizationConfig.model_validate(raw.pop("quantization_config")).config_groups.values()
    stored: dict[str, torch.Tensor] = {}
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            stored.update({name: f.get_tensor(name) for name in f.keys()})
    state = {}
    for module in {n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")}:
        local = {k.removeprefix(f"{module}."): stored.pop(k) for k in list(stored) if k.startswith(f"{module}.weight")}
        state[f"{module}.weight"] = PackedQuantizationCompressor.decompress(local, group)["weight"].float()
    state.update(stored)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return HFLlama.from_pretrained(folder, dtype=torch.float32).eval()


def test_awq_checkpoint_is_plain_w4a16_and_reloads_to_identical_outputs(tmp_path, model_dir):
    source, output = _tiny_model_folder(tmp_path / "source", model_dir, **ARCHS["gqa-biases"]), tmp_path / "awq"
    assert main(["quantize", str(output), "--model", str(source), "--scheme", "int4", "--method", "awq"]) == 0
    raw = json.loads((output / "config.json").read_text())["quantization_config"]
    (group,) = QuantizationConfig.model_validate(raw).config_groups.values()
    assert raw["format"] == "pack-quantized" and raw["ignore"] == ["lm_head"]
    assert (group.weights.num_bits, group.weights.group_size, group.weights.symmetric) == (4, GROUP, False)
    with (
        safe_open(output / "model.safetensors", framework="pt") as stored,
        safe_open(source / "model.safetensors", framework="pt") as src,
    ):
        names = set(stored.keys())
        # The scales folded into the norms (and v's and up's biases); nothing but the format's tensors added.
        assert not torch.equal(
            stored.get_tensor("model.layers.0.input_layernorm.weight"),
            src.get_tensor("model.layers.0.input_layernorm.weight"),
        )
        assert not torch.equal(
            stored.get_tensor("model.layers.1.mlp.up_proj.bias"), src.get_tensor("model.layers.1.mlp.up_proj.bias")
        )
        assert {
            n for n in names if not n.endswith(("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"))
        } == {n for n in src.keys() if not (n.endswith("proj.weight"))}

    # A reader other than the engine (compressed-tensors' decompressor, HF's Llama) computes what the engine serves.
    hf = _read_back_with_compressed_tensors(output, tmp_path / "decompressed")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [ids[:40] for ids in _calibration_ids(model_dir)[:3]]
    llm = LLM(str(output), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.runner.model.quantization == "int4"
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, first):
        ref = greedy_reference(hf, prompt, 16, min_new_tokens=16)
        check_greedy(tokens, ref.tokens, ref.logits, "awq checkpoint")
    again = LLM(str(output), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params)] == first


def test_awq_is_for_int4(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "out"), "--scheme", "int8", "--method", "awq"]) == 2
    assert "awq calibrates int4 checkpoints" in capsys.readouterr().err
