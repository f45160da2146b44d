"""The sweep of the Conductor's view: requests it counts in flight whose end it never heard.

The Conductor follows admitted requests through their lifecycle events on core NATS
subscriptions (`conductor_feed.LiveFeed`): hints, not durable. An end published while it was
cut off (a broker restart, a reconnect, a slow consumer's dropped messages) never reaches it,
and the request would stay in its view until a restart: in its instance's queue or decode
reservation, which every later prediction waits behind, and against `conductor.max_inflight`.
Whoever ends a request first claims its terminal slot (`bus/terminal.py`, durable), so every
half of `conductor.inflight_check_after_s` the sweep asks the slots of the requests not known
to run for that long (`ClusterView.unchecked`: the longest unknown first, at most
SWEEP_BATCH a sweep). One that ended leaves the view as a drop, with a warning and
`mc_conductor_inflight_swept_total`; one still running is not asked again for that long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js.kv import KeyValue

from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.bus import terminal
from mooncake.core import cluster as cl

log = logging.getLogger("mooncake.conductor.sweep")

SWEEP_BATCH = 512  # terminal slots read per sweep at most (one KV get each, ~0.2 ms)


class InflightSweep:
    """Asks the terminal slots about long-unheard requests of `view`; `release` takes one
    that ended out of it (the Conductor applies a `RequestDropped` through its feed)."""

    def __init__(
        self,
        view: cl.ClusterView,
        kv: KeyValue,
        check_after_s: float,
        release: Callable[[str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if check_after_s <= 0:
            raise ValueError("the sweep's check_after_s is above 0")
        self.view, self.kv, self.check_after_s = view, kv, check_after_s
        self._release, self._clock = release, clock
        self._task: asyncio.Task[None] | None = None

    async def sweep_once(self) -> list[tuple[str, str]]:
        """One sweep: the (request, how it ended) pairs it took out of the view."""
        now = self._clock()
        asked = self.view.unchecked(now - self.check_after_s, SWEEP_BATCH)
        running: list[str] = []
        ended: list[tuple[str, str]] = []
        for rid in asked:
            how = await terminal.ended(self.kv, rid)
            if how is None:
                running.append(rid)
            else:
                ended.append((rid, how))
        self.view.still_running(running, now)
        swept = []
        for rid, how in ended:
            if rid not in self.view.inflight:  # its end event came meanwhile
                continue
            self._release(rid)
            swept.append((rid, how))
            metrics.CONDUCTOR_INFLIGHT_SWEPT.inc()
            log.warning(
                "request %s ended (%s) but its end never reached the Conductor: taken out of "
                "its queues by the sweep", rid, how,
            )  # fmt: skip
        return swept

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.check_after_s / 2)
            try:
                await self.sweep_once()
            except Exception:  # a broker outage, say: the next sweep tries again
                log.warning("the in-flight sweep failed; trying again later", exc_info=True)
