"""The OpenAI HTTP schemas the server speaks: request bodies (validated) and response bodies.

Requests are strict (a string is not silently an integer). `null` means "the default" for every
optional field, as in OpenAI's API. Fields the schema does not know are kept aside and refused by
`unsupported_field()` with a clear 400 unless their value asks for nothing (`"logit_bias": {}`), so
that no parameter is ever silently ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvpilot.engine.core.structured_output import StructuredOutput

_MAX_SEED = 2**63 - 1
# At most this many top alternatives per token, as OpenAI's API allows.
MAX_TOP_LOGPROBS = 20


def _valid_unicode(text: str) -> str:
    # JSON can carry lone UTF-16 surrogates ("\ud800"), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"the text has an invalid character at position {err.start} (a lone UTF-16 surrogate)"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


# Fields kvpilot does not implement, and the values that ask for nothing (accepted and ignored).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # Without a schema, any JSON value (as OpenAI's API has it).
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: free text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` is required with type json_schema, and only with it")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            assert self.json_schema is not None
            return StructuredOutput.json_schema(self.json_schema.json_schema)
        return None


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one constraint. Unknown keys are refused, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | Annotated[str, Field(min_length=1)] | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self

    def structured_output(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput.json_schema(self.json_)
        if self.choice is not None:
            return StructuredOutput.choice(self.choice)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_object")


class _GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: StopString | list[StopString] | None = None
    seed: int | None = Field(None, ge=0, le=_MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # for the caller's own bookkeeping; carries no behaviour
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Extensions that vLLM also accepts; load generators rely on ignore_eos for fixed output lengths.
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    # Prefix-cache isolation: requests share cached KV only with requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        """What the output must match, and the parameter that asked for it."""
        so = self.structured_outputs
        return (so.structured_output() if so is not None else None), "structured_outputs"

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives to report per output token; None when logprobs were not asked for."""
        return None

    def unsupported_field(self) -> str | None:
        """The first field that asks for something kvpilot does not do, if any."""
        for name, value in (self.model_extra or {}).items():
            if value not in _NEUTRAL_VALUES.get(name, ()):
                return name
        return None


class CompletionRequest(_GenerationRequest):
    # One prompt or a batch, as text or token ids (OpenAI's four forms).
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's legacy completions default; chat defaults to the rest of the context instead.
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt comes back before the completion (with its logprobs if asked)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # Chat templates know "system"; "developer" is OpenAI's newer name for the same role.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> ChatCompletionRequest:
        if self.structured_outputs is not None and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.structured_output(), "response_format"
        return super().structured_output()

    @property
    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    # As vLLM's: where the weights came from, and for a LoRA adapter the base model it runs on.
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM's."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # Replace an adapter already served under lora_name (vLLM's in-place reload).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, as vLLM's (lora_int_id is accepted and not needed)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
