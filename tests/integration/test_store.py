"""The store over a real NATS: master, nodes and client in this process (nodes' segments are
real shared memory, transfers go through the real tcp and shm transports)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from mooncake.config import NamespaceQuota, StoreSettings
from mooncake.core.block_index import BlockIndex
from mooncake.hashing import cache_namespace
from mooncake.namespace import Namespace
from mooncake.store import protocol as p
from mooncake.store.client import MASTER_POLL_S, ClientConfig, StoreClient, StoreError
from mooncake.store.kv_follow import KvIndexSubscriber
from mooncake.store.kv_index import IndexState, KvIndexFollower
from mooncake.store.master import StoreMaster, new_state
from mooncake.store.node import NodeConfig, StoreNode
from mooncake.store.types import Pin, Reason, Tier

from helpers import wait_for

SECRET = b"integration-secret"
MiB = 1 << 20


@dataclass
class Cluster:
    nc: NATS
    ns: Namespace
    settings: StoreSettings
    tmp: Path
    master: StoreMaster | None = None
    nodes: dict[str, StoreNode] = field(default_factory=dict)
    clients: list[StoreClient] = field(default_factory=list)

    async def start_master(self) -> StoreMaster:
        self.master = StoreMaster(self.nc, self.ns, new_state(self.settings, seed=1), tick_s=0.05)
        await self.master.start()
        return self.master

    async def stop_master(self) -> None:
        assert self.master is not None
        await self.master.stop()
        self.master = None

    async def add_node(
        self,
        node_id: str,
        *,
        dram: int = 8 * MiB,
        ssd: int = 0,
        transports: tuple[str, ...] = ("tcp",),
        heartbeat_s: float = 0.1,
    ) -> StoreNode:
        cfg = NodeConfig(
            node_id=node_id,
            secret=SECRET,
            dram_bytes=dram,
            ssd_bytes=ssd,
            ssd_dir=self.tmp / "ssd",
            transports=transports,
            heartbeat_s=heartbeat_s,
            request_timeout_s=2.0,
        )
        node = StoreNode(self.nc, self.ns, cfg)
        await node.start()
        self.nodes[node_id] = node
        return node

    async def stop_node(self, node_id: str) -> None:
        await self.nodes.pop(node_id).stop()

    def client(self, transports: tuple[str, ...] = ("shm", "tcp")) -> StoreClient:
        c = StoreClient(self.nc, self.ns, ClientConfig(SECRET, transports, request_timeout_s=2.0))
        self.clients.append(c)
        return c


@pytest_asyncio.fixture
async def cluster(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    nc = await nats.connect(nats_url)
    s = StoreSettings(node_timeout_s=1.0, put_timeout_s=1.0, lease_s=0.5)
    c = Cluster(nc, Namespace(namespace), s, tmp_path)
    await c.start_master()
    try:
        yield c
    finally:
        for client in c.clients:
            await client.close()
        for node_id in list(c.nodes):
            await c.stop_node(node_id)
        if c.master is not None:
            await c.stop_master()
        await nc.drain()


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def test_put_get_exists_remove_round_trip(cluster: Cluster) -> None:
    await cluster.add_node("n1")
    client = cluster.client(("tcp",))
    data = blob(300_000, 1)
    assert await client.put("k1", data) is None
    assert await client.exists("k1")
    got = await client.get("k1")
    assert got is not None and bytes(got) == data
    refused = await client.put("k1", data)
    assert refused is not None and refused.reason is Reason.EXISTS
    assert await client.remove("k1", force=True) is None
    assert not await client.exists("k1")
    assert await client.get("k1") is None


async def test_batches_and_zero_copy_buffers(cluster: Cluster) -> None:
    await cluster.add_node("n1")
    await cluster.add_node("n2")
    client = cluster.client()
    items = [(f"b{i}", blob(4096 + i, i)) for i in range(50)]
    assert await client.put_many(items) == [None] * 50
    assert await client.exists_many([k for k, _ in items] + ["nope"]) == [True] * 50 + [False]
    got = await client.get_many([k for k, _ in items])
    assert [bytes(g) if g is not None else None for g in got] == [d for _, d in items]

    # Zero-copy: a numpy array and a torch tensor go in and are filled in place.
    arr = np.arange(65536, dtype=np.float32)
    ten = torch.arange(65536, dtype=torch.float16)
    assert await client.put_many([("np", arr), ("pt", ten)]) == [None, None]
    out_arr = np.zeros_like(arr)
    out_ten = torch.zeros_like(ten)
    sizes = await client.get_many_into(["np", "pt", "missing"], [out_arr, out_ten, bytearray(8)])
    assert sizes == [arr.nbytes, ten.numel() * 2, None]
    assert np.array_equal(out_arr, arr) and torch.equal(out_ten, ten)
    with pytest.raises(ValueError, match="holds"):
        await client.get_into("np", bytearray(10))


def _mappings_of(path: Path) -> int:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(line.rstrip().endswith(str(path)) for line in f)


async def test_shm_copies_through_the_own_process_segment_mapping(cluster: Cluster) -> None:
    """A client in the process that holds a node (a worker's embedded store node) copies
    through the node's own mapping of its segment: the file is mapped once, not twice."""
    node = await cluster.add_node("n1", transports=("shm", "tcp"))
    client = cluster.client(("shm",))
    data = blob(3 * MiB, 11)
    assert await client.put("own", data) is None
    got = await client.get("own")
    assert got is not None and bytes(got) == data
    (segment,) = node.segments
    assert _mappings_of(segment.path) == 1
    await client.close()
    cluster.clients.remove(client)
    # The client's close leaves the node's mapping alone: the node still serves it.
    other = cluster.client(("shm",))
    got = await other.get("own")
    assert got is not None and bytes(got) == data


async def test_readers_never_see_a_pending_put(cluster: Cluster) -> None:
    await cluster.add_node("n1")
    client = cluster.client(("tcp",))
    started = await client._call(
        "put_start", p.PutStartRequest(items=[p.PutItem(key="half", size=1000)]), p.PutStartReply
    )
    assert isinstance(started.results[0], p.Plan)
    assert not await client.exists("half")
    assert await client.get("half") is None
    # The writer "dies" here: the pending allocation is reclaimed after put_timeout_s.
    assert cluster.master is not None
    await wait_for(
        lambda: _async(cluster.master is not None and cluster.master.state.object("half") is None),
        5,
        "the zombie put to be reclaimed",
    )
    assert await client.put("half", blob(1000, 3)) is None


async def _async(v: bool) -> bool:
    return v


async def test_replica_on_a_stopped_node_falls_back_then_misses(cluster: Cluster) -> None:
    await cluster.add_node("n1")
    await cluster.add_node("n2")
    client = cluster.client(("tcp",))
    data = blob(200_000, 7)
    assert await client.put("two", data, replicas=2) is None
    assert await client.put("one", data, preferred_segment="n2-dram") is None
    await cluster.stop_node("n2")
    # Before the master notices, the read to n2 fails and falls back to n1's replica.
    got = await client.get("two")
    assert got is not None and bytes(got) == data
    assert await client.get("one") is None  # its only replica is gone: a clean miss
    assert cluster.master is not None
    await wait_for(
        lambda: _async(cluster.master is not None and cluster.master.state.object("one") is None),
        5,
        "the dead node's replicas to be dropped",
    )
    got = await client.get("two")
    assert got is not None and bytes(got) == data


async def test_master_restart_finds_objects_again(cluster: Cluster) -> None:
    await cluster.add_node("n1")
    client = cluster.client(("tcp",))
    items = [(f"r{i}", blob(10_000, i)) for i in range(20)]
    assert await client.put_many(items) == [None] * 20
    node = cluster.nodes["n1"]
    await wait_for(lambda: _async(len(node.held) == 20), 5, "the node to learn its objects")
    await cluster.stop_master()
    await cluster.start_master()  # empty: learns everything from the node's re-mount
    await wait_for(lambda: client.exists("r0"), 5, "the node to re-mount")
    got = await client.get_many([k for k, _ in items])
    assert [bytes(g) if g is not None else None for g in got] == [d for _, d in items]


async def test_a_restarted_master_knows_the_nodes_objects_before_their_heartbeat(
    cluster: Cluster,
) -> None:
    """The master says hello when it starts: the nodes mount again at once, not at their next
    heartbeat, so their objects can be served again within moments."""
    node = await cluster.add_node("n1", heartbeat_s=30.0)  # none in this test's time
    client = cluster.client(("tcp",))
    assert await client.put("h0", b"x" * 1000) is None
    await wait_for(lambda: _async("h0" in node.held), 5, "the node to learn h0")
    await cluster.stop_master()
    await cluster.start_master()
    await wait_for(lambda: client.exists("h0"), 2, "the restarted master to know h0")
    assert node.stats.mounts == 2


async def test_a_call_while_the_master_restarts_waits_for_it_within_its_timeout(
    cluster: Cluster,
) -> None:
    """No master subscribed (NATS says so at once): the client asks again until its request
    timeout, so a master's restart is a wait for its callers, not a failed call; with no
    master for the whole timeout the call fails as a silent master's does."""
    await cluster.add_node("n1")
    client = cluster.client(("tcp",))  # request_timeout_s 2.0
    assert await client.put("w0", b"x" * 1000) is None
    await cluster.stop_master()
    loop = asyncio.get_running_loop()
    began = loop.time()
    asking = asyncio.create_task(client.exists("w0"))
    await asyncio.sleep(0.6)
    assert not asking.done()
    await cluster.start_master()
    # answered by the new master (which may not know w0 yet: the node mounts again
    # moments after it starts), not failed
    assert await asking in (True, False)
    assert 0.6 <= loop.time() - began < 2.0
    await cluster.stop_master()
    began = loop.time()
    with pytest.raises(StoreError, match=r"store master did not answer .*NoRespondersError"):
        await client.exists("w0")
    assert loop.time() - began >= 2.0 - MASTER_POLL_S


async def test_ssd_tier_offload_and_promotion(cluster: Cluster) -> None:
    await cluster.add_node("n1", dram=1 * MiB, ssd=8 * MiB)
    index = BlockIndex()  # what the Conductor would see of it
    sub = KvIndexSubscriber(cluster.nc, cluster.ns, KvIndexFollower(index))
    await sub.start()
    try:
        await _offload_and_promote(cluster, index)
    finally:
        await sub.stop()


async def _offload_and_promote(cluster: Cluster, index: BlockIndex) -> None:
    client = cluster.client(("tcp",))
    blocks = [(f"s{i}", blob(64 * 1024, i)) for i in range(40)]  # 2.5 MiB > 1 MiB of DRAM
    for key, data in blocks:
        res = await client.put(key, data)
        assert res is None, res
    master = cluster.master
    assert master is not None

    def tiers(key: str) -> set[Tier]:
        obj = master.state.object(key)
        return set() if obj is None else {r.tier for r in obj.replicas}

    await wait_for(lambda: _async(Tier.SSD in tiers("s0")), 5, "s0 to be offloaded to SSD")
    # The offload is a KV event: the index knows s0 is held on n1's SSD alone.
    await wait_for(
        lambda: _async(tiers("s0") == {Tier.SSD} and index.ssd_holders("s0") == {"n1"}),
        5, "the index to see s0 only on SSD",
    )  # fmt: skip
    assert index.holders("s0") == {"n1"}
    got = await client.get("s0")  # served from SSD ...
    assert got is not None and bytes(got) == blocks[0][1]

    async def promoted_on_hit() -> bool:
        # A hit promotes when DRAM has room; when it has none, the hit makes room (offloading
        # colder objects) and a later hit promotes.
        got = await client.get("s0")
        assert got is not None and bytes(got) == blocks[0][1]
        return Tier.DRAM in tiers("s0")

    await wait_for(promoted_on_hit, 5, "s0 to be promoted on hit")
    # ... and so is the promotion: back in DRAM, no longer charged an SSD read.
    await wait_for(lambda: _async(not index.ssd_holders("s0")), 5, "the index to see s0 in DRAM")
    assert index.holders("s0") == {"n1"}
    got = await client.get("s0")
    assert got is not None and bytes(got) == blocks[0][1]

    def under_watermark() -> bool:
        usage = master.state.usage()["dram"]
        return bool(usage["used"] <= 0.9 * usage["capacity"] + 64 * 1024)

    await wait_for(lambda: _async(under_watermark()), 5, "DRAM usage back under the watermark")


async def test_a_put_beyond_a_namespace_quota_evicts_that_namespace_s_older_block(
    cluster: Cluster,
) -> None:
    a, b = cache_namespace("a", None), cache_namespace("b", None)
    await cluster.stop_master()
    quota = {a: NamespaceQuota(dram_bytes=250_000)}  # two 100 kB blocks, not three
    # Leases long enough that the reads below still hold theirs when the put comes.
    update = {"namespace_quotas": quota, "lease_s": 10.0}
    cluster.settings = cluster.settings.model_copy(update=update)
    await cluster.start_master()
    node = await cluster.add_node("n1")
    client = cluster.client(("tcp",))
    data = {k: blob(100_000, i) for i, k in enumerate(["b-old", "a-old", "a-mid", "a-new"])}
    for key, blk in data.items():  # b-old is the pool's oldest, but b's
        assert await client.put(key, blk, owner=b if key.startswith("b") else a) is None
    keys = list(data)
    assert await client.exists_many(keys) == [True, False, True, True]
    for key in ("b-old", "a-new"):
        got = await client.get(key)
        assert got is not None and bytes(got) == data[key]
    # a's blocks are both leased now (read): a third cannot be made room for.
    await client.get_many(["a-mid", "a-new"])
    refused = await client.put("a-more", blob(100_000, 9), owner=a)
    assert refused is not None and refused.reason is Reason.QUOTA, refused
    assert await client.put("b-more", blob(100_000, 9), owner=b) is None
    master = cluster.master
    assert master is not None
    usage = master.state.usage_by_owner()
    assert usage[a]["dram"] == 2 * 100_032 and usage[b]["dram"] == 2 * 100_032  # 64 B aligned

    def exported() -> bool:
        return (
            REGISTRY.get_sample_value("mc_store_namespace_bytes", {"namespace": a, "tier": "dram"})
            == 200_064
        )

    await wait_for(lambda: _async(exported()), 5, "the namespace gauge")
    # The owners travel with the blocks: a restarted master learns them from the node.
    await wait_for(lambda: _async(len(node.held) == 4), 5, "the node to learn its objects")
    await cluster.stop_master()
    restarted = await cluster.start_master()
    await wait_for(lambda: client.exists("a-new"), 5, "the node to re-mount")
    assert restarted.state.usage_by_owner() == usage


async def test_a_prefill_over_its_namespace_quota_completes_without_storing(
    cluster: Cluster,
) -> None:
    """A namespace whose quota cannot hold a block: the prefill still answers (its blocks are
    left out, the decode computes what it cannot load), it is not retried as a failure."""
    import threading

    from mooncake.engine import Engine, ModelSpec, dummy_model
    from mooncake.serving.prefill_kv import prefill_with_store

    a = cache_namespace("a", None)
    await cluster.stop_master()
    quota = {a: NamespaceQuota(dram_bytes=1024)}  # smaller than one block's KV
    cluster.settings = cluster.settings.model_copy(update={"namespace_quotas": quota})
    await cluster.start_master()
    await cluster.add_node("n1")
    client = cluster.client(("tcp",))
    spec = ModelSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, context=256)
    engine = Engine(dummy_model(spec), block_tokens=16)
    tokens = [i % 64 for i in range(40)]  # two whole blocks and a tail
    done = await prefill_with_store(
        engine, client, tokens, cached_blocks=0, tail_key="tail-a", preferred_segment=None,
        cancelled=threading.Event(), namespace=a,
    )  # fmt: skip
    assert done.prefilled.logits is not None and done.written == []
    assert await client.exists_many([*done.block_keys, "tail-a"]) == [False, False, False]
    done.release()
    # Another namespace, no quota: stored as usual.
    done = await prefill_with_store(
        engine, client, tokens, cached_blocks=0, tail_key="tail-b", preferred_segment=None,
        cancelled=threading.Event(), namespace=cache_namespace("b", None),
    )  # fmt: skip
    assert await client.exists_many([*done.block_keys, "tail-b"]) == [True, True, True]
    done.release()


