"""The OpenAI-compatible gateway's HTTP side, against an in-memory pipeline: request
validation and its messages, the mapping of rejections / failures / timeouts to HTTP, the
SSE and JSON wire formats (also read back by the official `openai` client), the chat
template, cancels when a client goes away, and the HTTP metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers import decoders as tk_decoders
from tokenizers.models import BPE

from mooncake.client import QUIET, TERMINAL_TYPES, Outcome, is_final
from mooncake.config import Settings
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.gateway import GatewayOptions, create_app
from mooncake.gateway.app import Gateway, _unless_disconnected
from mooncake.gateway.translate import Submission

MODEL = "test-model"
HANG = object()  # a script step: nothing more comes back (the request times out)
Script = Callable[[str, Submission], AsyncIterator[Any]]


# --- an in-memory pipeline ------------------------------------------------------------------------


def admitted(rid: str, prompt_tokens: int = 3) -> dict[str, Any]:
    return {"type": "request.admitted", "request_id": rid, "policy": "none",
            "prompt_tokens": prompt_tokens}  # fmt: skip


def chunk(rid: str, index: int, token: int, text: str) -> dict[str, Any]:
    return {"request_id": rid, "index": index, "token_ids": [token], "text": text}


def final(rid: str, index: int, reason: str = "stop", error: str | None = None) -> dict[str, Any]:
    body = {"request_id": rid, "index": index, "token_ids": [], "text": "", "done": True,
            "finish_reason": reason}  # fmt: skip
    return body | ({"error": error} if error else {})


def answer(*pieces: str, reason: str = "stop") -> Script:
    """Admitted, one token per piece, then the final chunk."""

    async def script(rid: str, sub: Submission) -> AsyncIterator[Any]:
        yield admitted(rid, len(sub.token_ids or ()))
        for i, piece in enumerate(pieces):
            yield chunk(rid, i, 100 + i, piece)
        yield final(rid, len(pieces), reason)

    return script


def replies(*steps: Any) -> Script:
    """A fixed list of replies (with `{rid}` filled in)."""

    async def script(rid: str, sub: Submission) -> AsyncIterator[Any]:
        for step in steps:
            yield step if step is HANG or step is QUIET else {**step, "request_id": rid}

    return script


class FakeBackend:
    """Records what the gateway submits and cancels; answers from a script, with
    `mooncake.client.submit`'s end-of-stream rules."""

    def __init__(
        self,
        script: Script | None = None,
        connected: bool = True,
        copy: Callable[[str], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.script = script or answer("Hello", " world")
        self.connected = connected
        self.copy = copy  # the request's stored chunks, for read-backs
        self.submitted: list[tuple[str, Submission]] = []
        self.cancels: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.read_backs: list[tuple[str, int]] = []  # (request id, from index)
        self.replies = 0

    def new_reply_subject(self) -> str:
        self.replies += 1
        return f"_INBOX.test.{self.replies}"

    def submit(
        self, submission: Submission, *, request_id: str, reply_to: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        assert reply_to == f"_INBOX.test.{self.replies}"
        return self._follow(submission, request_id)

    async def read_back(self, out: Outcome) -> None:
        """What `client.read_back` does: the copy's chunks from the first missing index."""
        assert out.reply_to is not None and out.reply_to.startswith("_INBOX.test.")
        start = out.next_missing()
        self.read_backs.append((out.request_id, start))
        if self.copy is None:
            raise RuntimeError("no copy")
        for body in self.copy(out.request_id):
            if body.get("done") or body["index"] >= start:
                out.fill(body)

    async def _follow(self, submission: Submission, rid: str) -> AsyncIterator[dict[str, Any]]:
        self.submitted.append((rid, submission))  # published on the first read, like submit
        try:
            async for body in self.script(rid, submission):
                if body is HANG:
                    return  # what `submit` does when its timeout passes
                yield body
                if is_final(body, TERMINAL_TYPES):
                    return
        finally:
            self.closed.append(rid)

    async def cancel(self, request_id: str, reason: str) -> None:
        self.cancels.append((request_id, reason))


def byte_tokenizer(template: str) -> ChatTokenizer:
    """A real (tokenizers) byte-level tokenizer with ChatML's special tokens and `template`."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = {"<|im_start|>": len(vocab), "<|im_end|>": len(vocab) + 1}
    tok = Tokenizer(BPE(vocab=vocab | specials, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return ChatTokenizer(
        tok, eos_id=specials["<|im_end|>"], template=template, special_tokens=specials
    )


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)


class Rig:
    def __init__(self, backend: FakeBackend, tokenizer: ChatTokenizer | None, **opts: Any):
        options = GatewayOptions(MODEL, **({"retry_after_s": 7, "max_body_bytes": 4096} | opts))
        self.backend = backend
        self.tokenizer = tokenizer
        self.app = create_app(backend, options, tokenizer)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://gw"
        )

    @property
    def tok(self) -> ChatTokenizer:
        assert self.tokenizer is not None
        return self.tokenizer

    @property
    def gateway(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.http.post(
            path, content=content, headers={"content-type": "application/json", **(headers or {})}
        )

    def openai(self) -> openai.AsyncOpenAI:
        # openai 3 is typed for its own httpx fork; it drives any httpx-compatible client.
        return openai.AsyncOpenAI(
            base_url="http://gw/v1",
            api_key="unused",
            max_retries=0,
            http_client=self.http,  # type: ignore[arg-type,unused-ignore]
        )


@pytest.fixture
def rig() -> Callable[..., Rig]:
    def make(
        script: Script | None = None, *, tokenizer: ChatTokenizer | None = None, **opts: Any
    ) -> Rig:
        return Rig(FakeBackend(script), tokenizer or byte_tokenizer(TEMPLATE), **opts)

    return make


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code"} <= set(body["error"]), body
    err: dict[str, Any] = body["error"]
    return err


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an event stream, asserting the framing."""
    assert text.endswith("\n\n"), text[-50:]
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]


# --- validation -----------------------------------------------------------------------------------


async def test_malformed_json_is_400_with_the_parser_message(rig: Callable[..., Rig]) -> None:
    r = rig()
    resp = await r.post("/v1/completions", b'{"model": "test-model", "prompt": ')
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert err["message"].startswith("malformed JSON body")
    resp = await r.post("/v1/chat/completions", b"[1, 2]")
    assert resp.status_code == 400 and "JSON object" in error_of(resp)["message"]
    assert r.backend.submitted == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_json_nested_past_the_parsers_stack_is_400_not_500(
    rig: Callable[..., Rig], path: str
) -> None:
    """`json.loads` raises RecursionError (not ValueError) about a thousand levels deep."""
    r = rig(max_body_bytes=1 << 20)
    deep = b"[" * 5000 + b"]" * 5000
    for body in (deep, b'{"model": "test-model", "prompt": "hi", "metadata": ' + deep + b"}"):
        resp = await r.post(path, body)
        assert resp.status_code == 400, resp.text
        err = error_of(resp)
        assert err["code"] == "invalid_json" and "nested too deeply" in err["message"], err
    assert r.backend.submitted == []


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": "hi", "max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "hi", "n": 2}, "n", "only n=1"),
        ({"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [1, -2]}, "prompt", "non-negative"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop", "at most 16"),
        ({}, "prompt", "Field required"),
    ],
)
async def test_schema_errors_are_400_naming_the_field(
    rig: Callable[..., Rig], body: dict[str, Any], param: str, says: str
) -> None:
    r = rig()
    resp = await r.post("/v1/completions", {"model": MODEL} | body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"].startswith(param) and says in err["message"], err["message"]
    assert r.backend.submitted == []


async def test_chat_schema_errors(rig: Callable[..., Rig]) -> None:
    r = rig()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", ">"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools", "not supported"),
    ]  # fmt: skip
    for body, loc, says in cases:
        resp = await r.post("/v1/chat/completions", {"model": MODEL} | body)
        assert resp.status_code == 400, (body, resp.text)
        message = error_of(resp)["message"]
        assert message.startswith(loc) and (says in message or "greater" in message), message
    assert r.backend.submitted == []


