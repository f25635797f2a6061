"""One forward pass's inputs: token ids, positions, the KV slots they write and the attention
metadata that reads the cache back, built sequence by sequence.

Callers add decodes first, sorted by query count and context length (each run of decodes with
one query count is attended in padded groups of similar length), then prefill chunks.
"""

from __future__ import annotations

import torch

from kvpilot.engine.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk

# Decodes sorted by context length are attended this many at a time: small enough that padding to
# the group's longest context wastes little, large enough to keep per-call overhead low (measured on
# 64 decodes of 50-768 tokens: bench/history/2026-11-29-engine-offline-throughput.md).
DECODE_GROUP_SIZE = 8


class StepInputs:
    def __init__(self, block_size: int, device: torch.device, decode_kernel: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        # Single-query decode groups attend through cpu_kernels' attention kernel (loaded by the caller).
        self.decode_kernel = decode_kernel
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self._slot_mapping: list[torch.Tensor] = []
        self._decodes: list[tuple[int, int, torch.Tensor]] = []  # (first row, query count, context slots)
        self._prefills: list[PrefillChunk] = []

    def add(self, tokens: list[int], start: int, block_ids: list[int], decode: bool) -> int:
        """Tokens at positions start.. of a sequence whose KV lives in `block_ids`; its first row.
        A decode attends as part of a padded group, a prefill chunk on its own."""
        row, end = len(self.input_ids), start + len(tokens)
        bs = self.block_size
        if len(block_ids) * bs < end:
            raise ValueError(f"{len(block_ids)} blocks of {bs} slots cannot hold positions up to {end - 1}")
        blocks = torch.tensor(block_ids, dtype=torch.long)
        context_slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:end]
        if decode:
            self._decodes.append((row, len(tokens), context_slots))
        else:
            self._prefills.append(
                PrefillChunk(start=row, num_tokens=len(tokens), num_cached=start, slots=context_slots.to(self.device))
            )
        self._slot_mapping.append(context_slots[start:])
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end))
        return row

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(self._slot_mapping).to(device),
            decodes=self._decode_groups(),
            prefills=self._prefills,
        )
        return (
            torch.tensor(self.input_ids, dtype=torch.long, device=device),
            torch.tensor(self.positions, dtype=torch.long, device=device),
            meta,
        )

    def _decode_groups(self) -> list[DecodeGroup]:
        """Runs of up to DECODE_GROUP_SIZE consecutive decodes with one query count."""
        decodes, groups = self._decodes, []
        i = 0
        while i < len(decodes):
            start, queries, _ = decodes[i]
            run = [c for _, q, c in decodes[i : i + DECODE_GROUP_SIZE] if q == queries]
            lengths = [len(c) for c in run]
            slots = torch.nn.utils.rnn.pad_sequence(run, batch_first=True)
            # Every query sees every key exactly when each sequence has one query and all have one
            # length (a second query does not see the key after it): then SDPA without a mask, the
            # faster kernel call, in every layer.
            kernel = self.decode_kernel and queries == 1
            mask = None
            if not kernel and (queries > 1 or min(lengths) != max(lengths)):
                # Query j of a sequence (at position length - queries + j) sees keys up to its own position.
                last_key = torch.tensor(lengths).unsqueeze(1) - queries + torch.arange(queries).unsqueeze(0)
                visible = torch.arange(slots.shape[1]).view(1, 1, -1) <= last_key.unsqueeze(
                    2
                )  # [sequences, queries, keys]
                mask = visible.unsqueeze(1).to(self.device)
            group = DecodeGroup(start=start, slots=slots.to(self.device), num_queries=queries, mask=mask)
            if kernel:
                group.lengths = torch.tensor(lengths, device=self.device)
            groups.append(group)
            i += len(run)
        return groups