async def test_kv_index_follows_nodes_and_resyncs_after_a_gap(cluster: Cluster) -> None:
    node = await cluster.add_node("n1")
    index = BlockIndex()
    changes: list[dict[str, IndexState]] = []
    follower = KvIndexFollower(index)
    sub = KvIndexSubscriber(
        cluster.nc, cluster.ns, follower, on_state=lambda: changes.append(follower.states())
    )
    await sub.start()
    try:
        client = cluster.client(("tcp",))
        assert await client.put_many([(f"h{i}", b"x" * 100) for i in range(5)]) == [None] * 5
        await wait_for(lambda: _async(len(index) == 5), 5, "the index to hold 5 keys")
        assert index.holders("h0") == frozenset({"n1"})
        assert sub.states["n1"][0] is IndexState.EXACT
        # Lose a batch: the node's next one arrives with a gap and the follower resyncs.
        node.kv_log.record(["ghost"], [])
        assert await client.remove("h0", force=True) is None
        await wait_for(lambda: _async(sub.snapshots >= 1), 5, "a snapshot resync")
        await wait_for(lambda: _async("h0" not in _keys(index)), 5, "h0 to leave the index")
        assert index.holders("ghost") == frozenset({"n1"})  # what the node's log says it holds
        # It went resyncing at the gap and exact again with the snapshot, and said so.
        seen = [c["n1"] for c in changes if "n1" in c]
        assert IndexState.RESYNCING in seen and seen[-1] is IndexState.EXACT, seen
        assert sub.states["n1"][0] is IndexState.EXACT and follower.unsure() == frozenset()
    finally:
        await sub.stop()


