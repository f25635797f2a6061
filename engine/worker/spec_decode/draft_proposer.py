"""Drafts from a smaller model: a separate model with the target's vocabulary, or the target's own
first layers with its final norm and LM head (self-speculative early exit: real weights, no extra
memory for them).

The draft model keeps its own KV cache, laid out slot for slot like the target's, so the target's
block tables say where the draft's KV goes too; the scheduler reserves `num_tokens` lookahead
slots past each step's tokens for the positions the draft writes ahead. Each step, the draft first
computes the tokens it has not seen (the prompt, at first; then what the target accepted, and the
token it sampled), whose last row gives the first draft token; each further draft token is one
batched decode step. Drafts are the draft model's argmax: a deterministic proposal, which the
sampler's rejection rule keeps lossless.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvpilot.engine.model.attention import allocate_kv_caches
from kvpilot.engine.model.llama import LlamaForCausalLM, kv_shape
from kvpilot.engine.worker.spec_decode import DraftInput
from kvpilot.engine.worker.step_inputs import StepInputs


class DraftProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_layers: int,
        num_tokens: int,
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.device = device
        # The model runs only as many layers as its cache holds (LlamaForCausalLM.forward).
        self.kv_caches = allocate_kv_caches(num_layers, num_slots, *kv_shape(model), dtype, device)
        # Tokens of each request whose draft KV is computed (positions past them may hold drafts').
        self.num_computed: dict[str, int] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, sequences: list[DraftInput]) -> dict[str, list[int]]:
        if not sequences:
            return {}
        max_decode = 1 + self.num_tokens

        def pending(s: DraftInput) -> int:
            return len(s.token_ids) - self.num_computed.get(s.request_id, 0)

        # Catch up, decodes first (short runs of new tokens), as StepInputs wants them.
        ordered = sorted(sequences, key=lambda s: (pending(s) > max_decode, pending(s), len(s.token_ids)))
        inputs = StepInputs(self.block_size, self.device)
        last_rows = []
        for s in ordered:
            start = self.num_computed.get(s.request_id, 0)
            new = s.token_ids[start:]
            last_rows.append(inputs.add(new, start, s.block_ids, decode=len(new) <= max_decode) + len(new) - 1)
        drafts = [[token] for token in self._argmax(inputs, last_rows)]
        # Each further draft token: every sequence feeds its last draft at the next position.
        for step in range(1, self.num_tokens):
            inputs = StepInputs(self.block_size, self.device)
            rows = [
                inputs.add([d[-1]], len(s.token_ids) + step - 1, s.block_ids, decode=True)
                for s, d in zip(ordered, drafts)
            ]
            for d, token in zip(drafts, self._argmax(inputs, rows)):
                d.append(token)
        # Counted only once every forward has run: a step that fails is rerun request by request
        # (its sampled tokens perhaps different), and the rerun must compute these tokens again.
        self.num_computed.update((s.request_id, len(s.token_ids)) for s in ordered)
        return {s.request_id: d for s, d in zip(ordered, drafts)}

    def _argmax(self, inputs: StepInputs, rows: list[int]) -> list[int]:
        input_ids, positions, meta = inputs.build()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.logits(hidden[torch.tensor(rows, device=self.device)]).argmax(dim=-1).tolist()
