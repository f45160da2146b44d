"""What the HTTP side needs of the pipeline, as one small contract: submit a request and
follow its reply subject, cancel it, say whether the bus is reachable.

`NatsBackend` is the real one (the worker's connection; what `mooncake.client.submit` does,
plus the HTTP client's id in the submission); the unit tests pass an in-memory one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from nats.aio.client import Client as NATS

from mooncake import client
from mooncake import events as ev
from mooncake.bus.publish import Publisher
from mooncake.gateway.translate import Submission


class Backend(Protocol):
    def submit(
        self, submission: Submission, *, request_id: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """Publish the request; yield what comes back on its reply subject (the decision,
        then token chunks) until the final chunk, a terminal decision or `timeout_s`."""
        ...

    async def cancel(self, request_id: str, reason: str) -> None: ...

    @property
    def connected(self) -> bool: ...


def submitted_event(
    submission: Submission, *, request_id: str, reply_to: str, deadline_s: float | None
) -> ev.RequestSubmitted:
    """The `request.submitted` the gateway publishes for one HTTP request."""
    return ev.RequestSubmitted(
        request_id=request_id,
        prompt=submission.prompt,
        token_ids=submission.token_ids,
        params=submission.params,
        client_id=submission.client_id,
        reply_to=reply_to,
        deadline_s=deadline_s,
    )


class NatsBackend:
    def __init__(self, nc: NATS, publisher: Publisher, ns: ev.Namespace) -> None:
        self._nc = nc
        self._publisher = publisher
        self._ns = ns

    async def submit(
        self, submission: Submission, *, request_id: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """What `mooncake.client.submit` does, with the HTTP client named in the event."""
        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox)
        try:
            # The pipeline stops working on it when the gateway stops waiting.
            event = submitted_event(
                submission, request_id=request_id, reply_to=inbox, deadline_s=timeout_s
            )
            await self._publisher.publish(event)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while (remaining := deadline - loop.time()) > 0:
                try:
                    msg = await sub.next_msg(timeout=remaining)
                except TimeoutError:
                    return
                try:
                    body = json.loads(msg.data)
                except ValueError:
                    continue
                if isinstance(body, dict):
                    yield body
                    if client.is_final(body, client.TERMINAL_TYPES):
                        return
        finally:
            await sub.unsubscribe()

    async def cancel(self, request_id: str, reason: str) -> None:
        await self._publisher.publish(ev.CancelRequested(request_id=request_id, reason=reason))

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)