def _keys(index: BlockIndex) -> set[str]:
    return {k for k in ("h0", "h1", "h2", "h3", "h4") if index.holders(k)}


async def test_bad_control_requests_get_errors_and_the_master_keeps_serving(
    cluster: Cluster,
) -> None:
    await cluster.add_node("n1")
    nc, subj = cluster.nc, p.Subjects(cluster.ns)
    for op, payload in [
        ("put_start", b"not json"),
        ("put_start", json.dumps({"items": []}).encode()),
        ("put_start", json.dumps({"items": [{"key": "k", "size": -1}]}).encode()),
        ("lookup", json.dumps({"keys": ["x" * 1000]}).encode()),
        ("mount", json.dumps({"node_id": "../etc", "segments": []}).encode()),
        ("remove", b"\xff\xfe"),
    ]:
        resp = await nc.request(subj.master(op), payload, timeout=2)
        assert "error" in json.loads(resp.data), (op, resp.data)
    client = cluster.client(("tcp",))
    assert await client.put("still", b"fine") is None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    op=st.sampled_from(p.MASTER_OPS),
    payload=st.one_of(
        st.binary(max_size=300),
        st.dictionaries(
            st.sampled_from(["keys", "items", "node_id", "segments", "force", "objects", "x"]),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                lambda c: (
                    st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4)
                ),
                max_leaves=10,
            ),
            max_size=4,
        ).map(lambda d: json.dumps(d).encode()),
    ),
)
def test_fuzzed_control_requests_never_crash_the_master(
    fuzz_master: tuple[asyncio.AbstractEventLoop, NATS, p.Subjects], op: str, payload: bytes
) -> None:
    loop, nc, subj = fuzz_master

    async def one() -> None:
        resp = await nc.request(subj.master(op), payload, timeout=2)
        assert isinstance(json.loads(resp.data), dict)
        alive = await nc.request(subj.master("exists"), b'{"keys": ["k"]}', timeout=2)
        assert json.loads(alive.data) == {"results": [False]} or "results" in json.loads(alive.data)

    loop.run_until_complete(one())


