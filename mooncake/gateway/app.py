"""The gateway's ASGI app: OpenAI's completions, chat completions and models endpoints over
the pipeline, plus `/health` and `/metrics`.

One request's life (`Call`): the gateway's own bound on requests in flight first
(inflight.py: 503 `gateway_overloaded` with `Retry-After`, before the body is read), then
the client's own limit (a token bucket per API key or remote address: 429
`client_rate_limited` with `Retry-After`), validate the body once (400 with the field named,
404 for a model this server does not serve), turn it into a submission (translate.py),
publish it and wait for the Conductor's decision. A rejection is answered before any stream
starts, so a client sees 429 + `Retry-After` (or 400 when the request itself was invalid)
rather than a broken stream. Admitted: either the whole answer as one JSON body, or
server-sent events as tokens arrive, then `data: [DONE]`. A request the client stops
listening to (a stream's disconnect) or that outlives the timeout is cancelled in the
pipeline (`mc.req.cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.client import QUIET, InOrderText, Looks, Outcome, new_request_id
from mooncake.config import Settings
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.gateway import errors
from mooncake.gateway import translate as tr
from mooncake.gateway.backend import Backend
from mooncake.gateway.inflight import InflightLimit
from mooncake.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)
from mooncake.hashing import DEFAULT_TENANT
from mooncake.ratelimit import ClientLimits, Limit, retry_after_s
from mooncake.telemetry import tracer

log = logging.getLogger("mooncake.gateway")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
ENDED_TYPES = ("request.failed", "request.cancelled")
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    model_id: str
    retry_after_s: int = 2
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    # The model's context in tokens (from its header; None: unknown): a chat request without
    # max_tokens generates up to the room its prompt leaves, at most DEFAULT_CHAT_MAX_TOKENS.
    context: int | None = None
    # Per-client token bucket on the completion routes (0: off); see `client_of`.
    client_rate_per_s: float = 10.0
    client_burst: int = 20
    # Completion requests served at once (inflight.py); past it, 503 gateway_overloaded.
    max_inflight: int = 512
    max_inflight_body_bytes: int | None = None  # the bodies' bytes in flight (None: no limit)

    @classmethod
    def from_settings(cls, s: Settings) -> GatewayOptions:
        g = s.gateway
        return cls(
            s.model_id, g.retry_after_s, g.request_timeout_s, g.max_body_bytes,
            client_rate_per_s=g.client_rate_per_s, client_burst=g.client_burst,
            max_inflight=g.max_inflight, max_inflight_body_bytes=g.max_inflight_body_bytes,
        )  # fmt: skip


# --- who is asking --------------------------------------------------------------------------------


def client_of(request: Request) -> str:
    """The client a request counts against: its API key (`Authorization: Bearer <key>`),
    else its remote address. A subject-safe id: the key only as a digest (ids are recorded
    with every submission; a key must never be), the address with its separators replaced."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:32]
    host = request.client.host if request.client is not None else "unknown"
    return "addr-" + re.sub(r"[^A-Za-z0-9_-]", "_", host)[:59]


TENANT_HEADER = "x-mooncake-tenant"
CACHE_NAMESPACE_HEADER = "x-mooncake-cache-namespace"
_TOKEN = re.compile(ev.TOKEN_PATTERN)


def tenant_of(request: Request, user: str | None) -> tuple[str, str | None]:
    """(tenant, shared cache namespace or None) of a request. The tenant: the
    `X-Mooncake-Tenant` header (set by the deployment's own auth in front of the gateway),
    else the body's OpenAI `user` (free-form: as itself where it is a plain id, else a digest
    of it), else the default tenant. Tenants share no cached KV unless a request names a
    namespace in `X-Mooncake-Cache-Namespace` (or its tenant has one configured). Whoever
    sets these is trusted: isolation holds between tenants as far as they cannot set each
    other's."""
    header = request.headers.get(TENANT_HEADER)
    if header is not None:
        if not _TOKEN.match(header):
            raise errors.bad_request(
                f"{TENANT_HEADER} must be 1-64 of A-Z a-z 0-9 _ - (got {header[:80]!r})",
                code="invalid_tenant",
            )
        tenant = header
    elif user:
        plain = _TOKEN.match(user) is not None
        tenant = user if plain else "u-" + hashlib.sha256(user.encode()).hexdigest()[:32]
    else:
        tenant = DEFAULT_TENANT
    shared = request.headers.get(CACHE_NAMESPACE_HEADER)
    if shared is not None and not _TOKEN.match(shared):
        raise errors.bad_request(
            f"{CACHE_NAMESPACE_HEADER} must be 1-64 of A-Z a-z 0-9 _ - (got {shared[:80]!r})",
            code="invalid_cache_namespace",
        )
    return tenant, shared


