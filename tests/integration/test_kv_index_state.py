"""The Conductor's KV index states over a real NATS: its live feed answers
`mc.kv.index.state`, and `mooncake up`'s status table reads them through its watch thread."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from mooncake.config import Settings
from mooncake.core import cluster as cl
from mooncake.namespace import Namespace
from mooncake.serving.conductor_feed import LiveFeed, Liveness, Member
from mooncake.stack import Stack, WorkerProcess
from mooncake.stack_index import ask_index
from mooncake.store import protocol as sp
from mooncake.store.kv_index import IndexState

from helpers import wait_for

pytestmark = pytest.mark.integration


async def _none(_: Member) -> None:
    return None


@pytest_asyncio.fixture
async def feed(nats_url: str, namespace: str) -> AsyncIterator[tuple[NATS, LiveFeed]]:
    nc = await nats.connect(nats_url)
    ns = Namespace(namespace)
    live = LiveFeed(nc, ns, cl.ClusterView(), Liveness(5.0), on_dead=_none)
    await live.start()
    try:
        yield nc, live
    finally:
        await live.stop()
        await nc.drain()


async def _events(nc: NATS, subject: str, node: str, seq: int) -> None:
    wire = sp.KvEvents(node_id=node, seq=seq, stored=[f"{node}-k{seq}"])
    await nc.publish(subject, wire.model_dump_json().encode())
    await nc.flush()


@asynccontextmanager
async def _beating(nc: NATS, subject: str, node: str) -> AsyncIterator[None]:
    """What a live store node does each heartbeat: its tip (one silent for longer than
    `kv_follow.SILENT_S` turns DEGRADED)."""
    tip = sp.KvEvents(node_id=node, seq=1, tip=True).model_dump_json().encode()

    async def beat() -> None:
        while True:
            await nc.publish(subject, tip)
            await asyncio.sleep(0.5)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _states(report: sp.KvIndexReport) -> dict[str, IndexState]:
    return {n.node_id: n.state for n in report.nodes}


def _stack(nats_url: str, namespace: str, tmp_path: Path, *names: str) -> Stack:
    """A stack whose worker rows are `names` (no process runs: only the table is read)."""
    stack = Stack(Settings(nats_url=nats_url, namespace=namespace, data_dir=tmp_path))
    stack.nats_url = nats_url
    for name in names:
        argv = [sys.executable, "-c", "pass"]
        stack.workers.append(WorkerProcess(name, argv, tmp_path / f"{name}.log", 0, role=name))
    return stack


async def test_the_conductor_answers_its_index_states_and_the_table_shows_them(
    feed: tuple[NATS, LiveFeed], nats_url: str, namespace: str, tmp_path: Path
) -> None:
    nc, live = feed
    ns = Namespace(namespace)
    subjects = sp.Subjects(ns)
    assert (await ask_index(nc, ns, 2.0)).nodes == []  # nothing followed yet
    # prefill-0 in order (and alive); decode-0 with a gap that no snapshot answers (it is
    # resyncing, later degraded); prefill-0's engine tier.
    await _events(nc, subjects.kv_events("prefill-0"), "prefill-0", 1)
    await _events(nc, subjects.kv_events("decode-0"), "decode-0", 1)
    await _events(nc, subjects.kv_events("decode-0"), "decode-0", 3)
    await _events(nc, subjects.engine_kv_events("prefill-0"), "prefill-0", 1)

    async def both_known() -> bool:
        return len((await ask_index(nc, ns, 2.0)).nodes) == 2

    async with _beating(nc, subjects.kv_events("prefill-0"), "prefill-0"):
        await wait_for(both_known, 5, "both nodes in the report")
        before = time.time()
        report = await ask_index(nc, ns, 2.0)
        assert _states(report) == {
            "prefill-0": IndexState.EXACT,
            "decode-0": IndexState.RESYNCING,
        }
        assert [(e.node_id, e.state) for e in report.engines] == [("prefill-0", IndexState.EXACT)]
        assert all(n.since <= report.at <= before + 1 for n in report.nodes)

        # The status table: each worker row shows its store node's index, "-" where none.
        stack = _stack(nats_url, namespace, tmp_path, "prefill-0", "decode-0", "conductor-0")
        stack.watch_index()
        try:

            async def answered() -> bool:
                return stack.index_watch is not None and stack.index_watch.latest() is not None

            await wait_for(answered, 5, "the watch's first answer")
            rows = {r[0]: r[-1] for r in stack.status_rows()}
            assert rows["prefill-0"].startswith("exact 0m0"), rows
            assert rows["decode-0"].split()[0] in ("resyncing", "degraded"), rows
            assert rows["conductor-0"] == "-" and rows["nats"] == ""
        finally:
            stack.stop()
        assert stack.index_watch is None

        # A lost node leaves the report (its next life is another stream, another `since`).
        live.apply(cl.NodeLost("decode-0"))
        assert _states(await ask_index(nc, ns, 2.0)) == {"prefill-0": IndexState.EXACT}


async def test_without_a_conductor_nobody_answers(nats_url: str, namespace: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises((nats.errors.NoRespondersError, asyncio.TimeoutError)):
            await ask_index(nc, Namespace(namespace), 0.5)
    finally:
        await nc.drain()
