"""The Conductor's KV index states for `mooncake up`'s status table.

The table is redrawn every second from the main thread, which must never wait on the broker.
So a thread of its own (its own event loop, one NATS connection kept open and reconnected)
asks the Conductor (`mc.kv.index.state`) about once a second and keeps the latest answer;
the table reads that answer and how old it is, never the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from mooncake.config import Settings
from mooncake.namespace import Namespace
from mooncake.store import protocol as sp

log = logging.getLogger(__name__)


async def ask_index(nc: NATS, ns: Namespace, timeout_s: float) -> sp.KvIndexReport:
    """The Conductor's KV index report (raises on no answer, a timeout, or a bad reply)."""
    reply = await nc.request(sp.Subjects(ns).kv_index_state(), b"", timeout=timeout_s)
    return sp.KvIndexReport.model_validate_json(reply.data)


class IndexWatch:
    """Asks the Conductor for its KV index report every `interval_s`, in a daemon thread;
    `latest()` is the last answer and the monotonic time it came."""

    def __init__(
        self,
        settings: Settings,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.interval_s, self.timeout_s = settings, interval_s, timeout_s
        self._clock = clock
        self._latest: tuple[sp.KvIndexReport, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-watch", daemon=True)

    def start(self) -> IndexWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 3.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def latest(self) -> tuple[sp.KvIndexReport, float] | None:
        return self._latest  # one reference, replaced whole: no lock needed to read it

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # the table shows "-" then; `up` goes on
            log.exception("KV index watch stopped")

    async def _main(self) -> None:
        from mooncake.bus.connection import connect

        ns = Namespace(self.settings.namespace)
        nc: NATS | None = None
        try:
            while not self._stop.is_set():
                if nc is None:
                    with contextlib.suppress(Exception):  # the broker may not be up yet
                        nc = await connect(self.settings, "up-index", connect_timeout=2)
                if nc is not None:
                    try:
                        self._latest = (await ask_index(nc, ns, self.timeout_s), self._clock())
                    except Exception as e:  # no Conductor (yet): the last answer ages
                        log.debug("no KV index report: %s", type(e).__name__)
                await asyncio.sleep(self.interval_s)
        finally:
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
