"""The bytes of a checkpoint's safetensors weights from their metadata alone: a sharded checkpoint's
index states its total (`metadata.total_size`); a single file's header (its first 8 bytes give the
header's length, little-endian; the JSON header every tensor's byte range) sums its tensors. Of
them, the multi-token-prediction (MTP) modules' bytes, which vLLM does not load to serve the model
(it skips them unless it drafts with them), are summed from the headers of the files the index
puts them in. The hub client reads these files with range requests, `kvpilot plan --model-config
DIR` from the folder; neither reads a tensor."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# huggingface_hub's bound on a safetensors header (SAFETENSORS_MAX_HEADER_LENGTH).
MAX_HEADER_BYTES = 25_000_000
# Where checkpoints keep their MTP modules, as vLLM 0.33's loaders skip them: under a prefix of their
# own (Qwen3-Next, Qwen3.5 and Nemotron-H's `mtp.`, MiMo's `model.mtp_layers.`), or as decoder layers
# numbered from num_hidden_layers on (DeepSeek, GLM and MiniMax: get_spec_layer_idx_from_weight_name's
# prefixes, MiniMax M2's mapper).
MTP_PREFIXES = ("mtp.", "model.mtp_layers.")
# A shard's name in an index: a file beside it (a name read from a hub goes into a URL and a path).
SHARD_NAME = re.compile(r"[\w.-]+\.safetensors")
DECODER_LAYER = re.compile(r"(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")


class CheckpointWeights(NamedTuple):
    """The bytes of a checkpoint's safetensors weights, and of them its MTP modules' (0: none)."""

    total: int
    mtp: int = 0


def is_mtp(name: str, layers: int) -> bool:
    """Whether the tensor `name` is an MTP module's in a model of `layers` decoder layers."""
    if name.startswith(MTP_PREFIXES):
        return True
    layer = DECODER_LAYER.match(name)
    return layer is not None and int(layer.group(1)) >= layers


def mtp_files(index: Mapping[str, Any], layers: int) -> list[str]:
    """The files an index's weight_map puts MTP tensors in, sorted; ValueError when it is not a map, or
    one of them is not a safetensors file beside the index (it is read as a path or a URL)."""
    weight_map = index.get("weight_map") or {}
    if not isinstance(weight_map, dict):
        raise ValueError("weight_map is not a map of tensor names to files")
    files = sorted({str(file) for name, file in weight_map.items() if is_mtp(name, layers)})
    if not all(SHARD_NAME.fullmatch(file) for file in files):
        raise ValueError(f"weight_map puts MTP tensors in {files}, not all .safetensors files beside the index")
    return files


def index_total(index: Mapping[str, Any]) -> int:
    """The total an index states; ValueError when it states none."""
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        raise ValueError(f"metadata.total_size is {total!r}, not a byte count")
    return total


def header_length(first_bytes: bytes) -> int:
    """The header's length from a file's first 8 bytes; ValueError when it cannot be one."""
    length = int.from_bytes(first_bytes[:8], "little")
    if len(first_bytes) < 8 or not 2 <= length <= MAX_HEADER_BYTES:
        raise ValueError(f"a safetensors header of {length} bytes")
    return length


def tensors_bytes(header: Mapping[str, Any], counted: Callable[[str], bool] = lambda name: True) -> int:
    """The bytes of the tensors a header lists (its own metadata aside) whose names are `counted`."""
    try:
        return sum(
            end - start
            for name, tensor in header.items()
            if name != "__metadata__" and counted(name)
            for start, end in [tensor["data_offsets"]]
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"a tensor without data_offsets: {error}") from None


def header_weights(header: Mapping[str, Any], layers: int) -> CheckpointWeights:
    """A single file's weights (its header's tensors), and of them the MTP modules'."""
    return _checked(tensors_bytes(header), tensors_bytes(header, lambda name: is_mtp(name, layers)))


def index_weights(
    index: Mapping[str, Any], layers: int, header: Callable[[str], Mapping[str, Any]]
) -> CheckpointWeights:
    """A sharded checkpoint's weights: the total its index states, and the MTP modules' summed from
    the `header` of each shard that holds some; ValueError when they do not add up."""
    total = index_total(index)
    mtp = sum(tensors_bytes(header(shard), lambda name: is_mtp(name, layers)) for shard in mtp_files(index, layers))
    return _checked(total, mtp)


def _checked(total: int, mtp: int) -> CheckpointWeights:
    """The weights, where the model's own are some; ValueError otherwise."""
    if mtp >= total:
        raise ValueError(f"of {total:,} bytes of weights, {mtp:,} are multi-token-prediction modules': none left")
    return CheckpointWeights(total, mtp)


def local_weights(folder: Path, layers: int) -> CheckpointWeights | None:
    """The safetensors weights in `folder` of a model of `layers` decoder layers; None when it holds
    neither an index nor a single file; ValueError when one is malformed."""
    index = folder / INDEX_FILE
    if index.is_file():
        return index_weights(json.loads(index.read_text()), layers, lambda shard: _local_header(folder / shard))
    single = folder / SINGLE_FILE
    return header_weights(_local_header(single), layers) if single.is_file() else None


def _local_header(file: Path) -> dict[str, Any]:
    with file.open("rb") as opened:
        header = json.loads(opened.read(header_length(opened.read(8))))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the header is not a JSON object")
    return header
