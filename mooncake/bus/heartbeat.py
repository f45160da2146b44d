"""Telling JetStream a message is still being worked on (`in_progress` resets its ack-wait
timer), for one long handler (`keep_alive`: a prefill) or many held messages (`Heartbeats`:
a decode batch's running requests)."""

from __future__ import annotations

import asyncio
import contextlib

from mooncake.aio import cancel_all
from mooncake.bus.consume import Delivery


class Heartbeats:
    """`in_progress` every `interval_s` for each delivery held (a decode worker's running
    requests): the server redelivers none of them while this process lives."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._held: dict[int, Delivery] = {}

    def hold(self, d: Delivery) -> None:
        self._held[id(d)] = d

    def drop(self, d: Delivery) -> None:
        self._held.pop(id(d), None)

    def __len__(self) -> int:
        return len(self._held)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for d in list(self._held.values()):
                with contextlib.suppress(Exception):
                    await d.in_progress()


@contextlib.asynccontextmanager
async def keep_alive(delivery: Delivery, interval_s: float):  # type: ignore[no-untyped-def]
    """Send `in_progress` every `interval_s` while a long handler runs (e.g. a prefill)."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(Exception):
                await delivery.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        await cancel_all([task])
