"""A checkpoint's weights from its safetensors metadata: the total, and of it the multi-token-prediction
modules' that vLLM 0.33 does not load to serve the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.operator.hub.safetensors import CheckpointWeights, is_mtp, local_weights
from tests.operator.hub.checkpoints import write_safetensors, write_sharded

# (tensor name, decoder layers, an MTP module's): the names vLLM 0.33's loaders skip, as their code
# says (models/utils.py get_spec_layer_idx_from_weight_name; the `mtp.` and `model.mtp_layers.`
# mappers of qwen3_next.py, qwen3_5.py, nemotron_h.py and mimo.py; minimax_m2.py's `layers.N.`).
NAMES = [
    ("model.layers.61.embed_tokens.weight", 61, True),  # DeepSeek-V3's MTP layer: its own embedding
    ("model.layers.61.mlp.experts.255.down_proj.weight_scale_inv", 61, True),
    ("model.layers.60.mlp.experts.255.down_proj.weight", 61, False),
    ("model.layers.92.eh_proj.weight", 92, True),  # GLM-4.5
    ("model.language_model.layers.40.self_attn.q_proj.weight", 40, True),
    ("layers.62.block_sparse_moe.gate.weight", 62, True),
    ("mtp.layers.0.mlp.experts.0.up_proj.weight", 48, True),  # Qwen3-Next
    ("mtp.fc.weight", 48, True),
    ("model.mtp_layers.0.input_layernorm.weight", 36, True),  # MiMo
    ("model.embed_tokens.weight", 61, False),
    ("lm_head.weight", 61, False),
    # A vision tower's layers are numbered on their own: never the language model's MTP modules.
    ("vision_tower.vision_model.encoder.layers.40.mlp.fc1.weight", 32, False),
    ("model.visual.blocks.40.attn.qkv.weight", 32, False),
    ("model.vision_model.layers.40.mlp.weight", 32, False),
    ("model.layers.1000.mlp.weight", 61, True),
]


@pytest.mark.parametrize(("name", "layers", "mtp"), NAMES)
def test_mtp_modules_are_the_tensors_vllm_skips(name: str, layers: int, mtp: bool) -> None:
    assert is_mtp(name, layers) is mtp


def test_the_mtp_modules_bytes_are_summed_from_the_shards_that_hold_them(tmp_path: Path) -> None:
    # DeepSeek-V3's layout, two decoder layers long: its MTP layer (2) beside a decoder layer in the
    # last shard, whole with its own embedding and head.
    shards = {
        "model-00001-of-00002.safetensors": {"model.embed_tokens.weight": 4096, "model.layers.0.mlp.weight": 1000},
        "model-00002-of-00002.safetensors": {
            "model.layers.1.mlp.weight": 1000,
            "model.layers.2.mlp.weight": 1000,
            "model.layers.2.embed_tokens.weight": 4096,
            "model.layers.2.shared_head.head.weight": 4096,
            "lm_head.weight": 4096,
        },
    }
    total = write_sharded(tmp_path, shards)
    assert local_weights(tmp_path, layers=2) == CheckpointWeights(total, 1000 + 4096 + 4096)
    # Read with three decoder layers, layer 2 is one of them.
    assert local_weights(tmp_path, layers=3) == CheckpointWeights(total, 0)
    # Only the shards with MTP tensors are opened: a missing first shard goes unnoticed.
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    assert local_weights(tmp_path, layers=2) == CheckpointWeights(total, 9192)


def test_a_single_file_s_mtp_modules_come_from_its_header(tmp_path: Path) -> None:
    stored = write_safetensors(tmp_path / "model.safetensors", {"model.layers.0.w": (0, 64), "mtp.fc.weight": (64, 96)})
    assert local_weights(tmp_path, layers=1) == CheckpointWeights(stored, 32)
    assert local_weights(tmp_path / "nothing", layers=1) is None


def test_an_index_that_does_not_add_up_is_an_error(tmp_path: Path) -> None:
    total = write_sharded(tmp_path, {"model-00001-of-00001.safetensors": {"model.layers.1.w": 10, "mtp.w": 10}})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = 10  # fewer than its MTP modules' and the model's
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="10 are multi-token-prediction modules'"):
        local_weights(tmp_path, layers=2)
    index["metadata"]["total_size"] = total
    index["weight_map"]["mtp.w"] = "../../etc/passwd"  # read as a path beside the index, or a URL
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="files beside the index"):
        local_weights(tmp_path, layers=2)
