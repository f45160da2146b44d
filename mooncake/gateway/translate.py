"""OpenAI requests -> the pipeline's submission, and what comes back -> OpenAI responses.

Pure functions and small value types: no I/O, so the unit tests pin the wire format.

Prompts become token ids here, with the model's own tokenizer: a completion's prompt is
continued as it is (OpenAI's completions semantics, no chat template), a chat's messages go
through the chat template from the model's GGUF. The Conductor wraps a *text* prompt in that
template as one user message (what `mooncake submit` wants), so the gateway sends token ids
and the template is applied exactly once. With a model that has no tokenizer (`dummy`),
completions accept token-id prompts only (a text prompt goes on as text and the Conductor
rejects it with its reason) and chat is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mooncake import events as ev
from mooncake.client import Outcome
from mooncake.engine.errors import EngineError
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.gateway import errors
from mooncake.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from mooncake.hashing import DEFAULT_TENANT

# OpenAI's defaults where the request leaves them out.
DEFAULT_TEMPERATURE = 1.0
# A chat request without max_tokens: OpenAI goes up to the context window; a CPU-sized
# deployment stops here (the model ends most answers well before).
DEFAULT_CHAT_MAX_TOKENS = 512
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Submission:
    """What the gateway publishes as a `RequestSubmitted` (one of prompt / token_ids)."""

    params: ev.SamplingParams
    token_ids: list[int] | None = None
    prompt: str | None = None
    # Who sent it (`app.client_of`): the Conductor's per-client limit counts by this.
    client_id: str | None = None
    # Whose it is and the shared cache namespace it names (`app.tenant_of`).
    tenant: str = DEFAULT_TENANT
    cache_namespace: str | None = None


def sampling_params(req: SamplingFields, max_tokens: int) -> ev.SamplingParams:
    return ev.SamplingParams(
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=req.stop_strings,
    )


def completion_submission(req: CompletionRequest, tokenizer: ChatTokenizer | None) -> Submission:
    params = sampling_params(req, req.max_tokens)
    if isinstance(req.prompt, list):
        return Submission(params, token_ids=list(req.prompt))
    if tokenizer is None:
        return Submission(params, prompt=req.prompt)
    tokens = tokenizer.encode(req.prompt)
    if not tokens:
        raise errors.bad_request("the prompt has no tokens", param="prompt")
    return Submission(params, token_ids=tokens)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template reads them: plain-text content, and OpenAI's newer
    `developer` role under the name templates know, `system`."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        for m in req.messages
    ]


def chat_submission(
    req: ChatCompletionRequest, tokenizer: ChatTokenizer | None, context: int | None = None
) -> Submission:
    if tokenizer is None:
        raise errors.bad_request(
            "the served model has no tokenizer or chat template; use /v1/completions with "
            "token ids",
            param="messages",
        )
    try:
        tokens = tokenizer.encode_chat(chat_messages(req))
    except EngineError as exc:
        raise errors.bad_request(str(exc), param="messages") from exc
    max_tokens = req.token_budget or default_chat_max_tokens(len(tokens), context)
    return Submission(sampling_params(req, max_tokens), token_ids=tokens)


def default_chat_max_tokens(prompt_tokens: int, context: int | None) -> int:
    """What a chat request without max_tokens may generate: DEFAULT_CHAT_MAX_TOKENS, or the
    room its prompt leaves in the context if that is less (a prompt that leaves none is the
    Conductor's `prompt_too_long`)."""
    if context is None or prompt_tokens >= context:
        return DEFAULT_CHAT_MAX_TOKENS
    return min(DEFAULT_CHAT_MAX_TOKENS, context - prompt_tokens)


# --- what comes back ------------------------------------------------------------------------------


def usage(prompt_tokens: int, out: Outcome) -> Usage:
    completion = len(out.tokens)
    cached = int((out.decision or {}).get("cached_prefix_tokens") or 0)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, prompt_tokens)),
    )


def finish_reason(out: Outcome) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def completion_body(
    rid: str, model: str, created: int, out: Outcome, prompt_tokens: int
) -> Completion:
    return Completion(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(text=out.text, finish_reason=finish_reason(out))],
        usage=usage(prompt_tokens, out),
    )  # fmt: skip


def chat_body(
    rid: str, model: str, created: int, out: Outcome, prompt_tokens: int
) -> ChatCompletion:
    return ChatCompletion(
        id=rid, created=created, model=model,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=out.text),
                finish_reason=finish_reason(out),
            )
        ],
        usage=usage(prompt_tokens, out),
    )  # fmt: skip


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=False)
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """How one kind of stream (completions or chat) writes its chunks."""

    chat: bool
    rid: str
    model: str
    created: int

    def first(self) -> bytes | None:
        """Chat streams open with the assistant's role (OpenAI's first delta)."""
        if not self.chat:
            return None
        return self._chunk(Delta(role="assistant", content=""), None)

    def text(self, text: str) -> bytes:
        return self._chunk(Delta(content=text), None) if self.chat else self._completion(text, None)

    def finish(self, reason: str | None) -> bytes:
        return self._chunk(Delta(), reason) if self.chat else self._completion("", reason)

    def usage(self, u: Usage) -> bytes:
        if self.chat:
            body: BaseModel = ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=u
            )
        else:
            body = Completion(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=u
            )
        return sse(body)

    def _chunk(self, delta: Delta, reason: str | None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
        chunk = ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=[choice]
        )
        return sse(chunk.model_dump(exclude={"usage"}) | {"choices": [_chat_choice(choice)]})

    def _completion(self, text: str, reason: str | None) -> bytes:
        choice = CompletionChoice(text=text, finish_reason=reason)
        body = Completion(id=self.rid, created=self.created, model=self.model, choices=[choice])
        return sse(body.model_dump(exclude={"usage"}))


def _chat_choice(choice: ChatChunkChoice) -> dict[str, Any]:
    """A chunk's delta carries only what it sets (OpenAI omits the rest)."""
    d = choice.model_dump()
    d["delta"] = choice.delta.model_dump(exclude_none=True)
    return d


def error_event(err: errors.ApiError) -> bytes:
    """A failure after the stream started: OpenAI's clients raise on an `error` chunk."""
    return sse(err.body)


def response_id(prefix: str, request_id: str) -> str:
    """The OpenAI-style response id of a request (`cmpl`, `req-ab12` -> `cmpl-ab12`)."""
    return f"{prefix}-{request_id.removeprefix('req-')}"
