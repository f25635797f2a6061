"""Safetensors checkpoints on disk as their metadata describes them, for the readers of that metadata
(operator/hub/safetensors.py, the hub client through the Hub stand-in)."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

from kvpilot.operator.hub.safetensors import INDEX_FILE


def write_safetensors(path: Path, tensors: Mapping[str, tuple[int, int]], data: bool = True) -> int:
    """A file with the safetensors header `tensors` describes (name -> (start, end) bytes), and that
    many zero bytes after it unless not `data` (a reader of the metadata never reads them); the bytes
    of its tensors."""
    header = {
        name: {"dtype": "BF16", "shape": [(end - start) // 2], "data_offsets": [start, end]}
        for name, (start, end) in tensors.items()
    }
    encoded = json.dumps(header).encode()
    length = max(end for _, end in tensors.values()) if data else 0
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(length))
    return sum(end - start for start, end in tensors.values())


def write_sharded(folder: Path, shards: Mapping[str, Mapping[str, int]]) -> int:
    """A sharded checkpoint in `folder`: each shard (file -> tensor name -> bytes) a header without
    its data, and the index mapping every tensor to its shard with their total, which it returns."""
    total, weight_map = 0, {}
    for file, tensors in shards.items():
        offsets, start = {}, 0
        for name, size in tensors.items():
            offsets[name], start = (start, start + size), start + size
            weight_map[name] = file
        total += write_safetensors(folder / file, offsets, data=False)
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total
