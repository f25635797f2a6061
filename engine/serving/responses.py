"""The response shapes of /v1/completions and /v1/chat/completions: choices, SSE chunks, usage."""

from __future__ import annotations

import abc
import time

from pydantic import BaseModel

from kvpilot.engine.serving.async_engine import SequenceUpdate
from kvpilot.engine.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
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
    def chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel: ...

    @abc.abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    @abc.abstractmethod
    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        """The whole answer; each final update carries its sequence's whole text."""


class CompletionFormat(Format):
    def chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(index=index, text=text, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        choices = [CompletionChoice(index=u.index, text=u.text, finish_reason=u.finish_reason) for u in finals]
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)


class ChatCompletionFormat(Format):
    def preamble(self, num_choices: int) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(num_choices)]

    def chunk(self, index: int, text: str, finish_reason: str | None) -> BaseModel:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)

    def response(self, finals: list[SequenceUpdate], usage: Usage) -> BaseModel:
        choices = [ChatChoice(index=u.index, message=AssistantMessage(content=u.text), finish_reason=u.finish_reason) for u in finals]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def usage(prompts: list[list[int]], finals: list[SequenceUpdate], n: int) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(u.num_output_tokens for u in finals)
    # The prefix cache serves each prompt's first sequence; its siblings always share the prompt.
    cached = sum(u.num_cached_tokens for u in finals if u.index % n == 0)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
