"""What the engine hands out: per-step outputs (StepOutput), and the offline API's RequestOutput,
shaped like vLLM's so users' code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sequence. Concatenating a sequence's text deltas gives its
    whole output text; finish_reason is set on its last output."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_prompt_tokens: int
    num_output_tokens: int  # in all, so far
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token that ended it
    arrival_time: float
    first_token_time: float | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