async def test_unknown_model_is_404_model_not_found(rig: Callable[..., Rig]) -> None:
    r = rig()
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        resp = await r.post(path, {"model": "gpt-5"} | body)
        assert resp.status_code == 404
        err = error_of(resp)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "gpt-5" in err["message"] and MODEL in err["message"]
    assert (await r.http.get("/v1/models/gpt-5")).status_code == 404
    assert r.backend.submitted == []


async def test_body_over_the_limit_is_413(rig: Callable[..., Rig]) -> None:
    r = rig()
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "body_too_large"


async def test_unknown_route_is_an_openai_error(rig: Callable[..., Rig]) -> None:
    resp = await rig().http.get("/v1/nothing")
    assert resp.status_code == 404 and error_of(resp)["type"] == "not_found_error"


# --- translation ----------------------------------------------------------------------------------


async def test_completion_prompt_is_tokenized_raw_and_params_mapped(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    resp = await r.post("/v1/completions", {
        "model": MODEL, "prompt": "Once upon", "max_tokens": 9, "temperature": 0.5,
        "top_p": 0.9, "seed": 42, "stop": "\n", "user": "someone", "metadata": {"x": 1},
    })  # fmt: skip
    assert resp.status_code == 200, resp.text
    ((_, sub),) = r.backend.submitted
    assert sub.prompt is None
    assert sub.token_ids == r.tok.encode("Once upon")  # no chat template around it
    p = sub.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (9, 0.5, 0.9, 42, ["\n"])


async def test_the_tenant_comes_from_the_header_else_the_user_else_the_default(
    rig: Callable[..., Rig],
) -> None:
    r = rig()
    body = {"model": MODEL, "prompt": [5, 6, 7], "user": "alice"}
    await r.post("/v1/completions", body, {"X-Mooncake-Tenant": "acme"})
    await r.post("/v1/completions", body)
    await r.post("/v1/completions", {**body, "user": "bob@example.com"})
    await r.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]})
    await r.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        {"X-Mooncake-Tenant": "acme", "X-Mooncake-Cache-Namespace": "system-prompts"},
    )
    subs = [sub for _, sub in r.backend.submitted]
    assert [(s.tenant, s.cache_namespace) for s in subs[:2]] == [("acme", None), ("alice", None)]
    assert subs[2].tenant.startswith("u-") and "bob" not in subs[2].tenant  # a digest
    assert (subs[3].tenant, subs[4].tenant) == ("default", "acme")
    assert subs[4].cache_namespace == "system-prompts"
    for headers, code in (
        ({"X-Mooncake-Tenant": "a b"}, "invalid_tenant"),
        ({"X-Mooncake-Cache-Namespace": "x" * 65}, "invalid_cache_namespace"),
    ):
        resp = await r.post("/v1/completions", body, headers)
        assert resp.status_code == 400 and error_of(resp)["code"] == code, resp.text
    assert len(r.backend.submitted) == 5  # nothing refused was submitted


