"""Compressed-tensors checkpoints: `kvpilot quantize` writes them, the engine loads them (ours and
ones made by compressed-tensors' own compressor) without re-calibration."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cli import main
from kvpilot.engine.model.compressed_tensors import checkpoint_quantization
from kvpilot.engine.model.layers import Linear
from tests.engine.test_tiny_llama import GQA_BIASES, make_tiny_llama

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
SMALL_KV = 32 << 20
# Checkpoint bytes of the quantized layers (values, scales, zero points) over their fp16 size.
MAX_STORED_RATIO = {"int8": 0.55, "int4": 0.30}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    """The embedded model written by `kvpilot quantize` at int4 group 32 and at int8 (once per session),
    round-to-nearest: these tests hold the format to the source weights; AWQ is tested in test_awq.py."""
    root = tmp_path_factory.mktemp("quantized")
    written = {}
    for scheme in ("int4", "int8"):
        written[scheme] = root / scheme
        assert (
            main(["quantize", str(written[scheme]), "--scheme", scheme, "--group-size", "32", "--method", "rtn"]) == 0
        )
    return written


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as checkpoint:
            out.update({name: checkpoint.get_tensor(name) for name in checkpoint.keys()})
    return out


def _tensors_of(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as checkpoint:
        return list(checkpoint.keys())


def _linears(llm: LLM) -> dict[str, Linear]:
    return {name: m for name, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantize_writes_what_compressed_tensors_reads(scheme, checkpoints, model_dir):
    folder = checkpoints[scheme]
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    assert raw["quant_method"] == "compressed-tensors" and config.format == "pack-quantized"
    assert config.quantization_status == "compressed" and config.ignore == ["lm_head"]
    (group,) = config.config_groups.values()
    expected = (4, "group", 32, False) if scheme == "int4" else (8, "channel", None, True)
    assert (
        group.weights.num_bits,
        group.weights.strategy,
        group.weights.group_size,
        group.weights.symmetric,
    ) == expected
    assert group.input_activations is None

    stored, source = _tensors(folder), _tensors(model_dir)
    modules = {name.removesuffix(".weight_packed") for name in stored if name.endswith(".weight_packed")}
    assert len(modules) == 30 * 7 and not any(f"{m}.weight" in stored for m in modules)
    assert "lm_head.weight_packed" not in stored
    # compressed-tensors' own decompressor reads our tensors back to the weights: within half a
    # step, plus the bf16 rounding of the scale (2^-8 of it) times the largest level (15 or 127).
    module = "model.layers.3.mlp.down_proj"
    local = {k.removeprefix(f"{module}."): v for k, v in stored.items() if k.startswith(f"{module}.")}
    weight = PackedQuantizationCompressor.decompress({**local, "weight_scale": local["weight_scale"].float()}, group)[
        "weight"
    ]
    step = (
        local["weight_scale"].float().repeat_interleave(32, dim=1)
        if scheme == "int4"
        else local["weight_scale"].float()
    )
    levels = 15 if scheme == "int4" else 127
    error = (weight - source[f"{module}.weight"]).abs()
    assert (error <= step * (0.5 + levels / 256) + 1e-7).all()
    assert error.mean() < 0.3 * step.mean()  # rounding, not garbage within the bound

    fp16 = sum(source[f"{m}.weight"].numel() * 2 for m in modules)
    quantized = sum(t.numel() * t.element_size() for name, t in stored.items() if name.rpartition(".")[0] in modules)
    assert quantized <= MAX_STORED_RATIO[scheme] * fp16, f"{scheme}: {quantized / fp16:.3f}x of fp16"


def test_int8_checkpoint_loads_bit_identical_to_load_time_quantization(checkpoints):
    loaded = LLM(str(checkpoints["int8"]), dtype="float32", kv_cache_memory_bytes=SMALL_KV)  # --quantization follows it
    at_load = LLM(quantization="int8", dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    assert loaded.engine.runner.model.quantization == "int8"
    ours, theirs = dict(loaded.engine.runner.model.named_buffers()), dict(at_load.engine.runner.model.named_buffers())
    quantized = [name for name in theirs if name.endswith(("qweight", "scales"))]
    assert len(quantized) == 2 * (30 * 4 + 1)  # qkv, o, gate_up, down per layer; the LM head
    assert all(torch.equal(ours[name], theirs[name]) for name in quantized)
    tokens = [o.outputs[0].token_ids for o in loaded.generate(PROMPTS, GREEDY)]
    assert tokens == [o.outputs[0].token_ids for o in at_load.generate(PROMPTS, GREEDY)]
    assert "Paris" in loaded.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text


def test_int4_checkpoint_loads_the_values_it_stores(checkpoints):
    """INT4 checkpoints hold integer zero points (the format's), so the reference is the checkpoint's
    own dequantized weights, (q - zp) x scale, not the engine's float-zero load-time INT4."""
    llm = LLM(str(checkpoints["int4"]), dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    assert llm.engine.runner.model.quantization == "int4"
    stored = _tensors(checkpoints["int4"])
    (group,) = QuantizationConfig.model_validate(
        json.loads((checkpoints["int4"] / "config.json").read_text())["quantization_config"]
    ).config_groups.values()
    layers = _linears(llm)
    for fused, parts in {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.down_proj": ("down_proj",)}.items():
        name = f"model.layers.7.{fused}"
        refs, steps = [], []
        for part in parts:
            module = f"model.layers.7.{fused.split('.')[0]}.{part}"
            local = {k.removeprefix(f"{module}."): v for k, v in stored.items() if k.startswith(f"{module}.")}
            refs.append(
                PackedQuantizationCompressor.decompress(
                    {**local, "weight_scale": local["weight_scale"].float()}, group
                )["weight"]
            )
            steps.append(local["weight_scale"].float().repeat_interleave(32, dim=1))
        ref, step = torch.cat(refs), torch.cat(steps)
        engine = layers[name].quantization.dequantized(layers[name])
        # Off by the bf16 rounding of each zero (<= step / 32) and of the read-back weight (2^-8 relative).
        assert ((engine - ref).abs() <= step / 32 + ref.abs() / 256 + 1e-7).all(), name
    assert layers["lm_head"].quantization.name == "int8"  # not in the checkpoint: INT8 at load time
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    again = LLM(str(checkpoints["int4"]), dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    assert first == [o.outputs[0].token_ids for o in again.generate(PROMPTS, GREEDY)]
    assert "Paris" in again.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text


def _compress_with_compressed_tensors(
    hf_model, folder: Path, weights: QuantizationArgs, fmt: str
) -> dict[str, torch.Tensor]:
    """llm-compressor's save path, without llm-compressor: attach the scheme, set min-max scales,
    compress with ModelCompressor, save. Returns each quantized module's fake-quantized weight."""
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(hf_model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    reference = {}
    for name, module in hf_model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        g = weights.group_size if weights.strategy == "group" else w.shape[1]
        groups = w.view(w.shape[0], -1, g)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), weights)
        module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.view_as(module.weight_zero_point))
        reference[name] = fake_quantize(
            w, module.weight_scale, getattr(module, "weight_zero_point", None), weights
        ).float()
    compressor = ModelCompressor.from_pretrained_model(hf_model, quantization_format=fmt)
    compressor.compress_model(hf_model)
    hf_model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return reference


@pytest.mark.parametrize(
    "weights, fmt",
    [
        (
            QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=64),
            "pack-quantized",
        ),  # W4A16, smaller group
        (
            QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
            "pack-quantized",
        ),  # W4A16_ASYM
        (QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"), "pack-quantized"),  # W8A16
        (QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"), "int-quantized"),  # one int8 per value
    ],
    ids=["w4a16-sym-g64", "w4a16-asym-g32", "w8a16", "w8a16-int-quantized"],
)
def test_checkpoint_made_by_compressed_tensors_loads(weights, fmt, tmp_path, model_dir):
    # Biases too: they stay full precision beside the quantized weights of their module.
    hf_model = make_tiny_llama(tmp_path, model_dir, **GQA_BIASES)
    reference = _compress_with_compressed_tensors(hf_model, tmp_path, weights, fmt)
    stored = _tensors(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == fmt
    values = "weight_packed" if fmt == "pack-quantized" else "weight"
    assert stored[f"model.layers.0.mlp.down_proj.{values}"].dtype == (
        torch.int32 if fmt == "pack-quantized" else torch.int8
    )
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.runner.model.quantization == ("int8" if weights.num_bits == 8 else "int4")
    layers = _linears(llm)
    for layer in range(2):
        for fused, parts in {
            "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "self_attn.o_proj": ("o_proj",),
            "mlp.gate_up_proj": ("gate_proj", "up_proj"),
            "mlp.down_proj": ("down_proj",),
        }.items():
            name = f"model.layers.{layer}.{fused}"
            ref = torch.cat([reference[f"model.layers.{layer}.{fused.split('.')[0]}.{part}"] for part in parts])
            engine = layers[name].quantization.dequantized(layers[name])
            # The kernel reads bf16: scales and zeros round to it, and the read-back weight too.
            assert torch.allclose(engine, ref, rtol=2**-7, atol=ref.abs().max() * 2**-6), name
            bias = torch.cat([stored[f"model.layers.{layer}.{fused.split('.')[0]}.{part}.bias"] for part in parts])
            assert torch.equal(layers[name].bias, bias), name
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_mismatched_quantization_flag_is_a_clear_error(checkpoints, capsys):
    with pytest.raises(
        ValueError, match="compressed-tensors int4 group 32 checkpoint, but --quantization int8 was asked"
    ):
        LLM(str(checkpoints["int4"]), quantization="int8", kv_cache_memory_bytes=SMALL_KV)
    with pytest.raises(ValueError, match="--quantization int4 group 64 was asked"):
        LLM(str(checkpoints["int4"]), quantization="int4", quantization_group_size=64, kv_cache_memory_bytes=SMALL_KV)
    assert main(["generate", "--model", str(checkpoints["int8"]), "--quantization", "int4"]) == 2
    assert "compressed-tensors int8 checkpoint, but --quantization int4 group 32 was asked" in capsys.readouterr().err


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq' are not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True},
                    }
                },
            },
            "quantizes activations",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "strategy": "group", "group_size": 128},
                    }
                },
            },
            "are not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    }
                },
            },
            "not supported",
        ),
    ],
)
def test_unsupported_quantized_checkpoints_are_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(SimpleNamespace(quantization_config=quantization_config))
    assert checkpoint_quantization(SimpleNamespace()) is None


