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

The catch-up forward computes at most max_num_batched_tokens tokens, as the target's steps do, so
that its activations stay within what the memory profile measured: a long prompt (or several)
is caught up in chunks over several steps, and a sequence drafts once it has caught up.
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
        max_num_batched_tokens: int,
    ) -> None:
        self.model = model
        self.num_tokens = num_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
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
        inputs, computed, caught_up, last_rows = self._catch_up(sequences)
        hidden = self._forward(inputs) if computed else None
        drafts: list[list[int]] = []
        if caught_up:
            drafts = [[token] for token in self._argmax(hidden, last_rows)]
        # Each further draft token: every caught-up sequence feeds its last draft at the next position.
        for step in range(1, self.num_tokens if caught_up else 0):
            inputs = StepInputs(self.block_size, self.device)
            rows = [
                inputs.add([d[-1]], len(s.token_ids) + step - 1, s.block_ids, decode=True)
                for s, d in zip(caught_up, drafts)
            ]
            hidden = self._forward(inputs)
            for d, token in zip(drafts, self._argmax(hidden, rows)):
                d.append(token)
        # Counted only once every forward has run: a step that fails is rerun request by request
        # (its sampled tokens perhaps different), and the rerun must compute these tokens again.
        self.num_computed.update(computed)
        proposed = {s.request_id: d for s, d in zip(caught_up, drafts)}
        return {s.request_id: proposed.get(s.request_id, []) for s in sequences}

    def _catch_up(self, sequences: list[DraftInput]) -> tuple[StepInputs, dict[str, int], list[DraftInput], list[int]]:
        """The tokens each sequence has not computed yet, within the token budget (decodes first:
        short runs of new tokens, as StepInputs wants them): the inputs, how far each sequence
        gets, those that reach their last token, and the rows of those last tokens."""
        max_decode = 1 + self.num_tokens

        def pending(s: DraftInput) -> int:
            return len(s.token_ids) - self.num_computed.get(s.request_id, 0)

        ordered = sorted(sequences, key=lambda s: (pending(s) > max_decode, pending(s), len(s.token_ids)))
        inputs = StepInputs(self.block_size, self.device)
        budget = self.max_num_batched_tokens
        computed: dict[str, int] = {}
        caught_up, last_rows = [], []
        for s in ordered:
            start = self.num_computed.get(s.request_id, 0)
            take = min(pending(s), budget)
            if take <= 0:
                break
            budget -= take
            row = inputs.add(s.token_ids[start : start + take], start, s.block_ids, decode=take <= max_decode)
            computed[s.request_id] = start + take
            if start + take == len(s.token_ids):
                caught_up.append(s)
                last_rows.append(row + take - 1)
        return inputs, computed, caught_up, last_rows

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        input_ids, positions, meta = inputs.build()
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _argmax(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        return self.model.logits(hidden[torch.tensor(rows, device=self.device)]).argmax(dim=-1).tolist()