async def test_defaults_follow_openai(rig: Callable[..., Rig]) -> None:
    r = rig()
    await r.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]})
    await r.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    (_, completion), (_, chat) = r.backend.submitted
    assert completion.token_ids == [5, 6, 7]  # token-id prompts pass through
    assert completion.params.max_tokens == 16 and completion.params.temperature == 1.0
    assert chat.params.temperature == 1.0 and chat.params.max_tokens > 16


async def test_chat_messages_go_through_the_models_chat_template(rig: Callable[..., Rig]) -> None:
    r = rig()
    resp = await r.post("/v1/chat/completions", {
        "model": MODEL, "max_completion_tokens": 5,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user",
             "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"},
        ],
    })  # fmt: skip
    assert resp.status_code == 200, resp.text
    ((_, sub),) = r.backend.submitted
    assert sub.params.max_tokens == 5
    assert sub.token_ids is not None
    rendered = r.tok.decode(sub.token_ids, skip_special=False)
    assert rendered == (
        "<|im_start|>system: Be brief.<|im_end|><|im_start|>user: Hi there<|im_end|>"
        "<|im_start|>assistant: Hello!<|im_end|><|im_start|>user: Capital of France?<|im_end|>"
        "<|im_start|>assistant: "
    )
    # The template's special tokens are single special tokens, not their characters.
    assert sub.token_ids[0] == r.tok.special_tokens["<|im_start|>"]


async def test_without_a_tokenizer_text_goes_on_and_chat_is_refused() -> None:
    r = Rig(FakeBackend(), None)
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "hello"})
    assert resp.status_code == 200
    ((_, sub),) = r.backend.submitted
    assert sub.prompt == "hello" and sub.token_ids is None
    chat = await r.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 400 and "chat template" in error_of(chat)["message"]


# --- answers --------------------------------------------------------------------------------------


