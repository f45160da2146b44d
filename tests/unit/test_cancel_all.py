"""Stopping a task whose cancel is swallowed (`aio.cancel_all`), and the places that must.

Python 3.11's `wait_for` (under nats-py's `request`, `next_msg` and `fetch`) returns a result
that arrived with the cancel instead of raising it; a loop around such a call then goes on.
One `cancel()` and an `await` then wait for it forever."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from mooncake.aio import cancel_all
from mooncake.serving.cpp_group import CppAnswer, CppGroups, _stop


def _swallowing(times: int, takes_s: float = 0.01) -> tuple[list[int], Any]:
    """A call that, cancelled, returns normally the first `times` times (as wait_for does
    when its reply is already in)."""
    cancels = [0]

    async def call(*_: object, **__: object) -> CppAnswer:
        try:
            await asyncio.sleep(takes_s)
        except asyncio.CancelledError:
            cancels[0] += 1
            if cancels[0] > times:
                raise
        return CppAnswer(state="ok")

    return cancels, call


async def test_a_task_that_swallows_cancels_is_cancelled_until_it_stops() -> None:
    cancels, call = _swallowing(2)

    async def loop() -> None:
        while True:
            await call()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.05)
    assert await cancel_all([task]) == 0
    assert task.cancelled() and cancels[0] == 3


async def test_one_that_never_stops_is_counted_not_waited_for_forever() -> None:
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0.02)  # started: a task cancelled before it runs never runs
    t0 = time.monotonic()
    assert await cancel_all([task], rounds=2) == 1
    assert time.monotonic() - t0 < 3.0 and not task.done()
    stop.set()
    await task


async def test_a_failed_task_is_stopped_with_its_failure_retrieved() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_all([task]) == 0
    assert isinstance(task.exception(), RuntimeError)


async def test_a_cpp_stage_beat_whose_cancel_its_ask_swallowed_still_stops() -> None:
    """The deadlock seen in CI: a member's beat, cancelled once its stage was done, went on
    beating (its ask swallowed the cancel); the leader, hearing it, waited for the stage's
    report, and the stage waited for the beat to stop."""
    cancels, ask = _swallowing(1, takes_s=0.2)
    member = SimpleNamespace(_liveness_s=3.0)
    abort = asyncio.Event()
    beat = asyncio.create_task(CppGroups._beat(member, ask, abort, threading.Event()))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)  # in its first ask
    t0 = time.monotonic()
    await asyncio.wait_for(_stop(beat), 5.0)
    assert beat.done() and not abort.is_set()
    assert time.monotonic() - t0 < 2.0
    assert cancels[0] == 1  # swallowed in the ask; the next cancel, in its sleep, stopped it
