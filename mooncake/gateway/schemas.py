"""The OpenAI wire format the gateway speaks: request bodies (validated once, here) and the
response bodies and stream chunks it writes.

Requests ignore fields they do not know (OpenAI clients add new optional fields often, and a
client must not break on a newer SDK), but a known field with a value this system cannot
honour (`n` > 1, logprobs, penalties, tools) is refused with a message rather than silently
dropped: the answer would not be what the client asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

# --- requests -----------------------------------------------------------------------------------

StopString = Annotated[str, Field(min_length=1, max_length=256)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


def _unsupported(value: object, allowed: tuple[object, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(what)


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    # None: OpenAI's default temperature, 1 (sampling); 0 is greedy.
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # Not OpenAI's, but common on compatible servers.
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        _unsupported(v, (1,), "only n=1 is supported (send one request per completion)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        _unsupported(v, (None, 0.0), "penalties are not supported (leave it 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        _unsupported(v or None, (None,), "not supported")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _one_prompt(v: object) -> object:
    """OpenAI's four prompt shapes (text, texts, token ids, lists of token ids) -> one text
    or one token id list; more than one prompt per request is refused."""
    if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
        if len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise ValueError("the prompt is empty")
        return v
    if isinstance(v, list):
        if not v:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise ValueError("token ids must be non-negative integers")
        return v
    raise ValueError("must be a string or a list of token ids")


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: the prompt is continued as it is (no chat template)."""

    prompt: Annotated[str | list[int], BeforeValidator(_one_prompt)]
    # OpenAI's default for completions.
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _off(cls, v: object) -> object:
        _unsupported(v or None, (None,), "not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        _unsupported(v, (None, 1), "only 1 is supported")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: messages rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        _unsupported(v or None, (None,), "not supported")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        _unsupported(v or None, (None,), "tool calls are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _unsupported((v or {}).get("type", "text"), ("text",), "only type 'text' is supported")
        return v

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV the Conductor admitted the request to reuse (its prefix in the
    # cache pool or the instance's own), rather than compute.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason = None


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
    owned_by: str = "mooncake"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
