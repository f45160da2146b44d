"""The event queue: explicit simulated time, a heap ordered by (time, insertion order).

Two events at the same instant run in the order they were scheduled, so a run is a pure
function of its inputs (no wall clock, no hash order).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[..., None]


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callback, *args: Any) -> None:
        """Run `fn(*args)` at simulated time `t` (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def after(self, delay: float, fn: Callback, *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self) -> float:
        """Drain the queue; returns the time of the last event."""
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        return self.now
