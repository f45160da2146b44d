"""The store as real processes (`mooncake worker store-master|store-node`), killed with -9."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import numpy as np
import pytest_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake.config import Settings
from mooncake.namespace import Namespace
from mooncake.store.client import ClientConfig, StoreClient, StoreError

from helpers import Worker, scalar, wait_for

SECRET = "e2e-store-secret"
STORE_ENV = {
    "MOONCAKE_STORE__SECRET": SECRET,
    "MOONCAKE_STORE__DRAM_BYTES": str(16 << 20),
    "MOONCAKE_STORE__HEARTBEAT_S": "0.2",
    "MOONCAKE_STORE__NODE_TIMEOUT_S": "1.5",
}


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest_asyncio.fixture
async def client(settings: Settings) -> AsyncIterator[StoreClient]:
    nc = await nats.connect(settings.nats_url)
    c = StoreClient(nc, Namespace(settings.namespace), ClientConfig(SECRET.encode()))
    try:
        yield c
    finally:
        await c.close()
        await nc.drain()


def start(role: str, settings: Settings, tmp_path: Path, name: str) -> Worker:
    return Worker(role, settings, tmp_path / "logs", name=name, env=STORE_ENV).start()


async def test_killed_node_and_restarted_master(
    settings: Settings, tmp_path: Path, client: StoreClient, engine: AsyncEngine
) -> None:
    workers = [
        start("recorder", settings, tmp_path, "recorder-0"),
        start("store-master", settings, tmp_path, "master-0"),
        start("store-node", settings, tmp_path, "node-a"),
        start("store-node", settings, tmp_path, "node-b"),
    ]
    try:

        async def both_mounted() -> bool:
            try:  # two replicas fit only once both nodes' segments are mounted
                return await client.put("probe", b"p", replicas=2) is None
            except StoreError:  # the master is not up yet
                return False

        await wait_for(both_mounted, 60, "master and both nodes up")
        two = blob(500_000, 1)
        assert await client.put("two", two, replicas=2) is None
        assert await client.put("only-b", two, preferred_segment="node-b-dram") is None
        assert await client.put("only-a", two, preferred_segment="node-a-dram") is None

        # The journal reaches the kv_objects projection through the recorder.
        async def journaled() -> bool:
            n = await scalar(engine, "SELECT count(*) FROM kv_objects WHERE key = 'two'")
            return n == 1

        await wait_for(journaled, 30, "kv_objects to hold the object")

        workers[3].kill()  # node-b, -9: one of two replicas gone
        got = await client.get("two")
        assert got is not None and bytes(got) == two

        async def dropped() -> bool:  # the master notices the missed heartbeats
            return not await client.exists("only-b")

        await wait_for(dropped, 20, "the dead node's objects to be dropped")
        assert await client.get("only-b") is None  # a clean miss, not an error
        got = await client.get("two")
        assert got is not None and bytes(got) == two

        workers[1].kill()  # the master, -9: its memory is gone
        workers[1] = start("store-master", settings, tmp_path, "master-1")

        async def found_again() -> bool:
            try:
                return await client.exists("only-a")
            except StoreError:
                return False

        await wait_for(found_again, 30, "node-a to re-mount with the restarted master")
        got = await client.get("only-a")
        assert got is not None and bytes(got) == two
        got = await client.get("two")
        assert got is not None and bytes(got) == two
        assert not await client.exists("only-b")
    finally:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.stop()
        logs = "\n".join(w.log()[-3000:] for w in workers)
        assert "Traceback" not in logs, logs


async def test_node_without_a_secret_refuses_to_start(settings: Settings, tmp_path: Path) -> None:
    w = Worker("store-node", settings, tmp_path / "logs", name="nosecret").start()
    assert w.proc is not None
    rc = w.proc.wait(60)
    assert rc == 2
    assert "MOONCAKE_STORE__SECRET" in w.log()