@pytest.fixture(scope="module")
def fuzz_master(
    nats_url: str,
) -> tuple[asyncio.AbstractEventLoop, NATS, p.Subjects]:  # type: ignore[misc]
    loop = asyncio.new_event_loop()
    ns = Namespace("fz" + os.urandom(5).hex())

    async def setup() -> tuple[NATS, StoreMaster]:
        nc = await nats.connect(nats_url)
        master = StoreMaster(nc, ns, new_state(StoreSettings(), seed=2))
        await master.start()
        return nc, master

    nc, master = loop.run_until_complete(setup())
    yield loop, nc, p.Subjects(ns)

    async def teardown() -> None:
        await master.stop()
        await nc.drain()

    loop.run_until_complete(teardown())
    loop.close()


async def test_pins_survive_a_full_pool(cluster: Cluster) -> None:
    await cluster.add_node("n1", dram=1 * MiB)
    client = cluster.client(("tcp",))
    assert await client.put("pinned", blob(100_000, 1), pin=Pin.HARD) is None
    for i in range(30):
        await client.put(f"f{i}", blob(100_000, i + 10))
    assert await client.exists("pinned")
    assert cluster.master is not None
    usage = cluster.master.state.usage()["dram"]
    assert usage["used"] <= usage["capacity"]