# --- request bodies -------------------------------------------------------------------------------


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused (413) past `limit` bytes before more is read."""
    declared = request.headers.get("content-length", "")
    too_large = errors.ApiError(
        413, f"the body exceeds {limit} bytes", errors.INVALID, code="body_too_large"
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
        found = ev.unencodable(data)
    except ValueError as exc:
        raise errors.bad_request(f"malformed JSON body: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # `[[[[...` about a thousand deep: past Python's stack
        raise errors.bad_request(
            "malformed JSON body: arrays or objects nested too deeply", code="invalid_json"
        ) from exc
    if found is not None:
        where = found.encode("utf-8", "backslashreplace").decode()  # a key may be the culprit
        raise errors.bad_request(
            f"{where or 'body'}: {ev.LONE_SURROGATE}",
            param=where.split(".", 1)[0] or None, code="invalid_encoding",
        )  # fmt: skip
    return data


def parse(model: type[Body], data: Any) -> Body:
    if not isinstance(data, dict):
        raise errors.bad_request("the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise errors.invalid_body(exc) from exc


# --- one request ----------------------------------------------------------------------------------


@dataclass
class Call:
    """One submitted request: what came back so far and how it ended."""

    gateway: Gateway
    request_id: str
    replies: AsyncIterator[dict[str, Any]]
    fmt: tr.ChunkFormat
    prompt_tokens: int
    out: Outcome
    span: trace.Span
    ended: dict[str, Any] | None = None  # a request.failed / request.cancelled event
    over: bool = False  # the reply stream ended (final chunk, terminal event or timeout)
    delivered: bool = False  # the client has had everything there is to say
    unsent: bool = False  # the submission could not be published
    closed: bool = field(default=False, repr=False)
    looks: Looks = field(default_factory=Looks, repr=False)

    async def next(self) -> dict[str, Any] | None:
        """The next reply (or `QUIET`, after which the answer may have grown from the copy);
        None once the reply stream is over. Live replies travel on core NATS, which drops
        what is published while the gateway reconnects to a broker: a stream that ends with
        tokens or its end missing, or stalls mid-answer, is completed from the request's
        stored copy (`Backend.read_back`) before the client is answered."""
        if self.over:
            return None
        try:
            body = await anext(self.replies)
        except StopAsyncIteration:
            if self.out.incomplete:
                await self._read_back()
            self.over = True
            return None
        if body is QUIET:
            if self.looks.due(bool(self.out.tokens)):
                await self._read_back()
                if self.out.finish_reason is not None and not self.out.missing():
                    self.over = True  # the copy ended it
                    return None
            return body
        self.out.take(body)
        if body.get("type") in ENDED_TYPES:
            self.ended = body
        return body

    async def _read_back(self) -> None:
        try:
            await self.gateway.backend.read_back(self.out)
        except Exception as exc:  # best effort: the client is answered with what there is
            log.warning("%s: not read back from its copy: %s", self.request_id, exc)

    def _decided(self) -> bool:
        o = self.out
        return bool(o.decision or o.tokens or o.finish_reason or self.ended)

    async def decide(self) -> None:
        """Wait for the Conductor's decision (or the first token: the decision and prefill's
        first token come from different publishers); raise what ended the request early."""
        try:
            with trace.use_span(self.span, end_on_exit=False):
                while not self._decided() and await self.next() is not None:
                    pass
        except errors.ApiError:
            raise
        except Exception as exc:  # the publish itself failed: the bus is down
            self.over = self.unsent = True
            raise errors.unavailable(f"could not submit the request: {exc}") from exc
        o = self.out
        unfinished = o.finish_reason is not None and not o.finished
        if self.over or o.rejected_reason is not None or unfinished or self.ended:
            if (err := self.problem()) is not None:
                raise err

    async def run_out(self) -> None:
        while await self.next() is not None:
            pass

    def problem(self) -> errors.ApiError | None:
        """Why there is no (whole) answer; None when it finished."""
        o, opts = self.out, self.gateway.options
        if o.rejected_reason is not None and o.decision is not None:
            return errors.rejected(o.decision, opts.retry_after_s)
        if o.finished and (lost := o.missing()):  # never an answer with a hole in it
            return errors.unavailable(
                f"tokens {lost[:8]} of the answer were lost in transit and could not be "
                "read back from the request's copy; retry"
            )
        if o.finished:
            return None
        if self.ended is not None:
            kind = "cancelled" if self.ended.get("type") == "request.cancelled" else "failed"
            detail = self.ended.get("detail") or self.ended.get("reason")
            return errors.ended_badly(kind, str(detail) if detail else None)
        if o.finish_reason is not None:
            return errors.ended_badly(o.finish_reason, o.error)
        return errors.timed_out(opts.request_timeout_s)

    def usage(self) -> Usage:
        prompt = self.prompt_tokens
        if not prompt and self.out.decision:
            prompt = int(self.out.decision.get("prompt_tokens") or 0)
        return tr.usage(prompt, self.out)

    async def events(self, include_usage: bool) -> AsyncGenerator[bytes, None]:
        """The SSE stream: text in token order as it arrives, the finish, [DONE]."""
        fmt, text = self.fmt, InOrderText(self.out)
        if (first := fmt.first()) is not None:
            yield first
        while True:
            if piece := text.release():
                yield fmt.text(piece)
            if await self.next() is None:
                break
        err = self.problem()
        if err is None:
            if tail := text.rest():
                yield fmt.text(tail)
            yield fmt.finish(self.out.finish_reason)
            if include_usage:
                yield fmt.usage(self.usage())
        else:
            yield tr.error_event(err)
        yield tr.DONE
        self.delivered = True

    async def close(self) -> None:
        """Stop following the reply subject; cancel the request if it may still be running
        (the client went away, or the timeout passed)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self.replies.aclose()  # type: ignore[attr-defined]
        o = self.out
        if not (self.unsent or o.rejected_reason is not None or o.finish_reason or self.ended):
            # Over without an end: the timeout; not over: nobody listens any more.
            reason = "timeout" if self.over else "client_disconnected"
            log.info("%s: %s before its end; cancelling it", self.request_id, reason)
            await self.gateway.cancel(self.request_id, reason)
        elif not (self.delivered or self.unsent or o.rejected_reason is not None):
            # Not answered whole, yet over: nothing to stop (said, for a missing cancel).
            log.info("%s: not answered whole and not cancelled (finish %s, ended %s)",
                     self.request_id, o.finish_reason, (self.ended or {}).get("type"))  # fmt: skip
        self.span.end()


