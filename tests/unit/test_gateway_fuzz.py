"""Fuzzing the gateway's HTTP ingress through its ASGI app (httpx.ASGITransport), with an
in-memory pipeline that builds the `request.submitted` the real backend publishes (as
`mooncake.client.submit` builds it), so whatever the gateway lets through must validate.

The law: a client's mistake is a 4xx with an OpenAI error body, never a 5xx; what is
accepted is answered. Fuzzed: JSON bodies of any shape and valid bodies with one field
mutated, raw bytes, paths, `Authorization` headers; plus bodies over `max_body_bytes`
(declared and streamed without a length) and a flood from one client (per-client limit:
429 `client_rate_limited` + `Retry-After`, while another client is served)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers import decoders as tk_decoders
from tokenizers.models import BPE

from mooncake import events as ev
from mooncake.client import TERMINAL_TYPES, Outcome, is_final
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.gateway import GatewayOptions, create_app
from mooncake.gateway.app import Gateway, client_of
from mooncake.gateway.translate import Submission

MODEL = "fuzz-model"
LIMIT_BYTES = 4096
FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class Pipeline:
    """Validates the submission as the real backend would, then answers one token."""

    def __init__(self) -> None:
        self.submitted: list[Submission] = []
        self.connected = True

    def new_reply_subject(self) -> str:
        return "_INBOX.x"

    async def submit(
        self, submission: Submission, *, request_id: str, reply_to: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        ev.RequestSubmitted(  # what mooncake.client.submit publishes for the gateway
            request_id=request_id,
            prompt=submission.prompt,
            token_ids=submission.token_ids,
            params=submission.params,
            client_id=submission.client_id,
            reply_to=reply_to,
            deadline_s=1.0,
        )
        self.submitted.append(submission)
        replies = [
            {"type": "request.admitted", "request_id": request_id, "policy": "none"},
            {"request_id": request_id, "index": 0, "token_ids": [7], "text": "ok"},
            {"request_id": request_id, "index": 1, "token_ids": [], "text": "", "done": True,
             "finish_reason": "length"},
        ]  # fmt: skip
        for body in replies:
            yield body
            if is_final(body, TERMINAL_TYPES):
                return

    async def read_back(self, out: Outcome) -> None:
        raise AssertionError("every answer arrives whole here: nothing to read back")

    async def cancel(self, request_id: str, reason: str) -> None:
        return None


def byte_tokenizer() -> ChatTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = {"<|im_start|>": len(vocab), "<|im_end|>": len(vocab) + 1}
    tok = Tokenizer(BPE(vocab=vocab | specials, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
    )
    return ChatTokenizer(
        tok, eos_id=specials["<|im_end|>"], template=template, special_tokens=specials
    )


class Rig:
    def __init__(self, **opts: Any) -> None:
        defaults: dict[str, Any] = {"max_body_bytes": LIMIT_BYTES, "client_rate_per_s": 0.0}
        self.pipeline = Pipeline()
        self.app = create_app(
            self.pipeline,  # type: ignore[arg-type]
            GatewayOptions(MODEL, **(defaults | opts)),
            byte_tokenizer(),
        )
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://gw", timeout=10
        )

    @property
    def gateway(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.run(self.http.request(method, path, **kw))  # type: ignore[no-any-return]

    def post(self, path: str, content: bytes, **headers: str) -> httpx.Response:
        h = {"content-type": "application/json"} | headers
        return self.request("POST", path, content=content, headers=h)

    def close(self) -> None:
        self.run(self.http.aclose())
        self.run(self.gateway.drain())
        self.loop.close()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def check(resp: httpx.Response, what: object) -> None:
    """A 2xx answer, or a 4xx with an OpenAI error body; never a 5xx."""
    assert resp.status_code < 500, (what, resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert err["type"] in {"invalid_request_error", "not_found_error", "rate_limit_error"}
    else:
        assert resp.status_code == 200, resp.text
        if resp.headers["content-type"].startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
        else:
            assert resp.json()["choices"], resp.text


# --- bodies ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip
# Values worth trying in any field: edges of every type the schemas take.
odd = st.one_of(
    json_values,
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 1e-320,
                     "", " ", "\x00", "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"),
                     "a" * 5000, [], {}, [0], [-1], [2**40], [[1]], ["x"], True, False]),
)  # fmt: skip
COMPLETION = {
    "model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
    "top_k": 5, "seed": 1, "stop": ["\n"], "stream": False, "n": 1, "user": "u",
    "stream_options": {"include_usage": True}, "echo": False,
}  # fmt: skip
CHAT = {
    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
    "max_completion_tokens": 4, "temperature": 0.5, "stream": True, "stop": "x",
    "response_format": {"type": "text"}, "seed": 3,
}  # fmt: skip
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one field set to something odd, removed, or one field added."""
    keys = st.sampled_from(sorted(base))
    return st.one_of(
        st.builds(lambda k, v: base | {k: v}, keys, odd),
        st.builds(lambda k: {x: y for x, y in base.items() if x != k}, keys),
        st.builds(lambda k, v: base | {k: v}, st.text(min_size=1, max_size=12), odd),
        st.builds(
            lambda i, msg: base | {"messages": [*base.get("messages", [])[:i], msg]},
            st.integers(0, 1),
            st.dictionaries(
                st.sampled_from(["role", "content", "name", "type", "text"]), odd, max_size=3
            ),
        ),
    )