def test_quantize_rewrites_a_sharded_folder_and_its_index(tmp_path, model_dir):
    source, output = tmp_path / "source", tmp_path / "quantized"
    hf_model = make_tiny_llama(
        source, model_dir, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False
    )
    (source / "model.safetensors").unlink()
    hf_model.save_pretrained(source, max_shard_size="2MB")  # several files and an index instead
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) > 1
    assert main(["quantize", str(output), "--model", str(source), "--scheme", "int4"]) == 0
    assert sorted(p.name for p in output.glob("*.safetensors")) == shards
    weight_map = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {name: file for file in shards for name in _tensors_of(output / file)}
    assert "model.layers.1.mlp.up_proj.weight_packed" in weight_map and "lm_head.weight" in weight_map
    llm = LLM(str(output), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.runner.model.quantization == "int4"
    assert main(["quantize", str(output), "--model", str(source)]) == 2  # never over an existing checkpoint


def test_packed_values_that_do_not_hold_the_layer_are_refused(tmp_path, model_dir):
    # The loader takes a layer's shape from the model, not from the checkpoint's weight_shape: the
    # packed width is checked against it instead.
    source, output = tmp_path / "source", tmp_path / "quantized"
    make_tiny_llama(source, model_dir, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert main(["quantize", str(output), "--model", str(source), "--scheme", "int4", "--method", "rtn"]) == 0
    tensors = _tensors(output)
    name = "model.layers.0.mlp.down_proj.weight_packed"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, output / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not hold 4-bit values of shape"):
        LLM(str(output), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
