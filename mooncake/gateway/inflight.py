"""The gateway's bound on the completion requests it serves at once, and what that bound
costs in memory.

A completion request, streamed or whole, holds one slot from its arrival until its ASGI
call returns: after the last byte of its answer, or on an error, the client's disconnect,
the timeout or an exception. `InflightLimit` wraps the app at that point, so a slot is taken
and given back in exactly one place, whichever way the request ends. Past the limit a
request is answered at once with 503 `gateway_overloaded` and `Retry-After`, before its body
is read or anything is published: a refused request costs next to nothing. So is one whose
body (by its Content-Length; the largest allowed where it gives none) would take the bodies
in flight past `max_inflight_body_bytes`.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from mooncake import metrics
from mooncake.config import GatewaySettings
from mooncake.gateway import errors

COMPLETION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})

# What one in-flight request holds, its body aside (BODY_BYTES_PER_BYTE): the HTTP connection
# (uvicorn's protocol and transport), the ASGI call and its task, the `Call` with its `Outcome`,
# the reply-subject subscription and the submit generator. Measured 2026-12-02 on the dev
# container (Python 3.11, uvicorn 0.54 with httptools, nats-py 2.16, Linux x86-64): the gateway
# alone in a process (uvicorn on a socket, `NatsBackend` on an embedded nats-server, a stub
# pipeline admitting every request and sending it one token), warmed by 15 requests answered to
# their end, then N streamed completions ("Hi there") held open, one client connection each; the
# gateway's RSS after minus before, over N: 19.1 KiB at N = 200 (chat 15.1), 11.7 at 400, 7.9 at
# 1000 (about 5 KiB a request plus a first-use step of ~3 MiB). Rounded up from the 200 figure.
INFLIGHT_BYTES = 24 * 1024

# What one request's body costs while it is in flight, per byte of `max_body_bytes`: the
# raw chunks as read, the parsed JSON, then the prompt's token ids, which the submission and
# its `RequestSubmitted` each keep as a list (8 bytes a token id, more past 256) for the
# request's life, and what the tokenizer and allocator keep of the encoding. Measured as
# above, 5 to 20 requests with bodies of 1 MiB held open, RSS per body byte: a text prompt
# with a tokenizer of one token per byte (the worst a hostile text can do) 27.2 (5 held) and
# 17.2 (20); token-id prompts 5.1 (`[1,1,...]`) and 2.1 (`[100000,...]`). Python alone keeps
# 16 of the text's (tracemalloc: two 8-byte lists a token). Rounded up from the worst.
BODY_BYTES_PER_BYTE = 28


def memory_parts(settings: GatewaySettings) -> dict[str, int]:
    """The gateway's memory for requests, in bytes, at its limits: `inflight` the state of
    `max_inflight` requests, `bodies` `max_inflight_body_bytes` of their bodies. (The
    process's baseline is counted elsewhere.)"""
    return {
        "inflight": settings.max_inflight * INFLIGHT_BYTES,
        "bodies": settings.max_inflight_body_bytes * BODY_BYTES_PER_BYTE,
    }


def body_size(scope: Scope, max_body_bytes: int) -> int:
    """What a request's body counts against the bytes in flight: its Content-Length, or the
    largest body allowed where it gives none (chunked) or one that is no number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return min(max(int(value), 0), max_body_bytes)
            except ValueError:
                break
    return max_body_bytes


class InflightLimit:
    """ASGI middleware: at most `limit` completion requests (POSTs to `COMPLETION_ROUTES`)
    being served at once; other requests (health, metrics, models) pass uncounted."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        retry_after_s: int,
        body_limit: int | None = None,
        max_body_bytes: int = 1 << 20,
    ) -> None:
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.inflight = 0
        # The bodies' bytes in flight (by Content-Length), at most `body_limit`.
        self.body_limit = body_limit
        self.max_body_bytes = max_body_bytes
        self.body_bytes = 0
        metrics.GATEWAY_MAX_INFLIGHT.set(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in COMPLETION_ROUTES
        )
        if not counted:
            await self.app(scope, receive, send)
            return
        size = body_size(scope, self.max_body_bytes)
        over_bytes = self.body_limit is not None and self.body_bytes + size > self.body_limit
        if self.inflight >= self.limit or over_bytes:
            refused = errors.gateway_overloaded(
                self.limit, self.retry_after_s, None if not over_bytes else self.body_limit
            )
            await refused.response()(scope, receive, send)
            return
        # No await between the check and the count: one event loop, so no race.
        self.inflight += 1
        self.body_bytes += size
        metrics.GATEWAY_COMPLETIONS_IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
            self.body_bytes -= size
            metrics.GATEWAY_COMPLETIONS_IN_FLIGHT.dec()