async def test_put_in_pieces_is_invisible_until_commit_and_reads_in_pieces(
    cluster: Cluster,
) -> None:
    await cluster.add_node("n1")
    client = cluster.client()
    data = blob(96_000, 5)
    handle = await client.start_put([("layered", len(data)), ("dropped", 10)])
    assert handle.refused == {}
    for layer in range(3):  # e.g. one KV layer at a time, while the next is computed
        await handle.write(
            [("layered", layer * 32_000, data[layer * 32_000 : (layer + 1) * 32_000])]
        )
        assert not await client.exists("layered")
    with pytest.raises(ValueError, match="outside"):
        await handle.write([("layered", 95_999, b"xx")])
    outcome = await handle.commit()
    assert outcome["layered"] is None
    dropped = outcome["dropped"]  # never written: revoked, not published with stale bytes
    assert dropped is not None and "0 of 10 bytes" in dropped.detail
    assert not await client.exists("dropped")
    got = await client.get("layered")
    assert got is not None and bytes(got) == data

    reader = await client.start_get(["layered", "missing"])
    assert reader.size("layered") == len(data) and reader.size("missing") is None
    halves = [bytearray(48_000), bytearray(48_000)]
    assert await reader.read([("layered", 48_000, halves[1]), ("layered", 0, halves[0])]) == [
        True,
        True,
    ]
    assert bytes(halves[0] + halves[1]) == data

    aborted = await client.start_put([("never", 100)])
    await aborted.abort()
    assert not await client.exists("never")
    assert await client.put("never", b"y" * 100) is None  # the key is free again