async def test_non_streamed_completion_body(rig: Callable[..., Rig]) -> None:
    r = rig(answer("Paris", " is", " nice", reason="length"))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 3})
    assert resp.status_code == 200
    body = resp.json()
    rid = resp.headers["x-request-id"]
    assert body["id"] == "cmpl-" + rid.removeprefix("req-")
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": "Paris is nice", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    await r.gateway.drain()
    assert r.backend.cancels == []  # it finished: nothing to cancel


async def test_non_streamed_chat_body_read_by_the_openai_client(rig: Callable[..., Rig]) -> None:
    r = rig(answer("Bonjour", "!"))
    got = await r.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi in French"}], max_tokens=4
    )
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == "Bonjour!"
    assert got.choices[0].finish_reason == "stop"
    assert got.usage is not None and got.usage.completion_tokens == 2


async def test_usage_counts_the_prompt_tokens_served_from_the_cache(
    rig: Callable[..., Rig],
) -> None:
    decision = admitted("r", prompt_tokens=40) | {"cached_prefix_tokens": 32}
    r = rig(replies(decision, chunk("r", 0, 1, "Hi"), final("r", 1)))
    got = await r.openai().completions.create(model=MODEL, prompt=[1] * 40, max_tokens=1)
    assert got.usage is not None and got.usage.prompt_tokens_details is not None
    assert got.usage.prompt_tokens_details.cached_tokens == 32


async def test_streamed_completion_is_sse_then_done(rig: Callable[..., Rig]) -> None:
    # The decode's chunk (index 1) overtakes prefill's first token (index 0).
    r = rig(replies(admitted("r"), chunk("r", 1, 11, " world"), chunk("r", 0, 10, "Hello"),
                    chunk("r", 2, 12, "!"), final("r", 3)))  # fmt: skip
    resp = await r.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "Hello world!"
    assert texts[0] == "Hello world"  # held until index 0 arrived, then in order
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_streamed_chat_read_by_the_openai_client(rig: Callable[..., Rig]) -> None:
    r = rig(answer("The", " moon", " rises"))
    stream = await r.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "haiku"}], stream=True
    )
    deltas = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in deltas)
    assert deltas[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    assert text == "The moon rises"
    assert deltas[-1].choices[0].finish_reason == "stop"


# --- what the live stream missed ------------------------------------------------------------------
# Live replies travel on core NATS: what is published while the gateway reconnects is lost.
# The gateway completes the answer from the request's stored copy (Backend.read_back).


def whole_copy(*pieces: str, reason: str = "stop") -> Callable[[str], list[dict[str, Any]]]:
    def copy(rid: str) -> list[dict[str, Any]]:
        chunks = [chunk(rid, i, 100 + i, piece) for i, piece in enumerate(pieces)]
        return [*chunks, final(rid, len(pieces), reason)]

    return copy


async def test_a_token_lost_live_is_read_back_before_the_answer(rig: Callable[..., Rig]) -> None:
    live = replies(admitted("r"), chunk("r", 0, 100, "Hello"), chunk("r", 2, 102, "!"),
                   final("r", 3))  # fmt: skip
    r = Rig(FakeBackend(live, copy=whole_copy("Hello", " world", "!")), byte_tokenizer(TEMPLATE))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "Hello world!"
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert r.backend.read_backs == [(resp.headers["x-request-id"], 1)]


async def test_a_streamed_answer_is_whole_and_in_order_after_a_lost_token(
    rig: Callable[..., Rig],
) -> None:
    live = replies(admitted("r"), chunk("r", 0, 100, "Hello"), chunk("r", 2, 102, "!"),
                   final("r", 3))  # fmt: skip
    r = Rig(FakeBackend(live, copy=whole_copy("Hello", " world", "!")), byte_tokenizer(TEMPLATE))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "Hello world!" and texts[0] == "Hello"  # nothing after the gap early


async def test_a_lost_final_chunk_is_read_back_when_the_stream_stalls(
    rig: Callable[..., Rig],
) -> None:
    """Mid-answer the live stream goes quiet (its final chunk was lost): the gateway looks in
    the copy at the first quiet stretch, answers from it, and has nothing to cancel."""
    live = replies(admitted("r"), chunk("r", 0, 100, "Hello"), QUIET, HANG)
    r = Rig(FakeBackend(live, copy=whole_copy("Hello", " world")), byte_tokenizer(TEMPLATE))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "Hello world"
    await r.gateway.drain()
    assert r.backend.cancels == []
    assert r.backend.read_backs == [(resp.headers["x-request-id"], 1)]


async def test_quiet_before_the_first_token_looks_in_the_copy_only_now_and_then(
    rig: Callable[..., Rig],
) -> None:
    """A request queued for its prefill is quiet for long stretches: the copy is looked in
    after 3, 6, 12, ... of them, not at each."""
    live = replies(admitted("r"), *[QUIET] * 7, chunk("r", 0, 100, "Hi"), final("r", 1))
    r = Rig(FakeBackend(live, copy=lambda rid: []), byte_tokenizer(TEMPLATE))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.json()["choices"][0]["text"] == "Hi"
    assert len(r.backend.read_backs) == 2  # after the 3rd and the 6th


async def test_an_answer_with_a_hole_is_an_error_not_a_shorter_text(
    rig: Callable[..., Rig],
) -> None:
    live = replies(admitted("r"), chunk("r", 0, 100, "Hello"), chunk("r", 2, 102, "!"),
                   final("r", 3))  # fmt: skip
    r = Rig(FakeBackend(live, copy=None), byte_tokenizer(TEMPLATE))  # the read-back fails
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503
    assert "[1]" in error_of(resp)["message"] and error_of(resp)["code"] == "unavailable"


# --- rejections, failures, timeouts, cancels ------------------------------------------------------


def rejection(reason: str, detail: str) -> Script:
    return replies({"type": "request.rejected", "reason": reason, "detail": detail,
                    "stage": "admission"})  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_overload_rejection_is_429_with_retry_after(
    rig: Callable[..., Rig], stream: bool
) -> None:
    r = rig(rejection("ttft_slo", "predicted TTFT 41.0 s > SLO 30.0 s"))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream})
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "7"
    err = error_of(resp)
    assert err["code"] == "ttft_slo" and err["type"] == "rate_limit_error"
    assert "predicted TTFT 41.0 s" in err["message"]
    await r.gateway.drain()
    assert r.backend.cancels == []  # a rejected request is over already


