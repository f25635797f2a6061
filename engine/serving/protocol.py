"""The OpenAI HTTP schemas the server speaks: request bodies (validated) and response bodies.

Requests are strict (a string is not silently an integer) and ignore unknown fields, as OpenAI
clients and SDKs send fields of newer API versions; fields that ask for a feature kvpilot does not
have are accepted by the schema but refused by `unsupported_field()` with a clear 400.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_MAX_SEED = 2**63 - 1
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# A request field that kvpilot cannot honour, and the values that mean "not asked for".
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions that vLLM also accepts; load generators rely on ignore_eos for fixed output lengths.
    top_k: int = Field(-1, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported_field(self) -> str | None:
        """The first field that asks for something kvpilot does not do, if any."""
        extra = self.model_extra or {}
        for name, neutral in _NEUTRAL_VALUES.items():
            if name in extra and extra[name] not in neutral:
                return name
        return None


class CompletionRequest(_GenerationRequest):
    # One prompt or a batch, as text or token ids (OpenAI's four forms).
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's legacy completions default; chat defaults to the rest of the context instead.
    max_tokens: int | None = Field(16, ge=1)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # Chat templates know "system"; "developer" is OpenAI's newer name for the same role.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses -------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpilot"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