@FUZZ
@given(path=st.sampled_from(sorted(ROUTES)), data=st.data())
def test_mutated_valid_bodies_get_4xx_never_5xx(rig: Rig, path: str, data: Any) -> None:
    body = data.draw(mutated(ROUTES[path]))
    try:
        content = json.dumps(body).encode()
    except (TypeError, ValueError):
        return  # not JSON (a lone surrogate): nothing a client can send
    check(rig.post(path, content), body)


@FUZZ
@given(path=st.sampled_from(sorted(ROUTES)), body=json_values)
def test_any_json_body_gets_4xx_never_5xx(rig: Rig, path: str, body: Any) -> None:
    check(rig.post(path, json.dumps(body).encode()), body)


@FUZZ
@given(path=st.sampled_from(sorted(ROUTES)), raw=st.binary(max_size=600))
def test_raw_bytes_get_4xx_never_5xx(rig: Rig, path: str, raw: bytes) -> None:
    resp = rig.post(path, raw)
    check(resp, raw)
    if resp.status_code == 400 and raw[:1] not in (b"{", b"[", b'"', b" "):
        assert resp.json()["error"]["code"] in ("invalid_json", "invalid_value")


PATH_CHARS = st.characters(
    max_codepoint=0x2FF, exclude_categories=("Cc", "Zs"), exclude_characters="?#"
)


@settings(max_examples=100, deadline=None)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.text(PATH_CHARS, max_size=40),
)
def test_any_method_and_path_gets_4xx_never_5xx(rig: Rig, method: str, path: str) -> None:
    resp = rig.request(method, "/" + path.lstrip("/"))
    assert resp.status_code < 500, (method, path, resp.status_code)


@settings(max_examples=100, deadline=None)
@given(auth=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200))
def test_any_authorization_header_names_a_client_safely(rig: Rig, auth: str) -> None:
    before = len(rig.pipeline.submitted)
    resp = rig.post("/v1/completions", json.dumps(COMPLETION).encode(), authorization=auth)
    check(resp, auth)
    assert resp.status_code == 200
    client = rig.pipeline.submitted[before].client_id
    assert client is not None and len(client) <= 64
    assert client.replace("-", "").replace("_", "").isalnum()
    key = auth.partition(" ")[2].strip()
    assert not key or len(key) < 8 or key not in client  # a key is never sent on


# --- oversize -------------------------------------------------------------------------------------


