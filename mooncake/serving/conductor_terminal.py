"""What the Conductor needs to end a request (failed: retries spent, no instance; or
cancelled): the requests it admitted and their clients, where a request is, and the ids of
the terminal events it would publish. The ending itself is `serving.ending.Ender`, the one
mechanism every stage uses."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mooncake import events as ev
from mooncake.core.cluster import ClusterView
from mooncake.serving.ending import CancelStage


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