async def test_rejection_seen_by_the_openai_client(rig: Callable[..., Rig]) -> None:
    r = rig(rejection("decode_overloaded", "predicted TBT 0.3 s > 0.1 s"))
    with pytest.raises(openai.RateLimitError) as caught:
        await r.openai().completions.create(model=MODEL, prompt="x", stream=True)
    assert caught.value.status_code == 429
    assert caught.value.response.headers["retry-after"] == "7"
    assert "decode_overloaded" in str(caught.value)


async def test_invalid_request_rejection_is_400(rig: Callable[..., Rig]) -> None:
    r = rig(rejection("invalid_request", "token id 99999 is outside the vocabulary"))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": [99999]})
    assert resp.status_code == 400
    assert "outside the vocabulary" in error_of(resp)["message"]
    assert "retry-after" not in resp.headers


@pytest.mark.parametrize(
    ("reason", "param"), [("prompt_too_long", None), ("max_tokens_too_large", "max_tokens")]
)
async def test_a_request_that_cannot_fit_the_context_is_400(
    rig: Callable[..., Rig], reason: str, param: str | None
) -> None:
    r = rig(rejection(reason, "the model's context is 8,192 tokens"))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": [1, 2]})
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert (err["code"], err["param"]) == (reason, param)
    assert "context is 8,192" in err["message"] and "retry-after" not in resp.headers


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b'{"model": "test-model", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "test-model", "messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages.0.content"),
        (b'{"model": "test-model", "prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop.1"),
        (b'{"model": "test-model", "prompt": "x", "\\ud800": 1}', "\\ud800"),  # a key
    ],
)  # fmt: skip
async def test_a_lone_surrogate_is_400_invalid_encoding(
    rig: Callable[..., Rig], body: bytes, where: str
) -> None:
    r = rig()
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    resp = await r.post(path, body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == "invalid_encoding" and "surrogate" in err["message"]
    assert err["message"].startswith(where + ":"), err["message"]
    assert r.backend.submitted == []
    # A surrogate pair is text: the same escape with its partner goes through.
    ok = await r.post("/v1/completions", {"model": MODEL, "prompt": "a\ud83d\ude00b"})
    assert ok.status_code == 200, ok.text


async def test_chat_without_max_tokens_generates_at_most_the_room_its_prompt_leaves(
    rig: Callable[..., Rig],
) -> None:
    r = rig(context=64)
    msg = {"role": "user", "content": "x" * 30}
    await r.post("/v1/chat/completions", {"model": MODEL, "messages": [msg]})
    await r.post("/v1/chat/completions", {"model": MODEL, "messages": [msg], "max_tokens": 50})
    (_, default), (_, asked) = r.backend.submitted
    assert default.token_ids is not None
    assert default.params.max_tokens == 64 - len(default.token_ids) < 50
    assert asked.params.max_tokens == 50  # asked for: the Conductor judges it


async def test_failure_is_500_with_the_reason(rig: Callable[..., Rig]) -> None:
    r = rig(replies(admitted("r"), final("r", 0, "failed", "prefill: out of memory")))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 500
    assert "out of memory" in error_of(resp)["message"]


async def test_failure_mid_stream_is_an_error_event(rig: Callable[..., Rig]) -> None:
    r = rig(replies(admitted("r"), chunk("r", 0, 1, "Hi"), final("r", 1, "failed", "decode died")))
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert resp.status_code == 200  # the stream had started
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the request failed: decode died"
    with pytest.raises(openai.APIError, match="decode died"):
        stream = await r.openai().completions.create(model=MODEL, prompt="x", stream=True)
        async for _ in stream:
            pass


async def test_timeout_is_504_and_cancels_the_request(rig: Callable[..., Rig]) -> None:
    r = rig(replies(admitted("r"), chunk("r", 0, 1, "Hi"), HANG), request_timeout_s=0.5)
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 504
    assert error_of(resp)["code"] == "timeout"
    await r.gateway.drain()
    assert r.backend.cancels == [(resp.headers["x-request-id"], "timeout")]


async def hang_up(
    r: Rig,
    body: dict[str, Any],
    gone: asyncio.Event,
    heard: Callable[[dict[str, Any]], None] = lambda message: None,
) -> list[dict[str, Any]]:
    """POST `body` to /v1/completions through the ASGI app as a client that hangs up (an
    `http.disconnect`) once `gone` is set; what the app sent (each also to `heard`)."""
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        heard(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000), "server": ("gw", 80),
    }  # fmt: skip
    await r.app(scope, receive, send)  # type: ignore[arg-type]
    return sent