async def test_a_put_written_by_two_processes_is_committed_by_its_starter(
    cluster: Cluster,
) -> None:
    """A chunked-pipeline group's KV: the leader allocates each block, another stage writes
    its layers into them (its own client, its own transport: tcp here, shm for the leader)
    from the shared plan sent over the wire, and the leader commits once it has counted the
    stage's bytes in. Without that count the objects are incomplete, and revoked."""
    await cluster.add_node("n1", transports=("shm", "tcp"))
    leader, stage = cluster.client(("shm", "tcp")), cluster.client(("tcp",))
    data = {"b0": blob(64_000, 7), "b1": blob(64_000, 8)}
    half = 32_000  # the leader's layers, then the stage's

    handle = await leader.start_put([(k, len(v)) for k, v in data.items()])
    wire = handle.share().model_dump_json()  # as a stage's work message carries it
    joined = stage.join_put(p.SharedPut.model_validate_json(wire))
    assert not joined.started_here and sorted(joined.keys) == ["b0", "b1"]
    await joined.write([(k, half, v[half:]) for k, v in data.items()])
    await handle.write([(k, 0, v[:half]) for k, v in data.items()])
    with pytest.raises(ValueError, match="started"):
        await joined.commit()
    written, failed = joined.written()
    assert written == {"b0": half, "b1": half} and failed == set()
    handle.credit(written, failed)
    assert await handle.commit() == {"b0": None, "b1": None}
    for k, v in data.items():
        got = await stage.get(k)
        assert got is not None and bytes(got) == v

    uncounted = await leader.start_put([("c0", 100)])
    other = stage.join_put(uncounted.share())
    await other.write([("c0", 50, b"y" * 50)])
    await uncounted.write([("c0", 0, b"x" * 50)])
    outcome = (await uncounted.commit())["c0"]  # the stage's half was never credited
    assert outcome is not None and "50 of 100 bytes" in outcome.detail
    assert not await leader.exists("c0")
    with pytest.raises(KeyError):
        handle.credit({"not-in-this-put": 1})
    nothing = await leader.start_put([])  # every block cached already: nothing to write
    assert nothing.share().plans == {} and await nothing.commit() == {}


async def test_a_cpp_groups_blocks_are_stored_as_one_worker_stores_them(
    cluster: Cluster,
) -> None:
    """Two pipeline stages (layers 0-1 and 2-3, an engine each), running at once, the
    activations between them over a tcp inbox, chunks that do not fall on block boundaries:
    the leader starts the put, the other stage joins it from the shared plan with its own
    client, each writes its layers of a block once the chunk completing it has run, the
    leader credits and commits. Every object is what one worker's prefill stores (its header
    exactly, its KV to float rounding: the chunks attend in other row blocks), the partial
    tail included, and the last stage's logits are the single prefill's."""
    import threading

    from mooncake.engine import Engine, ModelSpec, dummy_model
    from mooncake.serving.activations import Inbox, Outbox, inbox_bytes, slot_bytes
    from mooncake.serving.cpp_stage import StageBlockWriter, run_stage
    from mooncake.serving.kvstore import write_targets
    from mooncake.serving.prefill_kv import prefill_with_store
    from mooncake.store.segment import Segment
    from mooncake.store.transfer import SegmentTable, make_client, make_server

    await cluster.add_node("n1", transports=("shm", "tcp"))
    leader, other = cluster.client(("shm", "tcp")), cluster.client(("tcp",))
    spec = ModelSpec(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, context=256)
    one, first, second = (Engine(dummy_model(spec), block_tokens=16) for _ in range(3))
    tokens = [(7 * i) % 64 for i in range(75)]  # four whole blocks and an 11-token tail
    single = await prefill_with_store(
        one, leader, tokens, cached_blocks=0, tail_key="tail-one", preferred_segment=None,
        cancelled=threading.Event(),
    )  # fmt: skip
    keys = [f"cpp-{k}" for k in single.block_keys]  # the same blocks, under keys of their own
    targets = write_targets(keys, len(tokens), 16, 0, "tail-cpp")
    put = await leader.start_put([(t.key, one.layout.object_size(t.tokens)) for t in targets])
    joined = other.join_put(p.SharedPut.model_validate_json(put.share().model_dump_json()))
    chunks = [(0, 20), (20, 53), (53, 75)]  # across block boundaries

    slot = slot_bytes(33, spec.hidden)
    segment = Segment.create_dram("cpp-inbox-1", "stage-1", inbox_bytes(2, 33, spec.hidden))
    table = SegmentTable()
    table.add(segment)
    server, sender = make_server("tcp", secret=SECRET), make_client("tcp", secret=SECRET)
    await server.start(table)
    try:
        inbox = Inbox(segment, 2, slot)
        outbox = Outbox(sender, server.endpoint("cpp-inbox-1"), "cpp-inbox-1", 2, slot)
        kvs = (first.new_kv(), second.new_kv())
        writers = (
            StageBlockWriter(put, first.layout, kvs[0], (0, 2), targets, header=True),
            StageBlockWriter(joined, second.layout, kvs[1], (2, 4), targets, header=False),
        )
        none, logits = await asyncio.gather(
            run_stage(first, kvs[0], (0, 2), chunks, tokens, inbox=None, outbox=outbox,
                      writer=writers[0]),
            run_stage(second, kvs[1], (2, 4), chunks, tokens, inbox=inbox, outbox=None,
                      writer=writers[1]),
        )  # fmt: skip
    finally:
        await sender.close()
        await server.stop()
        table.remove("cpp-inbox-1")
        segment.close()
    assert none is None and logits is not None
    assert torch.allclose(logits, single.prefilled.logits, atol=1e-5, rtol=0)
    assert [w.written_blocks for w in writers] == [len(targets)] * 2
    put.credit(*joined.written())
    assert set((await put.commit()).values()) == {None}
    for t, theirs in zip(targets, [*single.block_keys, "tail-one"], strict=True):
        got, want = await other.get(t.key), await leader.get(theirs)
        assert got is not None and want is not None and len(got) == len(want), t
        as_read = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (got, want)]
        # the same header, and the same KV to float rounding
        ours, one_s = (one.layout.payload(raw, t.tokens) for raw in as_read)
        assert torch.allclose(ours, one_s, atol=1e-5, rtol=0), t
    single.release()
    for kv in kvs:
        kv.release()