class EventStream(StreamingResponse):
    """SSE whose cleanup runs however the stream ends (finished, client gone, shutdown)."""

    media_type = "text/event-stream"

    def __init__(self, call: Call, include_usage: bool, headers: dict[str, str]) -> None:
        self._call = call
        self._events = call.events(include_usage)
        super().__init__(
            self._events,
            headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Not awaited here: this task may be being cancelled (disconnect, shutdown).
            self._call.gateway.spawn(self._finish())

    async def _finish(self) -> None:
        with contextlib.suppress(Exception):
            await self._events.aclose()
        await self._call.close()


# --- the handlers' shared state -------------------------------------------------------------------


T = TypeVar("T")


class Gateway:
    def __init__(
        self, backend: Backend, options: GatewayOptions, tokenizer: ChatTokenizer | None
    ) -> None:
        self.backend = backend
        self.options = options
        self.tokenizer = tokenizer
        self.started = int(time.time())
        self._background: set[asyncio.Task[Any]] = set()
        self.limits = ClientLimits(Limit(options.client_rate_per_s, options.client_burst))
        self.clock = time.monotonic

    def admit_client(self, request: Request) -> str:
        """The client's id, or 429 `client_rate_limited` when it is over its limit (checked
        before the body is read: a flood costs as little as possible)."""
        client = client_of(request)
        wait = self.limits.take(client, self.clock())
        if wait > 0:
            raise errors.retry_later(
                429, "too many requests from this client", errors.OVERLOADED,
                "client_rate_limited", retry_after_s(wait),
            )  # fmt: skip
        return client

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Let the cleanups (cancels) in flight finish: before the bus connection closes."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    async def cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.backend.cancel(request_id, reason)
        except Exception as exc:  # best effort: the deadline stops it in the pipeline anyway
            log.warning("cancel of %s not published: %s", request_id, exc)

    def check_model(self, model: str) -> None:
        if model != self.options.model_id:
            raise errors.model_not_found(model, self.options.model_id)

    async def answer(
        self,
        submission: tr.Submission,
        req: SamplingFields,
        *,
        chat: bool,
        request: Request | None = None,
    ) -> Response:
        if not self.backend.connected:
            raise errors.unavailable("the message bus (NATS) is not connected")
        rid = new_request_id()
        headers = {"x-request-id": rid}
        fmt = tr.ChunkFormat(
            chat, tr.response_id("chatcmpl" if chat else "cmpl", rid),
            self.options.model_id, int(time.time()),
        )  # fmt: skip
        route = "/v1/chat/completions" if chat else "/v1/completions"
        span = tracer().start_span(
            f"gateway {route}", kind=SpanKind.SERVER,
            attributes={"mc.request_id": rid, "mc.tenant": submission.tenant},
        )  # fmt: skip
        reply_to = self.backend.new_reply_subject()
        replies = self.backend.submit(
            submission, request_id=rid, reply_to=reply_to,
            timeout_s=self.options.request_timeout_s,
        )  # fmt: skip
        call = Call(
            self, rid, replies, fmt, len(submission.token_ids or ()),
            Outcome(rid, submitted_at=time.monotonic(), reply_to=reply_to), span,
        )  # fmt: skip
        streaming = False
        try:
            await call.decide()
            if req.stream:
                streaming = True  # the stream's end closes the call
                return EventStream(call, req.include_usage, headers)
            if not await _unless_disconnected(call.run_out(), request):
                return Response(status_code=499)  # nobody reads it; close() cancels the request
            if (problem := call.problem()) is not None:
                raise problem
            body_of = tr.chat_body if chat else tr.completion_body
            body = body_of(fmt.rid, fmt.model, fmt.created, call.out, call.usage().prompt_tokens)
            call.delivered = True
            return JSONResponse(body.model_dump(), headers=headers)
        except errors.ApiError as err:
            err.headers.setdefault("x-request-id", rid)
            raise
        finally:
            if not streaming:
                self.spawn(call.close())


async def _unless_disconnected(work: Awaitable[None], request: Request | None) -> bool:
    """Run `work` while watching the client: False (and `work` stopped) if the client hung
    up first. The body has been read, so the next ASGI message is the disconnect.

    `work` is stopped by `aio.cancel_all`, which cancels again while it runs: one cancel
    could be swallowed (Python 3.11's `wait_for` under nats-py's `next_msg` returns a reply
    already queued instead of raising), and the request then ran to its last token
    uncancelled, its client long gone (CI, twice: the decode's tokens came fast enough that
    one was always queued)."""
    task = asyncio.ensure_future(work)
    if request is None:
        await task
        return True

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all([task, watch])
        for t in (task, watch):  # retrieved: what ended with the client gone is nobody's
            if t.done() and not t.cancelled():
                t.exception()
    if task in done:
        task.result()  # its failure, if any, is the request's
        return True
    return False


# --- metrics --------------------------------------------------------------------------------------


def route_label(path: str) -> str:
    """A bounded label: the known routes, else `other` (paths are client-chosen)."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class HttpMetrics:
    """Requests by route and status, and their time to the end of the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        status = 500  # what an exception escaping the app becomes
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        metrics.GATEWAY_IN_FLIGHT.labels(route).inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            metrics.GATEWAY_IN_FLIGHT.labels(route).dec()
            metrics.GATEWAY_REQUESTS.labels(route, str(status)).inc()
            metrics.GATEWAY_REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)


