"""What the HTTP side needs of the pipeline, as one small contract: submit a request and
follow its reply subject, cancel it, say whether the bus is reachable.

`NatsBackend` is the real one (`mooncake.client.submit` on the worker's connection, with the
HTTP client's id in the submission); the unit tests pass an in-memory one.
"""

from __future__ import annotations

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


class NatsBackend:
    def __init__(self, nc: NATS, publisher: Publisher, ns: ev.Namespace) -> None:
        self._nc = nc
        self._publisher = publisher
        self._ns = ns

    async def submit(
        self, submission: Submission, *, request_id: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        # The pipeline stops working on it when the gateway stops waiting (the deadline).
        async for body in client.submit(
            self._nc,
            submission.prompt,
            ns=self._ns,
            token_ids=submission.token_ids,
            params=submission.params,
            request_id=request_id,
            timeout_s=timeout_s,
            deadline_s=timeout_s,
            client_id=submission.client_id,
            publisher=self._publisher,
        ):
            yield body

    async def cancel(self, request_id: str, reason: str) -> None:
        await self._publisher.publish(ev.CancelRequested(request_id=request_id, reason=reason))

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)