async def test_client_disconnect_mid_stream_cancels_the_request(rig: Callable[..., Rig]) -> None:
    going_on = asyncio.Event()

    async def endless(rid: str, sub: Submission) -> AsyncIterator[Any]:
        yield admitted(rid)
        yield chunk(rid, 0, 1, "Once")
        await going_on.wait()  # the model is still generating
        yield final(rid, 1)

    r = rig(endless)
    gone = asyncio.Event()

    def heard(message: dict[str, Any]) -> None:
        if b"Once" in message.get("body", b""):
            gone.set()  # the client hangs up after the first text

    body = {"model": MODEL, "prompt": "x", "stream": True}
    sent = await asyncio.wait_for(hang_up(r, body, gone, heard), 5)
    await r.gateway.drain()
    assert sent[0]["status"] == 200
    ((rid, _),) = r.backend.submitted
    assert r.backend.cancels == [(rid, "client_disconnected")]
    assert r.backend.closed == [rid]  # it stopped following the reply subject


async def test_client_disconnect_while_waiting_for_a_whole_answer_cancels_within_a_second(
    rig: Callable[..., Rig],
) -> None:
    """A non-streaming client hangs up while the model generates: the request is cancelled
    (it ran on before, nobody left to read it)."""
    generating = asyncio.Event()

    async def endless(rid: str, sub: Submission) -> AsyncIterator[Any]:
        yield admitted(rid)
        yield chunk(rid, 0, 1, "Once")
        generating.set()
        await asyncio.Event().wait()  # the model is still generating
        yield final(rid, 1)

    r = rig(endless)
    await asyncio.wait_for(hang_up(r, {"model": MODEL, "prompt": "x"}, generating), 1.0)
    await asyncio.wait_for(r.gateway.drain(), 1.0)
    ((rid, _),) = r.backend.submitted
    assert r.backend.cancels == [(rid, "client_disconnected")]
    assert r.backend.closed == [rid]


