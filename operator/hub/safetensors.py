"""The bytes of a checkpoint's safetensors weights from their metadata alone: a sharded checkpoint's
index states its total (`metadata.total_size`); a single file's header (its first 8 bytes give the
header's length, little-endian; the JSON header every tensor's byte range) sums its tensors. The
hub client reads these files with range requests, `kvpilot plan --model-config DIR` from the folder;
neither reads a tensor."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# huggingface_hub's bound on a safetensors header (SAFETENSORS_MAX_HEADER_LENGTH).
MAX_HEADER_BYTES = 25_000_000


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


def tensors_bytes(header: Mapping[str, Any]) -> int:
    """The bytes of every tensor a header lists (its own metadata aside)."""
    try:
        return sum(
            end - start
            for name, tensor in header.items()
            if name != "__metadata__"
            for start, end in [tensor["data_offsets"]]
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"a tensor without data_offsets: {error}") from None


def local_weights_bytes(folder: Path) -> int | None:
    """The bytes of the safetensors weights in `folder`; None when it holds neither an index nor a
    single file; ValueError when one is malformed."""
    index = folder / INDEX_FILE
    if index.is_file():
        return index_total(json.loads(index.read_text()))
    single = folder / SINGLE_FILE
    if not single.is_file():
        return None
    with single.open("rb") as file:
        header = json.loads(file.read(header_length(file.read(8))))
    if not isinstance(header, dict):
        raise ValueError(f"{single}: the header is not a JSON object")
    return tensors_bytes(header)
