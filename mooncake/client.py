"""A small client: submit a request and follow what comes back on its reply subject."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client as NATS

from mooncake import events as ev
from mooncake.bus.publish import Publisher

TERMINAL_TYPES = frozenset(
    {"request.rejected", "request.completed", "request.failed", "request.cancelled"}
)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


async def submit(
    nc: NATS,
    prompt: str | None = None,
    *,
    ns: ev.Namespace | None = None,
    token_ids: list[int] | None = None,
    params: ev.SamplingParams | None = None,
    request_id: str | None = None,
    timeout_s: float = 30.0,
    until: frozenset[str] = TERMINAL_TYPES,
) -> AsyncIterator[dict[str, Any]]:
    """Publish one request and yield each message that comes back, until one whose type is
    in `until` (or the timeout)."""
    request_id = request_id or new_request_id()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        event = ev.RequestSubmitted(
            request_id=request_id,
            prompt=prompt,
            token_ids=token_ids,
            params=params or ev.SamplingParams(),
            reply_to=inbox,
        )
        await Publisher(nc, nc.jetstream(), ns or ev.Namespace()).publish(event)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except TimeoutError:
                break
            body = json.loads(msg.data)
            yield body
            if body.get("type") in until:
                return
    finally:
        await sub.unsubscribe()