# --- the app --------------------------------------------------------------------------------------


def create_app(
    backend: Backend, options: GatewayOptions, tokenizer: ChatTokenizer | None = None
) -> FastAPI:
    gw = Gateway(backend, options, tokenizer)
    app = FastAPI(title="mooncake gateway", summary="OpenAI-compatible API over mooncake")
    app.state.gateway = gw
    # Inside HttpMetrics, so its refusals are counted with the rest (by route and status).
    app.add_middleware(
        InflightLimit, limit=options.max_inflight, retry_after_s=options.retry_after_s,
        body_limit=options.max_inflight_body_bytes, max_body_bytes=options.max_body_bytes,
    )  # fmt: skip
    app.add_middleware(HttpMetrics)

    @app.exception_handler(errors.ApiError)
    async def _api_error(_: Request, exc: errors.ApiError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> Response:
        kind = errors.NOT_FOUND if exc.status_code == 404 else errors.INVALID
        return errors.ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        err = errors.ApiError(500, f"internal error: {type(exc).__name__}", errors.SERVER)
        return err.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        client = gw.admit_client(request)
        req = parse(CompletionRequest, await read_json(request, options.max_body_bytes))
        gw.check_model(req.model)
        submission = tr.completion_submission(req, gw.tokenizer)
        tenant, shared = tenant_of(request, req.user)
        submission = replace(submission, client_id=client, tenant=tenant, cache_namespace=shared)
        return await gw.answer(submission, req, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        client = gw.admit_client(request)
        req = parse(ChatCompletionRequest, await read_json(request, options.max_body_bytes))
        gw.check_model(req.model)
        submission = tr.chat_submission(req, gw.tokenizer, options.context)
        tenant, shared = tenant_of(request, req.user)
        submission = replace(submission, client_id=client, tenant=tenant, cache_namespace=shared)
        return await gw.answer(submission, req, chat=True, request=request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=options.model_id, created=gw.started)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        gw.check_model(model)
        return ModelCard(id=options.model_id, created=gw.started)

    @app.get("/health")
    async def health() -> Response:
        ok = backend.connected
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "nats": ok, "model": options.model_id},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.GATEWAY_SCOPE), media_type=CONTENT_TYPE_LATEST)

    return app
