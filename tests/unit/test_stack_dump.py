"""SIGUSR1 to a worker logs what each of its tasks waits on, innermost await included."""

from __future__ import annotations

import asyncio
import logging

import pytest

from workers.runtime import _awaiting, dump_stacks


async def _innermost(gate: asyncio.Event) -> None:
    await gate.wait()


async def _middle(gate: asyncio.Event) -> None:
    await _innermost(gate)


async def test_a_task_s_stack_goes_down_to_its_innermost_await(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = asyncio.Event()
    task = asyncio.create_task(_middle(gate), name="the-stuck-one")
    await asyncio.sleep(0.01)
    lines = "".join(_awaiting(task))
    assert lines.index("in _middle") < lines.index("in _innermost") < lines.index("in wait")
    with caplog.at_level(logging.WARNING, logger="workers.runtime"):
        dump_stacks()
    dumped = [r.getMessage() for r in caplog.records if "the-stuck-one" in r.getMessage()]
    assert len(dumped) == 1 and "_innermost" in dumped[0] and "(pending)" in dumped[0]
    gate.set()
    await task
