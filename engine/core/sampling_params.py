"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvpilot.engine.core.structured_output import StructuredOutput

GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 or -1 means all tokens
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0  # EOS and stop tokens are not sampled, nor stop strings matched, before this many
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely token's
    logprobs: int | None = None  # per output token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured: StructuredOutput | None = None  # what the output must match (a JSON schema, a regex...)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "must be an integer >= 1",
            self.max_tokens,
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            "must be a finite number >= 0",
            self.temperature,
        )
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer", self.top_k)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )
        _check(
            0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens", self.min_tokens
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"must be None or in [0, {MAX_LOGPROBS}]", value)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows: such temperatures mean greedy (as in vLLM).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def speculable(self) -> bool:
        """Whether drafts may be verified for this sequence. Penalties and logprobs change or report
        per position, which verification of several positions at once does not model; a seeded
        sampled sequence must draw the same tokens whatever the load, and speculation switches on
        and off with the batch size. A structured output masks each position by the grammar state
        the tokens before it reach, which drafts verified together do not get: those requests do
        not speculate."""
        return (
            not self.penalized
            and self.logprobs is None
            and (self.seed is None or self.greedy)
            and self.structured is None
        )

    def per_sequence(self) -> list[SamplingParams]:
        """n completions of one prompt are n sequences; seeded ones get distinct, reproducible seeds."""
        if self.n == 1:
            return [self]
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)
        ]


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
