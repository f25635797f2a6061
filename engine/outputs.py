"""What the engine hands out: per-step outputs (StepOutput), and the offline API's RequestOutput,
shaped like vLLM's so users' code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    token_id: int
    token: str  # the token's text on its own (may hold U+FFFD for part of a multi-byte character)
    logprob: float


@dataclass(frozen=True)
class PositionLogprobs:
    """The chosen token at one position and the most likely tokens there, most likely first."""

    chosen: Logprob
    top: list[Logprob]


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
    # Engine queue -> first scheduled (a preempted request's later waits not counted); None until then.
    queue_time: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when asked for
    # On a sequence's first output, when asked for: one per prompt token (None for the first).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None  # serving this sequence raised; it was dropped (finish_reason "abort")
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

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
    logprobs: list[PositionLogprobs] | None = None  # with SamplingParams.logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities under the model (before temperature or penalties): the
    chosen token's, and the most likely tokens', most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """What one step computed: sampled tokens per request (a list: a verification step yields
    several), and log-probabilities where the request asked for them."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (position of the token the first entry scores, entries): a prefill chunk's
    # prompt tokens, each scored by the position before it.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> draft tokens proposed to follow its sampled tokens (verified in the next step).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def update(self, other: ModelRunnerOutput) -> None:
        """Take in another output of the same step (its requests were run separately)."""
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.spec_token_ids.update(other.spec_token_ids)