async def test_bus_down_is_503(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.backend.connected = False
    resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503
    health = await r.http.get("/health")
    assert health.status_code == 503 and health.json()["nats"] is False
    r.backend.connected = True
    assert (await r.http.get("/health")).status_code == 200


# --- models, metrics, settings --------------------------------------------------------------------


async def test_models_lists_the_configured_model(rig: Callable[..., Rig]) -> None:
    r = rig()
    models = await r.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await r.http.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL


async def test_metrics_count_requests_by_route_and_status(rig: Callable[..., Rig]) -> None:
    def count(route: str, status: str) -> float:
        labels = {"route": route, "status": status}
        return REGISTRY.get_sample_value("mc_gateway_requests_total", labels) or 0.0

    r = rig(rejection("ttft_slo", "slow"))
    before = (count("/v1/completions", "429"), count("/v1/completions", "400"))
    await r.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    await r.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert count("/v1/completions", "429") == before[0] + 1
    assert count("/v1/completions", "400") == before[1] + 1
    text = (await r.http.get("/metrics")).text
    assert 'mc_gateway_request_seconds_count{route="/v1/completions"}' in text
    # Only the gateway's own series (and the process's): no other role's zero counters.
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert "mc_gateway_requests_total" in families and "process_cpu_seconds_total" in families
    assert not [f for f in families if f.startswith("mc_") and not
                f.startswith(("mc_gateway_", "mc_bus_"))], families  # fmt: skip
    await r.http.get("/v1/x/../random")
    assert REGISTRY.get_sample_value(
        "mc_gateway_requests_total", {"route": "other", "status": "404"}
    )


def test_gateway_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_GATEWAY__PORT", "9123")
    monkeypatch.setenv("MOONCAKE_GATEWAY__RETRY_AFTER_S", "5")
    s = Settings()
    assert (s.gateway.host, s.gateway.port, s.gateway.retry_after_s) == ("127.0.0.1", 9123, 5)
    opts = GatewayOptions.from_settings(s)
    assert opts.model_id == s.model_id and opts.retry_after_s == 5


def test_up_gives_the_gateway_its_port_or_a_free_one(tmp_path: Path) -> None:
    from mooncake.stack import LAYOUT, Stack, gateway_port

    assert ("gateway", 1) in LAYOUT
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = gateway_port("127.0.0.1", busy)
        assert other != busy and other > 0
    assert gateway_port("127.0.0.1", busy) == busy  # free again: the configured port
    assert gateway_port("127.0.0.1", 0) > 0
    stack = Stack(Settings(data_dir=tmp_path, gateway={"port": busy}))
    assert stack.gateway_port is None and stack.gateway_url is None  # chosen when it starts
    stack.gateway_port = busy
    assert stack.child_env()["MOONCAKE_GATEWAY__PORT"] == str(busy)
    assert stack.gateway_url == f"http://127.0.0.1:{busy}/v1"


async def test_work_that_swallows_a_cancel_is_still_stopped_when_the_client_leaves() -> None:
    """Python 3.11's `wait_for` (under nats-py's `next_msg`) returns a reply already queued
    instead of raising the cancel: the work must be cancelled again, not waited for to its
    end while its client is gone."""
    stopped = asyncio.Event()
    cancels = 0

    async def work() -> None:
        nonlocal cancels
        try:
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    cancels += 1
                    if cancels > 1:
                        raise  # the first one swallowed, as wait_for did
        finally:
            stopped.set()

    class Gone:
        async def receive(self) -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    t0 = time.monotonic()
    assert await _unless_disconnected(work(), Gone()) is False  # type: ignore[arg-type]
    assert stopped.is_set() and cancels == 2
    assert time.monotonic() - t0 < 5.0


async def test_work_done_before_the_client_leaves_is_the_answer() -> None:
    class Stays:
        async def receive(self) -> dict[str, Any]:
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

    async def work() -> None:
        await asyncio.sleep(0.01)

    assert await _unless_disconnected(work(), Stays()) is True  # type: ignore[arg-type]

    async def fails() -> None:
        raise RuntimeError("the request's own failure")

    with pytest.raises(RuntimeError, match="own failure"):
        await _unless_disconnected(fails(), Stays())  # type: ignore[arg-type]
