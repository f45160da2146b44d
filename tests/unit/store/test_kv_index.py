"""KV index event sequencing: producer log, follower with gap detection and snapshots."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from mooncake.core.block_index import BlockIndex
from mooncake.store.kv_index import (
    Applied,
    IndexState,
    KvEventBatch,
    KvEventLog,
    KvIndexFollower,
    KvSnapshot,
    KvTip,
    NeedSnapshot,
)


def held(index: BlockIndex, node: str, keys: list[str]) -> set[str]:
    return {k for k in keys if node in index.holders(k)}


def test_the_log_numbers_batches_from_one_and_snapshots_its_key_set() -> None:
    log = KvEventLog("n1")
    assert log.snapshot() == KvSnapshot("n1", 0, ())
    b1 = log.record(["a", "b"], [])
    b2 = log.record(["c"], ["a"])
    assert (b1.seq, b2.seq) == (1, 2)
    assert b2 == KvEventBatch("n1", 2, ("c",), ("a",))
    assert log.snapshot() == KvSnapshot("n1", 2, ("b", "c"))
    log.record(["d"], ["d"])  # stored then removed within one interval: absent
    assert log.keys == {"b", "c"}


def test_in_order_batches_update_the_index_and_duplicates_are_ignored() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    b1, b2 = log.record(["a", "b"]), log.record(["c"], ["a"])
    assert f.apply(b1) == Applied("n1", 1, 1)
    assert f.apply(b2) == Applied("n1", 2, 1)
    assert f.apply(b1) == Applied("n1", 2, 0)
    assert held(index, "n1", ["a", "b", "c"]) == {"b", "c"}
    other = KvEventLog("n2").record(["b"])
    f.apply(other)
    assert index.holders("b") == {"n1", "n2"}


def test_a_gap_asks_for_one_snapshot_and_buffers_until_it_arrives() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    # seq i+1 stores k{i} and removes k{i-2}
    batches = [log.record([f"k{i}"], [f"k{i - 2}"] if i >= 2 else []) for i in range(6)]
    f.apply(batches[0])
    assert f.apply(batches[2]) == NeedSnapshot("n1", "gap")  # seq 2 was lost
    assert f.apply(batches[3]) == Applied("n1", 1, 0)  # buffered, no second request
    assert f.awaiting() == ["n1"]
    snap = KvSnapshot("n1", 3, ("k1", "k2"))  # taken after seq 3
    f.apply(batches[4])
    assert f.load_snapshot(snap) == Applied("n1", 5, 2)  # buffered seq 4 and 5 applied
    assert f.awaiting() == []
    assert held(index, "n1", [f"k{i}" for i in range(6)]) == {"k3", "k4"}  # as of seq 5


def test_a_reorder_heals_itself_and_a_stale_snapshot_is_ignored() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    old = log.snapshot()
    b1, b2, b3 = log.record(["a"]), log.record(["b"]), log.record(["c"], ["a"])
    f.apply(b1)
    assert isinstance(f.apply(b3), NeedSnapshot)
    assert f.apply(b2) == Applied("n1", 3, 2)
    assert f.awaiting() == []
    assert f.load_snapshot(old) == Applied("n1", 3, 0)
    assert held(index, "n1", ["a", "b", "c"]) == {"b", "c"}


def test_a_reorder_that_leaves_another_gap_keeps_waiting_for_the_snapshot() -> None:
    f = KvIndexFollower(BlockIndex())
    f.apply(KvEventBatch("n1", 1, ("a",)))
    assert isinstance(f.apply(KvEventBatch("n1", 3, ("c",))), NeedSnapshot)
    f.apply(KvEventBatch("n1", 5, ("e",)))
    assert f.apply(KvEventBatch("n1", 2, ("b",))) == Applied("n1", 3, 2)
    assert f.awaiting() == ["n1"]  # seq 4 is still missing: the request stands
    assert f.apply(KvEventBatch("n1", 6, ("f",))) == Applied("n1", 3, 0)


def test_a_snapshot_replaces_the_nodes_keys() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    index.add("n1", ["stale"])
    index.add("n2", ["stale"])
    f.load_snapshot(KvSnapshot("n1", 7, ("x",)))
    assert index.holders("stale") == {"n2"}
    assert index.holders("x") == {"n1"}
    assert f.expected("n1") == 8
    assert f.apply(KvEventBatch("n1", 8, ("y",))) == Applied("n1", 8, 1)


def test_a_gap_inside_the_buffer_asks_again() -> None:
    f = KvIndexFollower(BlockIndex())
    f.apply(KvEventBatch("n1", 1, ("a",)))
    f.apply(KvEventBatch("n1", 5, ("e",)))
    assert f.load_snapshot(KvSnapshot("n1", 3, ("a", "c"))) == NeedSnapshot("n1", "buffer_gap")
    assert f.awaiting() == ["n1"]
    assert f.load_snapshot(KvSnapshot("n1", 4, ("a", "c", "d"))) == Applied("n1", 5, 1)


def test_a_dead_node_is_dropped_and_may_start_again_at_one() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    f.apply(KvEventBatch("n1", 1, ("a", "b")))
    f.apply(KvEventBatch("n1", 2, ("c",)))
    assert f.drop_node("n1") == 3
    assert len(index) == 0
    assert f.apply(KvEventBatch("n1", 1, ("z",))) == Applied("n1", 1, 1)
    assert index.holders("z") == {"n1"}


def test_a_new_epoch_means_a_restarted_producer() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    f.apply(KvEventBatch("n1", 1, ("a",), epoch="e1"))
    f.apply(KvEventBatch("n1", 2, ("b",), epoch="e1"))
    assert f.apply(KvEventBatch("n1", 1, ("c",), epoch="e2")) == Applied("n1", 1, 1)
    assert held(index, "n1", ["a", "b", "c"]) == {"c"}


KEYS = [f"k{i}" for i in range(8)]
record = hs.tuples(hs.lists(hs.sampled_from(KEYS), max_size=3), hs.lists(hs.sampled_from(KEYS)))
# Each produced batch is delivered 0..2 times; deliveries are then shuffled a little.
delivery = hs.lists(hs.tuples(record, hs.integers(0, 2), hs.integers(0, 3)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(script=delivery, snapshot_every=hs.integers(1, 10))
def test_any_loss_duplication_and_reordering_converges_after_snapshots(
    script: list[tuple[tuple[list[str], list[str]], int, int]], snapshot_every: int
) -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    index.add("n2", KEYS[:3])  # another node's keys are never disturbed
    wire: list[tuple[int, KvEventBatch]] = []
    for i, ((stored, removed), copies, delay) in enumerate(script):
        batch = log.record(stored, removed)
        wire += [(i + delay, batch)] * copies
    wire.sort(key=lambda x: x[0])  # stable: a delay reorders, equal delays keep order
    asked = False
    for n, (_, batch) in enumerate(wire):
        asked |= isinstance(f.apply(batch), NeedSnapshot)
        if asked and n % snapshot_every == 0:  # the snapshot answer arrives at some point
            # ... taken now, i.e. possibly newer than what this follower has seen
            asked = isinstance(f.load_snapshot(log.snapshot()), NeedSnapshot)
    # After the stream goes quiet, a pending request is answered; the index converges.
    if f.awaiting() or asked:
        f.load_snapshot(log.snapshot())
    if f.expected("n1") <= log.seq:  # the tail was lost without a visible gap: a periodic
        f.load_snapshot(log.snapshot())  # snapshot (anti-entropy) repairs it
    assert f.awaiting() == []
    assert held(index, "n1", KEYS) == log.keys
    assert held(index, "n2", KEYS) == set(KEYS[:3])


@settings(max_examples=100, deadline=None)
@given(script=hs.lists(record, max_size=30))
def test_a_lossless_stream_needs_no_snapshot(script: list[tuple[list[str], list[str]]]) -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    for stored, removed in script:
        assert isinstance(f.apply(log.record(stored, removed)), Applied)
    assert held(index, "n1", KEYS) == log.keys


def test_a_gap_makes_the_node_resyncing_until_its_snapshot_and_degraded_without_one() -> None:
    f = KvIndexFollower(BlockIndex())
    log = KvEventLog("n1")
    b = [log.record([f"k{i}"]) for i in range(4)]
    assert f.state("n1") is IndexState.EXACT and f.unsure() == frozenset()
    f.apply(b[0])
    f.apply(b[2])  # seq 2 lost
    assert f.state("n1") is IndexState.RESYNCING and f.unsure() == {"n1"}
    f.degrade("n1")  # no snapshot could be had
    assert f.state("n1") is IndexState.DEGRADED and f.unsure() == {"n1"}
    f.load_snapshot(log.snapshot())
    assert f.state("n1") is IndexState.EXACT and f.states() == {"n1": IndexState.EXACT}
    f.degrade("n1")  # nothing awaited: stays exact
    assert f.state("n1") is IndexState.EXACT
    # A reorder that heals itself is exact again without a snapshot.
    log2 = KvEventLog("n2")
    c = [log2.record([f"m{i}"]) for i in range(3)]
    f.apply(c[0])
    f.apply(c[2])
    assert f.state("n2") is IndexState.RESYNCING
    f.apply(c[1])
    assert f.state("n2") is IndexState.EXACT and f.unsure() == frozenset()


@settings(max_examples=200, deadline=None)
@given(script=delivery)
def test_an_exact_node_s_blocks_are_exactly_the_producer_s_at_the_applied_seq(
    script: list[tuple[tuple[list[str], list[str]], int, int]],
) -> None:
    """Whenever a node is EXACT its blocks in the index are the producer's as of the last
    batch applied (no missed store or removal); while it is not, a match that excludes the
    unsure nodes counts none of its blocks."""
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    keys_at = {0: frozenset[str]()}
    wire: list[tuple[int, KvEventBatch]] = []
    for i, ((stored, removed), copies, delay) in enumerate(script):
        batch = log.record(stored, removed)
        keys_at[batch.seq] = log.keys
        wire += [(i + delay, batch)] * copies
    wire.sort(key=lambda x: x[0])
    for _, batch in wire:
        f.apply(batch)
        if f.state("n1") is IndexState.EXACT:
            assert held(index, "n1", KEYS) == keys_at[f.expected("n1") - 1]
        else:
            assert f.unsure() == {"n1"}
            assert index.match(KEYS, f.unsure()).best_blocks == 0


keys_lists = hs.lists(hs.sampled_from(KEYS), max_size=len(KEYS), unique=True)


@settings(max_examples=300, deadline=None)
@given(
    holdings=hs.dictionaries(hs.sampled_from(["a", "b", "c", "d"]), keys_lists, max_size=4),
    exclude=hs.frozensets(hs.sampled_from(["a", "b", "c", "d"])),
    chain=keys_lists,
)
def test_a_match_excluding_nodes_is_the_match_without_them(
    holdings: dict[str, list[str]], exclude: frozenset[str], chain: list[str]
) -> None:
    full, without = BlockIndex(), BlockIndex()
    for node, keys in holdings.items():
        full.add(node, keys)
        if node not in exclude:
            without.add(node, keys)
    got, want = full.match(chain, exclude), without.match(chain)
    assert (got.best_blocks, got.node_blocks, got.full_holders) == (
        want.best_blocks, want.node_blocks, want.full_holders,
    )  # fmt: skip


def test_tiers_follow_offload_and_promotion_through_batches_and_snapshots() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    index.add("n2", ["a"])
    f.apply(log.record(["a", "b", "c"]))
    f.apply(log.record(ssd=["a", "b", "zz"]))  # a key it does not hold is no tier change
    assert log.ssd_keys == {"a", "b"}
    assert (index.ssd_holders("a"), index.ssd_holders("b")) == ({"n1"}, {"n1"})
    assert index.ssd_holders("zz") == frozenset() and index.holders("zz") == frozenset()
    f.apply(log.record(dram=["a"]))  # promoted
    f.apply(log.record(removed=["b"]))  # evicted from its SSD too
    assert log.ssd_keys == frozenset() and index.ssd_holders("b") == frozenset()
    assert index.ssd_holders("a") == frozenset() and index.holders("a") == {"n1", "n2"}
    f.apply(log.record(["d"], ssd=["d"]))  # stored straight to SSD (one batch)
    snap = log.snapshot()
    assert snap.ssd == ("d",) and set(snap.keys) == {"a", "c", "d"}
    other = BlockIndex()
    KvIndexFollower(other).load_snapshot(snap)
    assert other.ssd_holders("d") == {"n1"} and other.ssd_holders("c") == frozenset()


def test_a_tip_ahead_of_the_applied_batches_is_a_gap() -> None:
    f = KvIndexFollower(BlockIndex())
    log = KvEventLog("n1", epoch="e")
    f.apply(log.record(["a"]))
    assert f.tip(log.tip()) == Applied("n1", 1, 0)  # in step: nothing to do
    log.record(["b"])  # lost: nothing later arrives to show it
    assert f.tip(log.tip()) == NeedSnapshot("n1", "tip")
    assert f.state("n1") is IndexState.RESYNCING
    assert f.tip(log.tip()) == Applied("n1", 1, 0)  # asked once per gap
    f.load_snapshot(log.snapshot())
    assert f.state("n1") is IndexState.EXACT
    # A tip of a new life (restart) drops the old keys and asks for the new ones ...
    assert f.tip(KvTip("n1", 3, "e2")) == NeedSnapshot("n1", "tip")
    assert f.index.holders("a") == frozenset()
    # ... and one that has stored nothing yet (seq 0) needs no snapshot to say so.
    f.load_snapshot(KvSnapshot("n1", 3, ("x",), "e2"))
    assert f.tip(KvTip("n1", 0, "e3")) == Applied("n1", 0, 0)
    assert f.index.holders("x") == frozenset() and f.state("n1") is IndexState.EXACT


tier_record = hs.tuples(
    hs.lists(hs.sampled_from(KEYS), max_size=3),
    hs.lists(hs.sampled_from(KEYS), max_size=2),
    hs.lists(hs.sampled_from(KEYS), max_size=3),
    hs.lists(hs.sampled_from(KEYS), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(script=hs.lists(hs.tuples(tier_record, hs.integers(0, 2), hs.integers(0, 3)), max_size=40))
def test_an_exact_node_s_tiers_are_exactly_the_producer_s_at_the_applied_seq(
    script: list[tuple[tuple[list[str], list[str], list[str], list[str]], int, int]],
) -> None:
    """Under loss, duplication and reordering, whenever the node is EXACT the index says
    which of its blocks are on SSD exactly as the producer did at the applied seq; after the
    closing snapshot the two agree."""
    index = BlockIndex()
    f = KvIndexFollower(index)
    log = KvEventLog("n1")
    at = {0: (frozenset[str](), frozenset[str]())}
    wire: list[tuple[int, KvEventBatch]] = []
    for i, ((stored, removed, ssd, dram), copies, delay) in enumerate(script):
        batch = log.record(stored, removed, ssd=ssd, dram=dram)
        at[batch.seq] = (log.keys, log.ssd_keys)
        wire += [(i + delay, batch)] * copies
    wire.sort(key=lambda x: x[0])

    def tiers() -> tuple[set[str], set[str]]:
        return held(index, "n1", KEYS), {k for k in KEYS if "n1" in index.ssd_holders(k)}

    for _, batch in wire:
        f.apply(batch)
        if f.state("n1") is IndexState.EXACT:
            assert tiers() == at[f.expected("n1") - 1]
    f.load_snapshot(log.snapshot())
    assert tiers() == (log.keys, log.ssd_keys)


def test_a_node_s_delta_says_which_keys_came_went_or_changed_tier() -> None:
    from mooncake.store.node import _KvDelta

    kv = _KvDelta()
    assert not kv
    # (key, before, after): None not held, False in DRAM, True only on SSD
    for key, before, after in [
        ("new", None, False), ("new-on-ssd", None, True), ("gone", False, None),
        ("gone-from-ssd", True, None), ("offloaded", False, True), ("promoted", True, False),
        ("same", False, False), ("still-ssd", True, True), ("never", None, None),
    ]:  # fmt: skip
        kv.note(key, before, after)
    assert kv.stored == ["new", "new-on-ssd"]
    assert kv.removed == ["gone", "gone-from-ssd"]
    assert kv.ssd == ["new-on-ssd", "offloaded"] and kv.dram == ["promoted"]
    # One key changed twice in a batch (removed, then put again): its net change only. A
    # batch applies stored before removed, so both would have left it absent.
    again = _KvDelta()
    again.note("k", False, None)
    again.note("k", None, False)
    assert not again and (again.stored, again.removed) == ([], [])
    again.note("j", None, False)
    again.note("j", False, True)  # put, then offloaded
    assert (again.stored, again.ssd) == (["j"], ["j"])


def test_pool_blocks_no_node_holds_in_dram_are_read_from_ssd() -> None:
    index = BlockIndex()
    index.add("a", KEYS[:4])
    index.add("b", KEYS[:2])
    index.to_ssd("a", KEYS[:4])
    assert index.has_ssd
    # k0, k1: b holds them in DRAM; k2, k3: only a's SSD
    assert index.pool_ssd_blocks(KEYS, 0, 4) == 2
    assert index.pool_ssd_blocks(KEYS, 0, 4, exclude=frozenset({"b"})) == 4
    assert index.pool_ssd_blocks(KEYS, 3, 3) == 0
    index.drop_node("a")
    assert not index.has_ssd and index.pool_ssd_blocks(KEYS, 0, 4) == 0


def test_a_node_not_heard_of_is_degraded_until_it_is_heard_again() -> None:
    index = BlockIndex()
    f = KvIndexFollower(index)
    f.apply(KvEventBatch("n1", 1, ("a",)))
    f.apply(KvEventBatch("n2", 1, ("a",)))
    f.heard("n1", 10.0)
    f.heard("n2", 12.0)
    assert f.silence(12.9, 3.0) == []
    assert f.silence(13.5, 3.0) == ["n1"]  # killed, cut off: its blocks count as unknown
    assert f.silence(14.0, 3.0) == []  # said once
    assert f.state("n1") is IndexState.DEGRADED and f.unsure() == {"n1"}
    assert index.match(["a"], f.unsure()).node_blocks == {"n2": 1}
    assert f.heard("n1", 14.0) and f.state("n1") is IndexState.EXACT  # its tip came back
    assert not f.heard("n1", 14.5)


def test_a_degraded_node_is_asked_again_at_its_next_tip() -> None:
    """No snapshot could be had (a long outage): the node's next tip asks again, so it does
    not stay unknown once it can answer."""
    f = KvIndexFollower(BlockIndex())
    log = KvEventLog("n1")
    f.apply(log.record(["a"]))
    log.record(["b"])  # lost
    f.apply(log.record(["c"]))
    f.degrade("n1")
    assert f.state("n1") is IndexState.DEGRADED
    assert f.tip(log.tip()) == NeedSnapshot("n1", "tip")
    f.load_snapshot(log.snapshot())
    assert f.state("n1") is IndexState.EXACT and f.tip(log.tip()) == Applied("n1", 3, 0)


async def test_a_snapshot_fetched_across_a_drop_does_not_bring_the_node_back() -> None:
    """NodeLost while its snapshot is on the way: the answer is discarded, not loaded."""
    import asyncio
    from types import SimpleNamespace

    from mooncake.namespace import Namespace
    from mooncake.store import protocol as p
    from mooncake.store.kv_follow import KvIndexSubscriber

    answer = asyncio.Event()
    snap = p.KvSnapshotWire(node_id="n1", seq=1, keys=["ghost"])

    class Nats:
        async def request(self, subject: str, data: bytes, **_: object) -> object:
            await answer.wait()
            return SimpleNamespace(data=snap.model_dump_json().encode())

    index = BlockIndex()
    sub = KvIndexSubscriber(Nats(), Namespace("t"), KvIndexFollower(index))  # type: ignore[arg-type]
    fetch = asyncio.create_task(sub._fetch("n1"))
    await asyncio.sleep(0)
    sub.drop_node("n1")
    answer.set()
    await fetch
    assert index.holders("ghost") == frozenset()
    assert "n1" not in sub.states and sub.follower.states() == {}


def test_a_full_index_refuses_new_keys_but_adds_holders_and_frees_room_on_removal() -> None:
    index = BlockIndex(max_keys=3)
    index.add("n1", ["a", "b"])
    index.add("n2", ["b", "c", "d", "e"])  # "b" known: a holder more; room for "c" only
    assert sorted(index.keys()) == ["a", "b", "c"] and index.refused == 2
    assert index.holders("b") == {"n1", "n2"} and index.holders("d") == frozenset()
    index.remove("n1", ["a"])
    index.add("n1", ["d"])
    assert sorted(index.keys()) == ["b", "c", "d"] and index.holders("d") == {"n1"}
    unbounded = BlockIndex()
    unbounded.add("n1", [str(i) for i in range(1000)])
    assert len(unbounded) == 1000 and unbounded.refused == 0