def test_bodies_over_the_limit_are_413_declared_or_streamed(rig: Rig) -> None:
    big = json.dumps(COMPLETION | {"prompt": "x" * (LIMIT_BYTES * 4)}).encode()
    resp = rig.post("/v1/completions", big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no content-length: read until the limit
        for _ in range(64):
            yield b" " * 1024

    resp = rig.request(
        "POST", "/v1/chat/completions", content=chunks(),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert resp.status_code == 413
    resp = rig.request(
        "POST", "/v1/completions", content=b"{}",
        headers={"content-type": "application/json", "content-length": str(10**12)},
    )  # fmt: skip
    assert resp.status_code in (400, 413)  # a lying length: refused either way
    n = len(rig.pipeline.submitted)
    ok = json.dumps(COMPLETION | {"prompt": "y" * (LIMIT_BYTES - 600)}).encode()
    assert len(ok) <= LIMIT_BYTES
    assert rig.post("/v1/completions", ok).status_code == 200  # just under: served
    assert len(rig.pipeline.submitted) == n + 1


# --- floods ---------------------------------------------------------------------------------------


def test_a_flood_from_one_client_is_429_and_others_are_still_served() -> None:
    r = Rig(client_rate_per_s=5.0, client_burst=10)
    now = [1000.0]
    r.gateway.clock = lambda: now[0]  # a frozen clock: the burst is all there is
    body = json.dumps(COMPLETION).encode()

    async def flood(key: str, n: int) -> list[httpx.Response]:
        h = {"content-type": "application/json", "authorization": f"Bearer {key}"}
        return list(
            await asyncio.gather(
                *(r.http.post("/v1/completions", content=body, headers=h) for _ in range(n))
            )
        )

    try:
        greedy = r.run(flood("sk-greedy", 200))
        codes = [x.status_code for x in greedy]
        assert codes.count(200) == 10 and codes.count(429) == 190, set(codes)
        limited = next(x for x in greedy if x.status_code == 429)
        assert limited.json()["error"]["code"] == "client_rate_limited"
        assert limited.headers["retry-after"] == "1"  # 1/rate = 0.2 s, rounded up
        # Other clients: another key, and no key (the remote address) are untouched.
        assert [x.status_code for x in r.run(flood("sk-polite", 3))] == [200] * 3
        assert r.post("/v1/completions", body).status_code == 200
        # The greedy client gets more as time passes: its rate, no more.
        now[0] += 1.0
        codes = [x.status_code for x in r.run(flood("sk-greedy", 20))]
        assert codes.count(200) == 5
        assert len(r.pipeline.submitted) == 10 + 3 + 1 + 5  # refused ones never reached it
    finally:
        r.close()


def test_the_limit_is_checked_before_the_body_is_read() -> None:
    """A limited client's oversize or malformed bodies cost a bucket lookup, not a parse."""
    r = Rig(client_rate_per_s=1.0, client_burst=1)
    r.gateway.clock = lambda: 0.0
    try:
        assert r.post("/v1/completions", b"not json").status_code == 400  # took the token
        big = b"x" * (LIMIT_BYTES * 10)
        assert r.post("/v1/completions", big).status_code == 429
        assert r.post("/v1/chat/completions", b"{").status_code == 429
        assert r.request("GET", "/v1/models").status_code == 200  # only completions count
    finally:
        r.close()


def test_client_identity() -> None:
    def req(headers: dict[str, str], client: tuple[str, int] | None = ("10.1.2.3", 5)) -> Any:
        from starlette.requests import Request

        scope = {
            "type": "http", "method": "POST", "path": "/", "client": client,
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }  # fmt: skip
        return Request(scope)

    a = client_of(req({"Authorization": "Bearer sk-abc"}))
    assert a.startswith("key-") and "sk-abc" not in a
    assert a == client_of(req({"authorization": "bearer  sk-abc "}, ("9.9.9.9", 1)))
    assert a != client_of(req({"Authorization": "Bearer sk-abd"}))
    assert client_of(req({})) == "addr-10_1_2_3"
    assert client_of(req({"Authorization": "Basic dTpw"})) == "addr-10_1_2_3"
    assert client_of(req({}, ("2001:db8::1", 1))) == "addr-2001_db8__1"
    assert client_of(req({}, None)) == "addr-unknown"
