"""The response shapes of /v1/completions and /v1/chat/completions: choices, SSE chunks, usage,
and log-probabilities in each endpoint's own format."""

from __future__ import annotations

import abc
import time

from pydantic import BaseModel

from kvpilot.engine.outputs import Logprob, PositionLogprobs
from kvpilot.engine.serving.async_engine import SequenceUpdate
from kvpilot.engine.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Format(abc.ABC):
    """How one endpoint renders choices, chunks and the final answer."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def preamble(self, num_choices: int) -> list[BaseModel]:
        return []

    @abc.abstractmethod
    def chunk(self, update: SequenceUpdate) -> BaseModel: ...

    @abc.abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    @abc.abstractmethod
    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        """The whole answer; each final update carries its sequence's whole text and logprobs."""


class CompletionFormat(Format):
    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        n: int = 1,
        echo_texts: list[str] | None = None,
        first_tokens: list[str] | None = None,
    ) -> None:
        super().__init__(request_id, model)
        self.n = n
        self.echo_texts = echo_texts  # each prompt's text, when the request asked for echo
        self.first_tokens = first_tokens or []  # each prompt's first token, which has no logprob
        self._offsets: dict[int, int] = {}  # per choice: characters sent so far (text_offset)
        self._echoed: set[int] = set()

    def _choice(self, update: SequenceUpdate) -> CompletionChoice:
        text, positions = update.text, update.logprobs
        if self.echo_texts is not None and update.index not in self._echoed:
            # The prompt comes first, with its own logprobs when they were asked for.
            self._echoed.add(update.index)
            text = self.echo_texts[update.index // self.n] + text
            if positions is not None:
                positions = list(update.prompt_logprobs or []) + positions
        logprobs = None
        if positions is not None:
            first = self.first_tokens[update.index // self.n] if self.first_tokens else ""
            logprobs = _completion_logprobs(positions, self._offsets.get(update.index, 0), first)
        self._offsets[update.index] = self._offsets.get(update.index, 0) + len(text)
        return CompletionChoice(index=update.index, text=text, logprobs=logprobs, finish_reason=update.finish_reason)

    def chunk(self, update: SequenceUpdate) -> BaseModel:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[self._choice(update)]
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(u) for u in finals],
            usage=usage,
        )


class ChatCompletionFormat(Format):
    def preamble(self, num_choices: int) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(num_choices)
        ]

    def chunk(self, update: SequenceUpdate) -> BaseModel:
        delta = ChatDelta(content=update.text) if update.text else ChatDelta()
        return self._chunk(
            [
                ChatChunkChoice(
                    index=update.index,
                    delta=delta,
                    logprobs=_chat_logprobs(update.logprobs),
                    finish_reason=update.finish_reason,
                )
            ]
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        choices = [
            ChatChoice(
                index=u.index,
                message=AssistantMessage(content=u.text),
                logprobs=_chat_logprobs(u.logprobs),
                finish_reason=u.finish_reason,
            )
            for u in finals
        ]
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )


def _top(logprob: Logprob) -> TopLogprob:
    return TopLogprob(token=logprob.token, logprob=logprob.logprob, bytes=list(logprob.token.encode("utf-8")))


def _chat_logprobs(positions: list[PositionLogprobs] | None) -> ChatLogprobs | None:
    if positions is None:
        return None
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(**_top(p.chosen).model_dump(), top_logprobs=[_top(t) for t in p.top]) for p in positions
        ]
    )


def _completion_logprobs(positions: list[PositionLogprobs | None], offset: int, first_token: str) -> CompletionLogprobs:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for position in positions:
        text_offset.append(offset)
        if position is None:  # a prompt's first token: nothing before it to score it
            tokens.append(first_token)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offset += len(first_token)
            continue
        tokens.append(position.chosen.token)
        token_logprobs.append(position.chosen.logprob)
        top_logprobs.append({t.token: t.logprob for t in position.top})
        offset += len(position.chosen.token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def usage(prompts: list[list[int]], finals: list[SequenceUpdate], n: int) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(u.num_output_tokens for u in finals)
    # The prefix cache serves each prompt's first sequence; its siblings always share the prompt.
    cached = sum(u.num_cached_tokens for u in finals if u.index % n == 0)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