async def test_a_put_renewed_outlasts_the_master_s_put_timeout(cluster: Cluster) -> None:
    """A streaming put the master would reclaim as a dead writer's after `put_timeout_s`
    (1 s here) lives on while its client renews it (`ClientConfig.put_renew_s`), and is
    reclaimed once it stops: a long prefill's blocks are stored, a dead one's are not."""
    await cluster.add_node("n1")
    renewing = StoreClient(
        cluster.nc, cluster.ns, ClientConfig(SECRET, ("tcp",), request_timeout_s=2.0,
                                             put_renew_s=0.3),
    )  # fmt: skip
    cluster.clients.append(renewing)
    plain = cluster.client(("tcp",))
    kept = await renewing.start_put([("long", 100)])
    lost = await plain.start_put([("short-lived", 100)])
    await asyncio.sleep(2.5)  # past the master's put_timeout_s, twice
    for handle, key in ((kept, "long"), (lost, "short-lived")):
        await handle.write([(key, 0, b"x" * 100)])
    assert await kept.commit() == {"long": None}
    refused = (await lost.commit())["short-lived"]
    assert refused is not None and refused.reason is Reason.NOT_PENDING
    assert await plain.get("long") == b"x" * 100 and await plain.get("short-lived") is None
    # Renewal ends with the put: an aborted one is not kept alive.
    gone = await renewing.start_put([("aborted", 100)])
    await gone.abort()
    await asyncio.sleep(0.7)
    assert gone._renewing is None


def _cpp_work(tokens: list[int], chunks: list[tuple[int, int]], stage: int) -> Any:
    from mooncake.work import CppStage, PrefillWork, Timing

    return PrefillWork(
        request_id="r-cpp", token_ids=tokens, prefill_instance="lead", decode_instance="d0",
        timing=Timing(submitted_at=0.0), admitted_event_id="adm-cpp", cached_blocks=0,
        cpp=CppStage(group=["lead", "member"], stage=stage, chunks=chunks),
    )  # fmt: skip


async def _cpp_groups(cluster: Cluster, gang_wait_s: float = 5.0) -> tuple[Any, Any, Any]:
    """Two prefill instances' CPP sides (`serving/cpp_group.CppGroups`), a node and an
    engine each (the same seeded model), and one engine for the single prefill."""
    from mooncake.config import ConductorSettings, CppSettings, Settings
    from mooncake.engine import Engine, ModelSpec, dummy_model
    from mooncake.serving.cpp_group import CppGroups
    from mooncake.serving.local_store import LocalStore
    from mooncake.work import WorkSubjects

    spec = ModelSpec(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, context=256)
    settings = Settings(
        conductor=ConductorSettings(liveness_timeout_s=0.5),
        cpp=CppSettings(gang_wait_s=gang_wait_s),
    )
    sides = []
    for name in ("lead", "member"):
        node = await cluster.add_node(name, transports=("shm", "tcp"))
        store = LocalStore(node, cluster.client(("shm", "tcp")))
        engine = Engine(dummy_model(spec), block_tokens=16)
        groups = CppGroups(cluster.nc, WorkSubjects(cluster.ns), name, engine, store, settings)
        await groups.start()
        sides.append(groups)
    return sides[0], sides[1], Engine(dummy_model(spec), block_tokens=16)


