"""From token ids to text: incremental detokenization, stop strings and the text deltas a stream may
send, in one place for the offline API and the server alike.

The engine core deals in token ids only. For every step's new tokens this extends the request's
text, looks for stop strings (the earliest match in the text wins, whatever the order of the stop
list), and hands out the part of the text that can no longer change. Two tails are held back until
the request finishes: U+FFFD from a multi-byte character whose remaining bytes are in tokens not yet
generated, and any tail that could be the start of a stop string (text once sent cannot be taken
back when the stop string completes and the text is cut before it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from kvpilot.engine.core.request import FinishReason, Request
from kvpilot.engine.core.scheduler import EngineCoreOutput
from kvpilot.engine.outputs import Logprob, PositionLogprobs, StepOutput, TokenLogprobs

log = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Each new token costs a decode of a few tokens, not of the whole output.

    Decoding a slice of byte-level BPE tokens can end inside a multi-byte character (U+FFFD) or
    depend on the token before it (spaces), so text is only appended once the slice decodes
    cleanly, and each slice starts one step back so that its first token has its left context.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.prefix_offset = 0  # output tokens before this are already text and give no context
        self.read_offset = 0  # output tokens before this are already in the text
        self.text = ""

    def append(self, output_ids: list[int]) -> str:
        """Extend the text with whatever output_ids[read_offset:] spell cleanly; return the text."""
        decode = self._tokenizer.decode
        prefix = decode(output_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(output_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT_CHAR):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        return self.text


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `start` (earlier text was searched before):
    its position and itself; the longer one when two begin at the same place."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at != -1 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
            best = (at, stop)
    return best


def held_back(text: str, end: int, stops: list[str]) -> int:
    """How many characters before `end` could be the start of a stop string: the longest proper
    prefix of any stop string that text[:end] ends with."""
    held = 0
    for stop in stops:
        first = stop[0]
        # Candidate starts are occurrences of the stop's first character in the last len(stop) - 1
        # characters; the earliest one that matches gives the longest prefix.
        at = text.find(first, max(0, end - len(stop) + 1), end)
        while at != -1 and end - at > held:
            if stop.startswith(text[at:end]):
                held = end - at
                break
            at = text.find(first, at + 1, end)
    return held


class TextDeltas:
    """Turns successive versions of a sequence's text into the deltas a stream may send."""

    def __init__(self, stop: list[str]) -> None:
        self._stop = stop
        self._sent = 0  # characters of the text already sent

    def next(self, text: str, finished: bool) -> str:
        if finished:
            end = len(text)
        else:
            end = len(text.rstrip(_REPLACEMENT_CHAR))
            end -= held_back(text, end, self._stop)
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    deltas: TextDeltas
    stop: list[str]
    # Prompt token scores by position, until the first output carries them (a preempted request
    # scores its prompt again: the same positions, the same values).
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary

    def add_request(self, request: Request) -> None:
        stop = list(request.params.stop)
        self._states[request.request_id] = _RequestState(IncrementalDetokenizer(self.tokenizer), TextDeltas(stop), stop)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position(self, scores: TokenLogprobs) -> PositionLogprobs:
        return PositionLogprobs(
            chosen=Logprob(scores.token_id, self._token_text(scores.token_id), scores.logprob),
            top=[Logprob(t, self._token_text(t), lp) for t, lp in scores.top],
        )

    def abort(self, request: Request) -> StepOutput | None:
        """The last output of an aborted request (None if it had already finished)."""
        state = self._states.pop(request.request_id, None)
        if state is None:
            return None
        return _step_output(request, [], "", FinishReason.ABORT, None)

    def fail(self, request: Request, error: str) -> StepOutput:
        """The last output of a request that serving failed on."""
        self._states.pop(request.request_id, None)
        return _step_output(request, [], "", FinishReason.ABORT, None, error=error)

    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[StepOutput], list[tuple[Request, str]], list[Request]]:
        """The step's outputs; the still-running requests that a stop string has ended and those
        whose output could not be made (the caller finishes both kinds in the scheduler)."""
        step_outputs: list[StepOutput] = []
        stopped: list[tuple[Request, str]] = []
        failed: list[Request] = []
        for out in outputs:
            try:
                output = self._process_one(out, stopped)
            except Exception as err:
                log.exception("event=output_failed request=%s", out.request.request_id)
                failed.append(out.request)
                step_outputs.append(self.fail(out.request, f"cannot make this request's output: {err!r}"))
                continue
            if output is not None:
                step_outputs.append(output)
        return step_outputs, stopped, failed

    def _process_one(self, out: EngineCoreOutput, stopped: list[tuple[Request, str]]) -> StepOutput | None:
        request = out.request
        state = self._states.get(request.request_id)
        if state is None:
            return None
        if out.prompt_logprobs is not None:
            first, entries = out.prompt_logprobs
            state.prompt_logprobs.update((first + i, e) for i, e in enumerate(entries))
        if not out.new_token_ids and out.finish_reason is None:
            return None
        checked = len(state.detokenizer.text)
        output_ids, min_tokens = request.output_token_ids, request.params.min_tokens
        if state.stop and len(output_ids) - len(out.new_token_ids) < min_tokens:
            # A stop string counts only where it ends after the text of the first min_tokens
            # tokens (as in vLLM; EOS and stop tokens are not sampled before either).
            checked = len(state.detokenizer.append(output_ids[:min_tokens]))
        text = state.detokenizer.append(output_ids)
        finish, stop_reason = out.finish_reason, out.stop_reason
        match = find_stop(text, state.stop, checked) if state.stop else None
        if match is not None:
            at, stop = match
            text = text[:at]
            if finish is None:
                stopped.append((request, stop))
            finish, stop_reason = FinishReason.STOP, stop
        elif finish is not None:
            # Once, at the end: the exact text of every token, including a held-back partial character.
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        delta = state.deltas.next(text, finish is not None)
        output = _step_output(
            request,
            out.new_token_ids,
            delta,
            finish,
            stop_reason,
            logprobs=[self._position(e) for e in out.logprobs] if out.logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(request, state),
        )
        if finish is not None:
            del self._states[request.request_id]
        return output

    def _prompt_logprobs(self, request: Request, state: _RequestState) -> list[PositionLogprobs | None] | None:
        if request.params.prompt_logprobs is None or state.prompt_logprobs_sent:
            return None
        state.prompt_logprobs_sent = True
        scores = state.prompt_logprobs
        return [None] + [self._position(scores[p]) for p in range(1, request.num_prompt_tokens)]


def _step_output(
    request: Request,
    new_token_ids: list[int],
    delta: str,
    finish: FinishReason | None,
    stop_reason: str | int | None,
    **extra: object,
) -> StepOutput:
    return StepOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        text_delta=delta,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        finish_reason=finish.value if finish is not None else None,
        stop_reason=stop_reason,
        arrival_time=request.arrival_time,
        first_token_time=request.first_token_time,
        queue_time=None if request.first_scheduled_time is None else request.first_scheduled_time - request.queued_time,
        lora_name=request.lora.name if request.lora is not None else None,
        **extra,
    )
