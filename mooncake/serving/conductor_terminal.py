"""How the Conductor ends a request: failed (retries spent, no instance) or cancelled.

Every end goes through the terminal claim (`mooncake.bus.terminal`): whoever claims the
request's slot first publishes its one terminal event; everybody else (a decode worker that
finishes a moment later, a second cancel) loses the claim and publishes nothing. The claim
value is the event id, so a redelivered handler that claimed and crashed before publishing
claims again and publishes the same (deduplicated) event.

The client hears it too: a final `TokenChunk(done, finish_reason)` on its `reply_to`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus import terminal
from mooncake.bus.publish import Publisher
from mooncake.core.cluster import ClusterView
from mooncake.work import TokenChunk

log = logging.getLogger("mooncake.conductor.terminal")

FailStage = Literal["admission", "prefill", "decode", "store", "unknown"]
CancelStage = Literal["admission", "prefill", "decode", "unknown"]


@dataclass(frozen=True, slots=True)
class Known:
    """What the Conductor remembers of a request it admitted."""

    reply_to: str | None
    admitted_event_id: str


class KnownRequests:
    """Admitted requests by id, bounded (oldest forgotten first): enough to answer a cancel's
    client; a request forgotten here still ends correctly, only without the final chunk."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Known] = OrderedDict()

    def add(self, request_id: str, known: Known) -> None:
        self._items[request_id] = known
        self._items.move_to_end(request_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, request_id: str) -> Known | None:
        return self._items.get(request_id)

    def forget(self, request_id: str) -> None:
        self._items.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._items)


def cancel_stage(view: ClusterView, request_id: str, known: bool) -> CancelStage:
    """Where a request is, as far as the view knows."""
    r = view.inflight.get(request_id)
    if r is not None:
        return "prefill" if r.phase in ("queued", "prefilling") else "decode"
    return "unknown" if known else "admission"


def failed_event_id(admitted_event_id: str, stage: str) -> str:
    return ev.derived_event_id(admitted_event_id, f"failed-{stage}")


def cancelled_event_id(cancel_event_id: str) -> str:
    return ev.derived_event_id(cancel_event_id, "cancelled")


class Ender:
    def __init__(self, nc: NATS, publisher: Publisher, kv: KeyValue) -> None:
        self.nc, self.publisher, self.kv = nc, publisher, kv

    async def fail(
        self,
        request_id: str,
        event_id: str,
        *,
        reason: str,
        stage: FailStage,
        detail: str = "",
        reply_to: str | None = None,
    ) -> bool:
        """Fail the request unless something else ended it first; True if this did."""
        if not await terminal.claim(self.kv, request_id, "failed", event_id):
            return False
        await self.publisher.publish(
            ev.RequestFailed(
                event_id=event_id, request_id=request_id, reason=reason, stage=stage,
                detail=detail[:2000],
            )
        )  # fmt: skip
        await self._final_chunk(reply_to, request_id, "failed", f"{reason}: {detail}"[:2000])
        metrics.REQUESTS_ENDED_BY_CONDUCTOR.labels("failed", reason).inc()
        log.warning("request %s failed at %s: %s %s", request_id, stage, reason, detail)
        return True

    async def cancel(
        self, cancel: ev.CancelRequested, stage: CancelStage, reply_to: str | None
    ) -> bool:
        event_id = cancelled_event_id(cancel.event_id)
        if not await terminal.claim(self.kv, cancel.request_id, "cancelled", event_id):
            return False
        await self.publisher.publish(
            ev.RequestCancelled(
                event_id=event_id, request_id=cancel.request_id, reason=cancel.reason,
                stage=stage,
            )
        )  # fmt: skip
        await self._final_chunk(reply_to, cancel.request_id, "cancelled", None)
        metrics.REQUESTS_ENDED_BY_CONDUCTOR.labels("cancelled", "requested").inc()
        return True

    async def _final_chunk(
        self,
        reply_to: str | None,
        request_id: str,
        finish: Literal["cancelled", "failed"],
        error: str | None,
    ) -> None:
        """The client's last chunk. It carries no tokens, so its index is no offset; 0."""
        if not reply_to:
            return
        chunk = TokenChunk(
            request_id=request_id, index=0, done=True, finish_reason=finish, error=error
        )
        await self.nc.publish(reply_to, chunk.to_json())