async def test_a_cpp_group_of_two_instances_meets_and_prefills_as_one_worker(
    cluster: Cluster,
) -> None:
    """The live group (serving/cpp_group.py): the leader and a member meet over NATS, the
    chunks flow through the member's inbox, the logits come back to the leader's, each
    writes its layers into the leader's put, and the leader commits: the same logits as one
    prefill, and every block and the tail stored whole, readable as one worker's."""
    import threading

    from mooncake.serving.prefill_kv import prefill_with_store

    leader, member, one = await _cpp_groups(cluster)
    try:
        tokens = [(5 * i + 3) % 64 for i in range(75)]
        chunks = [(0, 20), (20, 53), (53, 75)]
        stop = threading.Event()
        done, dropped = await asyncio.gather(
            leader.lead(_cpp_work(tokens, chunks, 0), stop),
            member.serve_stage(_cpp_work(tokens, chunks, 1), stop),
        )
        assert dropped is None
        single = await prefill_with_store(
            one, leader.store.client, tokens, cached_blocks=0, tail_key="tail-one",
            preferred_segment=None, cancelled=threading.Event(), namespace="elsewhere",
        )  # fmt: skip
        assert torch.allclose(done.prefilled.logits, single.prefilled.logits, atol=1e-5, rtol=0)
        assert done.tail_tokens == 11 and done.tail_key is not None
        assert done.written == [*done.block_keys, done.tail_key]
        client = member.store.client
        theirs = [*single.block_keys, "tail-one"]
        for ours, other, n in zip(done.written, theirs, [16] * 4 + [11], strict=True):
            got, want = await client.get(ours), await client.get(other)
            assert got is not None and want is not None and len(got) == len(want), ours
            raw = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (got, want)]
            a, b = (one.layout.payload(r, n) for r in raw)
            assert torch.allclose(a, b, atol=1e-5, rtol=0), ours
        # a late ask about the finished group is told it is over
        ask = member._asker(_cpp_work(tokens, chunks, 1))
        assert (await ask("beat")).state == "gone"
        done.release()
        single.release()
    finally:
        await leader.stop()
        await member.stop()


async def test_a_cpp_leader_gives_its_group_up_when_a_member_never_comes_or_dies(
    cluster: Cluster,
) -> None:
    """No member within `gang_wait_s`: GroupFailed, the put aborted (nothing stored). A
    member that dies after joining (its task cancelled: it never reports) goes silent:
    GroupFailed after `liveness_timeout_s`, and the member's late ask is told `gone`."""
    import threading

    from mooncake.serving.cpp_group import GroupFailed

    leader, member, _ = await _cpp_groups(cluster, gang_wait_s=0.5)
    try:
        tokens = [(3 * i + 1) % 64 for i in range(75)]
        chunks = [(0, 40), (40, 75)]
        stop = threading.Event()
        with pytest.raises(GroupFailed, match="did not start"):
            await leader.lead(_cpp_work(tokens, chunks, 0), stop)
        keys = leader.engine.block_keys(tokens, "default")
        assert not any(await leader.store.client.exists_many(keys))

        # The member joins, then dies in its second chunk (its task cancelled while the
        # chunk computes: it never reports again).
        work = _cpp_work(tokens, chunks, 1).model_copy(update={"attempt": 2})
        lead_work = _cpp_work(tokens, chunks, 0).model_copy(update={"attempt": 2})
        real_run = member.engine.model.run_layers
        calls, stuck, gate = 0, threading.Event(), threading.Event()

        def dying(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                stuck.set()
                gate.wait(10)
                raise RuntimeError("this stage is dead")
            return real_run(*args, **kwargs)

        member.engine.model.run_layers = dying  # type: ignore[method-assign]
        task = asyncio.create_task(member.serve_stage(work, stop))
        leading = asyncio.create_task(leader.lead(lead_work, stop))
        await wait_for(lambda: _async(stuck.is_set()), 10, "the member's second chunk")
        task.cancel()
        with pytest.raises(GroupFailed, match="went silent"):
            await leading
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

        # A member whose chunk fails reports it: the leader gives up at once, and the
        # member says why it dropped its stage.
        calls = 0
        gate.set()  # the second chunk raises without waiting
        work3 = _cpp_work(tokens, chunks, 1).model_copy(update={"attempt": 3})
        lead3 = _cpp_work(tokens, chunks, 0).model_copy(update={"attempt": 3})
        dropped, failed = await asyncio.gather(
            member.serve_stage(work3, stop),
            leader.lead(lead3, stop),
            return_exceptions=True,
        )
        assert isinstance(dropped, str) and "this stage is dead" in dropped
        assert isinstance(failed, GroupFailed) and "stage 1 (member) failed" in str(failed)
        assert not any(await leader.store.client.exists_many(keys))
    finally:
        await leader.stop()
        await member.stop()


async def test_a_lost_last_kv_batch_is_seen_at_the_node_s_next_tip(cluster: Cluster) -> None:
    """A node that goes quiet after a lost batch: no later batch shows the gap, its tip (each
    heartbeat) does, and the follower resyncs."""
    node = await cluster.add_node("n1")
    index = BlockIndex()
    follower = KvIndexFollower(index)
    sub = KvIndexSubscriber(cluster.nc, cluster.ns, follower)
    await sub.start()
    try:
        client = cluster.client(("tcp",))
        assert await client.put("t0", b"x" * 100) is None
        await wait_for(lambda: _async(index.holders("t0") == {"n1"}), 5, "t0 in the index")
        node.kv_log.record(["lost"], [])  # its last batch, never delivered
        await wait_for(lambda: _async(index.holders("lost") == {"n1"}), 5, "a resync at the tip")
        assert sub.snapshots >= 1 and follower.unsure() == frozenset()
    finally:
        await sub.stop()
