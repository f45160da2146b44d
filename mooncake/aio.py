"""asyncio helpers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


async def cancel_all(tasks: Iterable[asyncio.Task[object]], *, rounds: int = 10) -> int:
    """Cancel tasks and wait for them, cancelling again while any is still running.

    A cancellation can be swallowed (Python 3.11's `wait_for` turning it into a TimeoutError
    that a retry loop's `except Exception` then eats), so one `cancel()` + `gather` can wait
    forever on shutdown. Returns how many tasks still run after `rounds` half-second waits.
    This is the one way a task is stopped and waited for: never `cancel()` and `await`.
    """
    pending = [t for t in tasks if not t.done()]
    for _ in range(rounds):
        if not pending:
            return 0
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.5)
        for t in pending:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: its failure is the stop's, not news
        pending = [t for t in pending if not t.done()]
    if pending:
        log.warning("%d task(s) would not stop: %s", len(pending), [t.get_name() for t in pending])
    return len(pending)
