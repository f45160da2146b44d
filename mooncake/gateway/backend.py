"""What the HTTP side needs of the pipeline, as one small contract: submit a request and
follow its reply subject, read back what that missed, cancel it, say whether the bus is
reachable.

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
from mooncake.client import Outcome
from mooncake.gateway.translate import Submission

# An HTTP client waits on a read-back: a few seconds of a broker failing over, not the 20 s a
# command-line client rides out.
READ_BACK_WITHIN_S = 5.0


class Backend(Protocol):
    def new_reply_subject(self) -> str:
        """A fresh subject for one request's replies (the submitter's proof in a read-back)."""
        ...

    def submit(
        self, submission: Submission, *, request_id: str, reply_to: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """Publish the request; yield what comes back on `reply_to` (the decision, then token
        chunks) until the final chunk, a terminal decision or `timeout_s`; after each quiet
        stretch of `client.QUIET_S`, `client.QUIET`."""
        ...

    async def read_back(self, out: Outcome) -> None:
        """Fill what `out` missed (tokens, the final chunk) from the request's stored copy;
        raises when it cannot be read."""
        ...

    async def cancel(self, request_id: str, reason: str) -> None: ...

    @property
    def connected(self) -> bool: ...


class NatsBackend:
    def __init__(self, nc: NATS, publisher: Publisher, ns: ev.Namespace) -> None:
        self._nc = nc
        self._publisher = publisher
        self._ns = ns

    def new_reply_subject(self) -> str:
        return self._nc.new_inbox()

    async def submit(
        self, submission: Submission, *, request_id: str, reply_to: str, timeout_s: float
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
            tenant=submission.tenant,
            cache_namespace=submission.cache_namespace,
            publisher=self._publisher,
            quiet_s=client.QUIET_S,
            reply_to=reply_to,
        ):
            yield body

    async def read_back(self, out: Outcome) -> None:
        # The gateway's NATS user may not read MC_TOKENS: the read-back service may.
        await client.read_back(self._nc, self._ns, out, within_s=READ_BACK_WITHIN_S)

    async def cancel(self, request_id: str, reason: str) -> None:
        await self._publisher.publish(ev.CancelRequested(request_id=request_id, reason=reason))

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)
