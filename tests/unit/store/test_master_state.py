"""The store master's pure metadata: two-phase put, leases, eviction, node loss, restore, tiers."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from mooncake.store.allocator import align_up
from mooncake.store.master_state import (
    DEFAULT_OWNER,
    OK,
    Change,
    Lookup,
    MasterConfig,
    MasterState,
    Move,
    ObjectRemoved,
    ObjectStored,
    PutPlan,
    Quota,
    Refusal,
    ReplicaDropped,
    Restored,
)
from mooncake.store.types import (
    Pin,
    Placement,
    Reason,
    ReplicaState,
    ReportedObject,
    SegmentInfo,
    Tier,
)

KB = 1024
T = TypeVar("T")


def dram(node: str, size: int = 4 * KB, i: int = 0) -> SegmentInfo:
    return SegmentInfo(f"{node}-dram-{i}", node, Tier.DRAM, size, {"tcp": f"{node}:1"})


def ssd(node: str, size: int = 16 * KB, i: int = 0) -> SegmentInfo:
    return SegmentInfo(f"{node}-ssd-{i}", node, Tier.SSD, size)


def master(*segs: SegmentInfo, seed: int = 0, **cfg: float) -> MasterState:
    st = MasterState(MasterConfig(**cfg), random.Random(seed))  # type: ignore[arg-type]
    for s in segs:
        assert st.mount(s, 0.0) is OK
    return st


def put(st: MasterState, key: str, size: int = 100, now: float = 0.0, **kw: object) -> PutPlan:
    plan = st.put_start(key, size, now, **kw)  # type: ignore[arg-type]
    assert isinstance(plan, PutPlan), plan
    assert st.put_end(key, now) is OK
    return plan


def found(res: Lookup | Refusal) -> Lookup:
    assert isinstance(res, Lookup), res
    return res


def refused(res: object, reason: Reason) -> None:
    assert isinstance(res, Refusal), res
    assert res.reason is reason, res


def of_type(changes: list[Change], kind: type[T]) -> list[T]:
    return [c for c in changes if isinstance(c, kind)]


# --- segments and nodes ---------------------------------------------------------------------


def test_mount_is_idempotent_and_a_conflicting_mount_is_refused() -> None:
    st = master(dram("a"))
    put(st, "k")
    assert st.mount(dram("a"), 1.0) is OK
    assert found(st.lookup("k", 1.0)).size == 100  # the re-mount kept the segment's objects
    refused(st.mount(dram("a", size=8 * KB), 1.0), Reason.INVALID)
    refused(st.mount(SegmentInfo("a-dram-0", "b", Tier.DRAM, 4 * KB), 1.0), Reason.INVALID)
    refused(st.mount(SegmentInfo("", "b", Tier.DRAM, 4 * KB), 1.0), Reason.INVALID)


def test_heartbeat_of_an_unknown_node_asks_it_to_remount() -> None:
    st = master(dram("a"))
    assert st.heartbeat("a", 1.0) is OK
    refused(st.heartbeat("b", 1.0), Reason.UNKNOWN_NODE)


# --- two-phase put: readers never see a partial object --------------------------------------


def test_put_start_refusals() -> None:
    st = master(dram("a", 1 * KB), dram("b", 1 * KB))
    refused(st.put_start("", 10, 0.0), Reason.INVALID)
    refused(st.put_start("k", 0, 0.0), Reason.INVALID)
    refused(st.put_start("k", 10, 0.0, replicas=0), Reason.INVALID)
    refused(st.put_start("k", 10, 0.0, replicas=3), Reason.NOT_ENOUGH_SEGMENTS)
    refused(st.put_start("k", 2 * KB, 0.0), Reason.NO_SPACE)
    assert isinstance(st.put_start("k", 10, 0.0), PutPlan)
    refused(st.put_start("k", 10, 0.0), Reason.EXISTS)  # being put
    assert st.put_end("k", 0.0) is OK
    refused(st.put_start("k", 10, 0.0), Reason.EXISTS)  # stored


def test_a_pending_put_is_invisible_until_put_end_publishes_it_whole() -> None:
    st = master(dram("a"), dram("b"))
    plan = st.put_start("k", 300, 0.0, replicas=2)
    assert isinstance(plan, PutPlan)
    assert all(r.state is ReplicaState.PENDING for r in plan.replicas)
    refused(st.lookup("k", 0.1), Reason.NOT_FOUND)
    assert st.exists_many(["k"]) == [False]
    refused(st.remove("k", 0.1), Reason.NOT_FOUND)
    assert len(st) == 0 and st.drain() == []
    assert st.put_end("k", 0.2) is OK
    got = found(st.lookup("k", 0.3))
    assert len(got.replicas) == 2
    assert all(r.state is ReplicaState.COMPLETE for r in got.replicas)
    assert st.exists_many(["k", "x"]) == [True, False]
    assert st.drain() == [ObjectStored("k", 300, got.replicas, Pin.NONE)]
    refused(st.put_end("k", 0.4), Reason.NOT_PENDING)
    refused(st.put_revoke("k", 0.4), Reason.NOT_PENDING)


def test_revoke_frees_the_pending_allocation() -> None:
    st = master(dram("a", 1 * KB))
    assert isinstance(st.put_start("k", 1 * KB, 0.0), PutPlan)
    refused(st.put_start("j", 1 * KB, 0.0), Reason.NO_SPACE)  # pending puts are not evicted
    assert st.put_revoke("k", 0.1) is OK
    assert st.drain() == [ObjectRemoved("k", "revoked", ())]
    assert st.usage()["dram"]["used"] == 0
    put(st, "j", 1 * KB)
    refused(st.put_end("k", 0.2), Reason.NOT_PENDING)


def test_a_zombie_put_is_reclaimed_after_the_put_timeout() -> None:
    st = master(dram("a", 1 * KB), put_timeout_s=30.0)
    assert isinstance(st.put_start("k", 1 * KB, 0.0), PutPlan)
    st.heartbeat("a", 25.0)
    st.tick(25.0)
    assert st.object("k") is not None
    st.heartbeat("a", 31.0)
    st.tick(31.0)
    assert st.object("k") is None
    assert st.drain() == [ObjectRemoved("k", "reclaimed", ())]
    refused(st.put_end("k", 31.5), Reason.NOT_PENDING)
    put(st, "j", 1 * KB, 32.0)


# --- placement --------------------------------------------------------------------------------


def test_replicas_go_to_distinct_segments_on_distinct_nodes_first() -> None:
    st = master(dram("a", i=0), dram("a", i=1), dram("b"))
    plan = put(st, "k", replicas=2)
    assert {r.node_id for r in plan.replicas} == {"a", "b"}
    plan3 = put(st, "k3", replicas=3)
    assert len({r.segment_id for r in plan3.replicas}) == 3


def test_preferred_segment_first_when_it_has_room() -> None:
    st = master(dram("a", 8 * KB), dram("b", 1 * KB))
    plan = put(st, "k", 512, preferred_segment="b-dram-0")
    assert plan.replicas[0].segment_id == "b-dram-0"
    plan = put(st, "j", 1 * KB, preferred_segment="b-dram-0")  # b is full now
    assert plan.replicas[0].segment_id == "a-dram-0"


def test_most_free_placement_balances_and_random_placement_is_seeded() -> None:
    st = master(dram("a"), dram("b"), dram("c"))
    segs = [put(st, f"k{i}", 512).replicas[0].segment_id for i in range(6)]
    assert sorted(segs) == sorted(["a-dram-0", "b-dram-0", "c-dram-0"] * 2)

    def random_run(seed: int) -> list[str]:
        st = master(dram("a"), dram("b"), dram("c"), seed=seed)
        return [
            put(st, f"k{i}", 64, placement=Placement.RANDOM).replicas[0].segment_id
            for i in range(20)
        ]

    assert random_run(1) == random_run(1)
    assert len(set(random_run(1))) == 3


# --- leases and remove ------------------------------------------------------------------------


def test_a_lookup_lease_blocks_remove_until_it_runs_out() -> None:
    st = master(dram("a"), dram("b"), lease_s=10.0)
    put(st, "k", replicas=2)
    st.drain()
    assert found(st.lookup("k", 1.0)).lease_until == 11.0
    assert found(st.lookup("k", 5.0)).lease_until == 15.0  # extended
    refused(st.remove("k", 14.0), Reason.LEASED)
    assert st.remove("k", 15.0) is OK
    assert st.drain() == [ObjectRemoved("k", "removed", ("a", "b"))]
    refused(st.lookup("k", 15.0), Reason.NOT_FOUND)
    refused(st.remove("k", 15.0), Reason.NOT_FOUND)
    assert st.usage()["dram"]["used"] == 0


def test_force_remove_ignores_the_lease() -> None:
    st = master(dram("a"))
    put(st, "k")
    st.lookup("k", 1.0)
    assert st.remove("k", 2.0, force=True) is OK
    assert st.exists_many(["k"]) == [False]


def test_lookup_many() -> None:
    st = master(dram("a"))
    put(st, "k")
    res = st.lookup_many(["k", "x"], 1.0)
    assert isinstance(res[0], Lookup)
    refused(res[1], Reason.NOT_FOUND)


# --- eviction ---------------------------------------------------------------------------------


def fill(st: MasterState, n: int, size: int = 256, now: float = 0.0, **kw: object) -> list[str]:
    keys = [f"k{i:03d}" for i in range(n)]
    for i, k in enumerate(keys):
        put(st, k, size, now + i * 0.001, **kw)
    return keys


def test_over_the_watermark_lru_goes_first_and_leased_and_hard_pinned_survive() -> None:
    st = master(dram("a", 10 * KB), dram("b", 10 * KB), lease_s=10.0)
    keys = fill(st, 76)  # 76 x 256 B = 19456 B = 95 % of 20 KiB
    put(st, "hard", 256, 0.5, pin=Pin.HARD)  # 96.25 %
    # k000 and k001 are the oldest, but leased; k002 is then refreshed by a lookup.
    st.lookup("k000", 1.0)
    st.lookup("k001", 1.0)
    st.lookup("k002", 1.0)
    st.drain()
    st.heartbeat("a", 2.0)
    st.heartbeat("b", 2.0)
    st.tick(2.0)
    u = st.usage()["dram"]
    assert u["used"] <= 0.85 * u["capacity"]
    assert u["used"] > 0.80 * u["capacity"]  # approximately 5 %, not everything
    evicted = [c.key for c in st.drain() if isinstance(c, ObjectRemoved)]
    # 96.25 % -> 85 %: 9 objects, the least recently used that are not leased or pinned.
    assert evicted == keys[3:12]
    assert st.exists_many(["k000", "k001", "k002", "hard"]) == [True] * 4
    assert st.exists_many(keys[12:]) == [True] * (76 - 12)


def test_soft_pinned_objects_go_only_after_every_unpinned_candidate() -> None:
    st = master(dram("a", 4 * KB))
    put(st, "soft0", 1 * KB, 0.0, pin=Pin.SOFT)
    put(st, "soft1", 1 * KB, 0.1, pin=Pin.SOFT)
    put(st, "plain0", 1 * KB, 0.2)
    put(st, "plain1", 1 * KB, 0.3)
    st.drain()
    put(st, "new0", 2 * KB, 1.0, pin=Pin.HARD)  # needs both unpinned objects
    assert [c.key for c in st.drain() if isinstance(c, ObjectRemoved)] == ["plain0", "plain1"]
    put(st, "new1", 1 * KB, 2.0)
    removed = [c for c in st.drain() if isinstance(c, ObjectRemoved)]
    assert removed == [ObjectRemoved("soft0", "evicted", ("a",))]


def test_put_start_evicts_lru_to_make_room_and_says_no_space_when_it_cannot() -> None:
    st = master(dram("a", 1 * KB))
    fill(st, 4)
    st.lookup("k000", 100.0)  # leased and recent
    st.drain()
    put(st, "new", 512, 101.0)
    assert [c.key for c in st.drain() if isinstance(c, ObjectRemoved)] == ["k001", "k002"]
    refused(st.put_start("big", 1 * KB, 102.0), Reason.NO_SPACE)  # k000 is leased
    put(st, "big", 1 * KB, 111.0)  # the lease ran out


# --- the object count limit -------------------------------------------------------------------


def test_a_put_past_max_objects_evicts_the_least_recently_used_object() -> None:
    st = master(dram("a", 64 * KB), max_objects=3, lease_s=0.0)
    fill(st, 3)
    found(st.lookup("k000", 1.0))  # read: k001 is now the least recently used
    st.drain()
    put(st, "new", 100, 2.0)
    assert removed(st.drain()) == ["k001"]
    assert st.exists_many(["k000", "k001", "k002", "new"]) == [True, False, True, True]
    assert len(st) == 3 and st.stats["evicted"] == 1


def test_a_put_past_max_objects_is_refused_when_no_object_can_go() -> None:
    st = master(dram("a", 64 * KB), max_objects=3, lease_s=10.0)
    put(st, "hard", pin=Pin.HARD)
    put(st, "leased")
    found(st.lookup("leased", 0.0))
    assert isinstance(st.put_start("pending", 100, 0.0), PutPlan)  # not yet put_end
    st.drain()
    res = st.put_start("more", 100, 1.0)
    refused(res, Reason.NO_SPACE)
    assert isinstance(res, Refusal) and "object count limit reached" in res.detail
    assert "max_objects=3" in res.detail
    assert st.drain() == [] and st.object("more") is None
    assert st.put_end("pending", 1.0) is OK  # now complete, unpinned, never read: it goes
    put(st, "more", 100, 2.0)
    assert removed(st.drain()) == ["pending"]


def test_the_count_limit_evicts_objects_whole_never_offloading_them() -> None:
    # An offload to SSD would keep the object in the table: it is dropped instead.
    st = master(dram("a", 64 * KB), ssd("a", 64 * KB), max_objects=2, lease_s=0.0)
    fill(st, 2)
    st.drain()
    put(st, "new", 100, 1.0)
    changes = st.drain()
    assert removed(changes) == ["k000"] and of_type(changes, Move) == []
    assert st.usage()["ssd"]["used"] == 0


def test_restore_rejects_reported_objects_past_max_objects() -> None:
    st = master(max_objects=2)
    reported = [ReportedObject(f"r{i}", "a-dram-0", i * 128, 100) for i in range(3)]
    res = st.restore("a", [dram("a")], reported, 0.0)
    assert res == Restored(adopted=2, rejected=1)
    assert len(st) == 2


# --- node loss --------------------------------------------------------------------------------


def test_a_dead_node_loses_its_replicas_and_objects_with_another_copy_survive() -> None:
    st = master(dram("a"), dram("b"), node_timeout_s=10.0)
    put(st, "two", replicas=2)
    only_a = put(st, "one", preferred_segment="a-dram-0")
    assert only_a.replicas[0].node_id == "a"
    st.drain()
    st.heartbeat("b", 8.0)
    st.tick(8.0)
    assert st.nodes() == ["a", "b"]
    st.heartbeat("b", 12.0)
    st.tick(12.0)  # a: silent for 12 s
    assert st.nodes() == ["b"]
    got = found(st.lookup("two", 12.5))
    assert [r.node_id for r in got.replicas] == ["b"]
    refused(st.lookup("one", 12.5), Reason.NOT_FOUND)
    changes = st.drain()
    assert ObjectRemoved("one", "node_lost", ("a",)) in changes
    dropped = of_type(changes, ReplicaDropped)
    assert [(d.key, d.replica.node_id, d.reason, d.node_keeps) for d in dropped] == [
        ("two", "a", "node_lost", False)
    ]
    refused(st.heartbeat("a", 13.0), Reason.UNKNOWN_NODE)
    assert st.segment("a-dram-0") is None


def test_unmount_drops_replicas_and_aborts_puts_in_flight() -> None:
    st = master(dram("a"), dram("b"))
    put(st, "k", preferred_segment="a-dram-0")
    put(st, "both", replicas=2)
    assert isinstance(st.put_start("p", 10, 0.0, preferred_segment="a-dram-0"), PutPlan)
    st.drain()
    assert st.unmount("a-dram-0", 1.0) == ["k"]
    refused(st.put_end("p", 1.0), Reason.NOT_PENDING)
    assert st.exists_many(["k", "both"]) == [False, True]
    assert ObjectRemoved("p", "node_lost", ()) in st.drain()
    assert st.unmount("a-dram-0", 1.0) == []


# --- restore after a master restart -----------------------------------------------------------


def test_restore_after_a_restart_finds_the_objects_again() -> None:
    old = master(dram("a"), ssd("a"))
    plans = {k: put(old, k, 200 + i) for i, k in enumerate(["x", "y", "z"])}
    reports = [
        ReportedObject(k, p.replicas[0].segment_id, p.replicas[0].offset, p.size)
        for k, p in plans.items()
    ]
    bad = [
        ReportedObject("overlap", "a-dram-0", plans["x"].replicas[0].offset, 64),
        ReportedObject("outside", "a-dram-0", 4 * KB, 64),
        ReportedObject("foreign", "b-dram-0", 0, 64),
    ]
    new = master()  # the restarted master knows nothing
    refused(new.heartbeat("a", 1.0), Reason.UNKNOWN_NODE)
    res = new.restore("a", [dram("a"), ssd("a")], [*reports, *bad], 1.0)
    assert res == Restored(adopted=3, rejected=3)
    for k, p in plans.items():
        got = found(new.lookup(k, 2.0))
        assert got.replicas[0].offset == p.replicas[0].offset and got.size == p.size
    assert {c.key for c in of_type(new.drain(), ObjectStored)} == {"x", "y", "z"}
    # New puts never land on adopted bytes.
    fresh = put(new, "w", 1 * KB, 3.0)
    r = fresh.replicas[0]
    for p in plans.values():
        q = p.replicas[0]
        assert r.offset + 1 * KB <= q.offset or q.offset + 256 <= r.offset
    # Reporting again what the master already knows is harmless.
    new.drain()
    all_of_it = [*reports, ReportedObject("w", r.segment_id, r.offset, fresh.size)]
    assert new.restore("a", [dram("a"), ssd("a")], all_of_it, 4.0) == Restored(4, 0)
    assert not of_type(new.drain(), ObjectRemoved)
    refused(new.restore("a", [dram("b")], [], 4.0), Reason.INVALID)


def test_a_node_back_with_empty_segments_loses_what_it_does_not_report() -> None:
    """A node killed and started again before it timed out re-mounts the same segment ids
    with nothing in them: what the master had there is gone, not served from empty bytes."""
    st = master(dram("a"), dram("b"))
    put(st, "x", replicas=2)  # on a and b
    put(st, "y", preferred_segment="a-dram-0")
    put(st, "kept", preferred_segment="a-dram-0")
    kept = found(st.lookup("kept", 1.0)).replicas[0]
    st.drain()
    report = [ReportedObject("kept", kept.segment_id, kept.offset, kept.size)]
    assert st.restore("a", [dram("a")], report, 2.0) == Restored(1, 0)
    changes = st.drain()
    assert {c.key for c in of_type(changes, ObjectRemoved)} == {"y"}
    assert [(c.key, c.replica.node_id) for c in of_type(changes, ReplicaDropped)] == [("x", "a")]
    assert [r.node_id for r in found(st.lookup("x", 3.0)).replicas] == ["b"]
    refused(st.lookup("y", 3.0), Reason.NOT_FOUND)
    assert found(st.lookup("kept", 3.0)).replicas[0].offset == kept.offset
    assert st.stats["restore_dropped"] == 2


# --- SSD tier ----------------------------------------------------------------------------------


def test_eviction_offloads_to_ssd_and_a_hit_promotes_back() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 4 * KB), lease_s=10.0)
    put(st, "old", 512, 0.0)
    put(st, "mid", 512, 1.0)
    st.drain()
    # DRAM is full: the LRU object is offloaded; its bytes free only when the move lands.
    refused(st.put_start("new", 512, 2.0), Reason.RETRY_LATER)
    (mv,) = of_type(st.drain(), Move)
    assert mv.key == "old" and mv.src.tier is Tier.DRAM and mv.dst.tier is Tier.SSD
    assert mv.dst.state is ReplicaState.PENDING and mv.src.node_id == mv.dst.node_id == "a"
    assert found(st.lookup("old", 3.0)).replicas == (mv.src,)  # still served from DRAM
    refused(st.put_start("new", 512, 3.0), Reason.RETRY_LATER)  # no second offload
    assert of_type(st.drain(), Move) == []
    assert st.move_done("old", "a-ssd-0", 4.0) is OK
    changes = st.drain()
    stored = of_type(changes, ObjectStored)
    assert [r.tier for r in stored[-1].replicas] == [Tier.SSD]
    assert of_type(changes, ReplicaDropped)[0].node_keeps  # a still holds "old" (on SSD)
    # The lookup at 3.0 leased the DRAM copy until 13.0: its range is held until then.
    refused(st.put_start("new", 512, 5.0), Reason.RETRY_LATER)
    st.heartbeat("a", 13.0)
    st.tick(13.0)
    put(st, "new", 512, 13.5)
    st.drain()

    # A hit on the SSD-only object serves it from SSD now and promotes it.
    got = found(st.lookup("old", 20.0))
    assert [r.tier for r in got.replicas] == [Tier.SSD]
    (promo,) = of_type(st.drain(), Move)  # evicting "mid" (offloaded) made the room
    assert promo.key in {"old", "mid"}
    moves = [promo]
    if promo.key == "mid":  # room is being made for the promotion: finish that first
        assert st.move_done("mid", "a-ssd-0", 21.0) is OK
        st.drain()
        got = found(st.lookup("old", 22.0))
        moves = of_type(st.drain(), Move)
    (promo,) = moves
    assert promo.key == "old" and promo.src.tier is Tier.SSD and promo.dst.tier is Tier.DRAM
    assert st.move_done("old", "a-dram-0", 23.0) is OK
    after = found(st.lookup("old", 24.0))
    assert [r.tier for r in after.replicas] == [Tier.DRAM]
    view = st.object("old")
    assert view is not None and view.move is None
    dropped = of_type(st.drain(), ReplicaDropped)
    assert [(d.replica.tier, d.reason, d.node_keeps) for d in dropped] == [
        (Tier.SSD, "moved", True)
    ]

    def ssd_owners() -> list[str]:
        return [owner for _, _, owner in st.ranges()["a-ssd-0"]]

    assert "old~held" in ssd_owners()  # leased readers may still read the SSD copy
    st.heartbeat("a", 40.0)
    st.tick(40.0)  # leases over: the SSD copy's range is freed
    assert not any(o.startswith("old") for o in ssd_owners())
    assert "mid" in ssd_owners()


def test_a_failed_offload_drops_the_object_and_a_failed_promotion_keeps_it() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 4 * KB))
    put(st, "x", 1 * KB, 0.0)
    refused(st.put_start("y", 1 * KB, 1.0), Reason.RETRY_LATER)
    (_mv,) = of_type(st.drain(), Move)
    refused(st.move_failed("x", "a-dram-0", 2.0), Reason.NOT_FOUND)  # not that move
    assert st.move_failed("x", "a-ssd-0", 2.0) is OK
    assert st.exists_many(["x"]) == [False]
    assert ObjectRemoved("x", "evicted", ("a",)) in st.drain()
    assert st.usage()["ssd"]["used"] == 0
    put(st, "y", 1 * KB, 3.0)


def test_ssd_evicts_its_own_lru_when_full() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 1 * KB))
    put(st, "p", 1 * KB, 0.0)
    refused(st.put_start("q", 1 * KB, 1.0), Reason.RETRY_LATER)
    assert st.move_done("p", "a-ssd-0", 2.0) is OK
    put(st, "q", 1 * KB, 3.0)
    st.drain()
    refused(st.put_start("r", 1 * KB, 4.0), Reason.RETRY_LATER)
    changes = st.drain()
    # q is offloaded to the SSD, which makes room by evicting its own LRU object, p.
    assert ObjectRemoved("p", "evicted", ("a",)) in changes
    (mv,) = of_type(changes, Move)
    assert mv.key == "q" and mv.dst.segment_id == "a-ssd-0"


def test_a_read_during_a_failed_offload_keeps_the_object_in_dram() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 4 * KB), lease_s=10.0)
    put(st, "x", 1 * KB, 0.0)
    refused(st.put_start("y", 1 * KB, 1.0), Reason.RETRY_LATER)
    st.lookup("x", 2.0)  # leased until 12.0
    assert st.move_failed("x", "a-ssd-0", 3.0) is OK
    assert [r.tier for r in found(st.lookup("x", 4.0)).replicas] == [Tier.DRAM]
    assert st.usage()["ssd"]["used"] == 0


def test_unmounting_the_ssd_during_an_offload_cancels_the_move() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 4 * KB))
    put(st, "x", 1 * KB, 0.0)
    refused(st.put_start("y", 1 * KB, 1.0), Reason.RETRY_LATER)
    st.drain()
    assert st.unmount("a-ssd-0", 2.0) == []
    refused(st.move_done("x", "a-ssd-0", 3.0), Reason.NOT_FOUND)
    view = st.object("x")
    assert view is not None and view.move is None
    assert st.mount(ssd("a", 4 * KB), 4.0) is OK  # a fresh SSD: x is offloaded to it anew
    refused(st.put_start("y", 1 * KB, 5.0), Reason.RETRY_LATER)
    (mv,) = of_type(st.drain(), Move)
    assert st.move_done("x", mv.dst.segment_id, 6.0) is OK
    put(st, "y", 1 * KB, 7.0)


def test_a_survivor_of_a_node_loss_is_still_evictable() -> None:
    st = master(dram("a", 1 * KB), dram("b", 1 * KB), node_timeout_s=10.0)
    put(st, "two", 1 * KB, 0.0, replicas=2)
    st.heartbeat("b", 11.0)
    st.tick(11.0)  # a is lost; b is 100 % full with the survivor
    assert st.exists_many(["two"]) == [False]  # evicted down to the watermark
    assert ObjectRemoved("two", "evicted", ("b",)) in st.drain()


def test_a_remove_during_a_move_keeps_the_destination_until_the_node_answers() -> None:
    st = master(dram("a", 1 * KB), ssd("a", 4 * KB))
    put(st, "x", 1 * KB, 0.0)
    st.put_start("y", 1 * KB, 1.0)
    (_mv,) = of_type(st.drain(), Move)
    assert st.remove("x", 2.0) is OK
    assert st.usage()["ssd"]["used"] == 1 * KB  # the node may still be writing there
    refused(st.move_done("x", "a-ssd-0", 3.0), Reason.NOT_FOUND)
    assert st.usage()["ssd"]["used"] == 0
    # And without an answer, the move times out.
    put(st, "z", 1 * KB, 4.0)
    st.put_start("w", 1 * KB, 5.0)
    st.remove("z", 6.0)
    assert st.usage()["ssd"]["used"] == 1 * KB
    st.heartbeat("a", 40.0)
    st.tick(40.0)
    assert st.usage()["ssd"]["used"] == 0


def test_node_loss_during_a_move_cancels_it() -> None:
    st = master(
        dram("a", 1 * KB), ssd("a", 4 * KB), dram("b", 4 * KB),
        node_timeout_s=10.0, high_watermark=0.3,
    )  # fmt: skip
    put(st, "x", 1 * KB, 0.0, preferred_segment="a-dram-0")
    put(st, "y", 1 * KB, 0.1, preferred_segment="b-dram-0")
    st.tick(1.0)  # 40 % > 30 %: the LRU object, x, is offloaded
    assert [m.key for m in of_type(st.drain(), Move)] == ["x"]
    st.heartbeat("b", 11.0)
    st.tick(11.0)
    assert st.exists_many(["x", "y"]) == [False, True]
    refused(st.move_done("x", "a-ssd-0", 12.0), Reason.NOT_FOUND)


@pytest.mark.parametrize("bad", [{"high_watermark": 0.0}, {"evict_fraction": 1.0}])
def test_a_bad_config_is_a_programming_error(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MasterConfig(**bad)  # type: ignore[arg-type]


# --- namespace quotas ---------------------------------------------------------------------------


def quota_master(
    *segs: SegmentInfo, quotas: dict[str, Quota] | None = None, default: Quota | None = None
) -> MasterState:
    cfg = MasterConfig(
        lease_s=10.0, node_timeout_s=10.0, quotas=quotas or {}, default_quota=default
    )
    st = MasterState(cfg, random.Random(0))
    for s in segs:
        assert st.mount(s, 0.0) is OK
    return st


def removed(changes: list[Change]) -> list[str]:
    return [c.key for c in of_type(changes, ObjectRemoved)]


def test_a_namespace_at_its_cap_evicts_its_own_lru_object_never_another_namespaces() -> None:
    st = quota_master(dram("a", 8 * KB), quotas={"A": Quota(dram_bytes=1 * KB)})
    put(st, "b1", 512, 0.0, owner="B")  # the pool's LRU object, but B's
    put(st, "a1", 512, 1.0, owner="A")
    put(st, "a2", 512, 2.0, owner="A")
    st.lookup("a1", 3.0)  # a1 is leased and recent: a2 is A's LRU candidate
    st.drain()
    put(st, "a3", 512, 4.0, owner="A")
    assert removed(st.drain()) == ["a2"]
    assert st.exists_many(["b1", "a1", "a2", "a3"]) == [True, True, False, True]
    assert st.usage_by_owner() == {"A": {"dram": 1 * KB, "ssd": 0}, "B": {"dram": 512, "ssd": 0}}
    assert st.stats["quota_evicted"] == 1
    # The pool is far from its watermark: nobody else is touched by A's quota.
    put(st, "b2", 4 * KB, 5.0, owner="B")
    assert removed(st.drain()) == []


def test_a_namespace_whose_own_objects_cannot_go_is_refused_with_the_quota_reason() -> None:
    st = quota_master(dram("a", 8 * KB), quotas={"A": Quota(dram_bytes=1 * KB)})
    put(st, "hard", 256, 0.0, owner="A", pin=Pin.HARD)
    put(st, "soft", 256, 0.1, owner="A", pin=Pin.SOFT)
    put(st, "leased", 512, 0.2, owner="A")
    st.lookup("leased", 1.0)  # leased until 11.0
    st.drain()
    refused(st.put_start("big", 2 * KB, 1.5, owner="A"), Reason.QUOTA)  # over the cap alone
    # Soft-pinned goes, as in any eviction, when nothing unpinned is left; then no more.
    put(st, "x", 256, 2.0, owner="A", pin=Pin.HARD)
    assert removed(st.drain()) == ["soft"]
    res = st.put_start("y", 256, 3.0, owner="A")
    refused(res, Reason.QUOTA)
    assert isinstance(res, Refusal) and "A" in res.detail
    assert st.stats["quota_refused"] == 2
    assert st.object("y") is None and st.drain() == []  # nothing allocated, nothing evicted
    put(st, "other", 2 * KB, 3.0, owner="B")  # another namespace is not held back
    put(st, "y", 256, 12.0, owner="A")  # the lease ran out: "leased" makes the room
    assert removed(st.drain()) == ["leased"]


def test_the_default_quota_caps_unnamed_namespaces_and_a_named_one_overrides_it() -> None:
    st = quota_master(dram("a", 8 * KB), default=Quota(dram_bytes=512), quotas={"big": Quota()})
    put(st, "d1", 512, 0.0)  # no owner: the default namespace, capped by the default
    put(st, "d2", 512, 1.0)
    assert removed(st.drain()) == ["d1"]
    put(st, "c1", 512, 2.0, owner="C")  # C is capped on its own, not with the default one
    assert st.exists_many(["d2", "c1"]) == [True, True]
    for i in range(4):
        put(st, f"big{i}", 1 * KB, 3.0 + i, owner="big")
    assert removed(st.drain()) == []
    assert st.usage_by_owner()[DEFAULT_OWNER]["dram"] == 512
    assert st.usage_by_owner()["big"]["dram"] == 4 * KB


def test_offloads_respect_the_ssd_quota_evicting_the_namespaces_own_ssd_objects() -> None:
    st = quota_master(dram("a", 1 * KB), ssd("a", 4 * KB), quotas={"A": Quota(ssd_bytes=512)})
    put(st, "b1", 512, 0.0, owner="B")
    put(st, "a1", 512, 1.0, owner="A")

    def offload(key: str, now: float) -> list[Change]:
        refused(st.put_start(key, 512, now, owner="A"), Reason.RETRY_LATER)
        changes = st.drain()
        (mv,) = of_type(changes, Move)
        assert mv.dst.tier is Tier.SSD
        assert st.move_done(mv.key, mv.dst.segment_id, now) is OK
        put(st, key, 512, now, owner="A")
        return changes

    assert of_type(offload("a2", 2.0), Move)[0].key == "b1"  # DRAM room: the pool's LRU
    assert of_type(offload("a3", 3.0), Move)[0].key == "a1"  # A's SSD: 512 of 512
    assert st.usage_by_owner()["A"] == {"dram": 1 * KB, "ssd": 512}
    # a2 goes to SSD next: A's SSD quota is full, so A's own SSD object a1 is dropped for it,
    # not b1 (older, and the SSD has room).
    changes = offload("a4", 4.0)
    assert of_type(changes, Move)[0].key == "a2"
    assert removed(changes) == ["a1"]
    assert st.exists_many(["b1", "a1", "a2"]) == [True, False, True]
    assert st.usage_by_owner()["A"] == {"dram": 1 * KB, "ssd": 512}


def test_a_zero_ssd_quota_turns_an_offload_into_a_drop() -> None:
    st = quota_master(dram("a", 1 * KB), ssd("a", 4 * KB), quotas={"A": Quota(ssd_bytes=0)})
    put(st, "a1", 1 * KB, 0.0, owner="A")
    put(st, "b1", 1 * KB, 1.0, owner="B")  # DRAM room: a1 is evicted, and cannot go to SSD
    changes = st.drain()
    assert of_type(changes, Move) == [] and removed(changes) == ["a1"]
    assert st.usage()["ssd"]["used"] == 0


def test_a_promotion_stays_within_the_dram_quota() -> None:
    st = quota_master(dram("a", 8 * KB), ssd("a", 8 * KB), quotas={"A": Quota(dram_bytes=512)})
    put(st, "a1", 512, 0.0, owner="A")
    # A's quota, not the pool, sends a1 to SSD; the put waits for the move (RETRY_LATER).
    refused(st.put_start("a2", 512, 1.0, owner="A"), Reason.RETRY_LATER)
    (mv,) = of_type(st.drain(), Move)
    assert mv.key == "a1" and st.move_done("a1", mv.dst.segment_id, 1.5) is OK
    put(st, "a2", 512, 2.0, owner="A")
    st.drain()
    # A hit on a1 (on SSD) would take A over its DRAM cap: a2 makes way first.
    assert [r.tier for r in found(st.lookup("a1", 3.0)).replicas] == [Tier.SSD]
    (mv,) = of_type(st.drain(), Move)
    assert (mv.key, mv.dst.tier) == ("a2", Tier.SSD)
    assert st.move_done("a2", mv.dst.segment_id, 3.5) is OK
    st.drain()
    found(st.lookup("a1", 4.0))
    (mv,) = of_type(st.drain(), Move)
    assert (mv.key, mv.dst.tier) == ("a1", Tier.DRAM)
    assert st.usage_by_owner()["A"] == {"dram": 512, "ssd": 1 * KB}  # the promotion in flight


def test_owners_survive_a_master_restart_and_go_with_a_lost_node() -> None:
    st = quota_master(dram("a"), ssd("a"), dram("b"))
    put(st, "x", 300, 0.0, owner="A", preferred_segment="a-dram-0")
    put(st, "y", 100, 0.0, owner="B", replicas=2)
    put(st, "z", 100, 0.0, preferred_segment="a-dram-0")
    assert st.put_start("p", 64, 0.0, owner="C", preferred_segment="a-dram-0") is not None
    usage = st.usage_by_owner()
    assert set(usage) == {"A", "B", DEFAULT_OWNER, "C"}
    fresh = quota_master()
    for node, segs in (("a", [dram("a"), ssd("a")]), ("b", [dram("b")])):
        reports = [
            ReportedObject(k, r.segment_id, r.offset, r.size, pin, owner)
            for k, r, pin, owner in st.node_objects(node)
        ]
        assert isinstance(fresh.restore(node, segs, reports, 1.0), Restored)
    del usage["C"]  # a put in flight is not on any node
    assert fresh.usage_by_owner() == usage
    view = fresh.object("x")
    assert view is not None and view.owner == "A"
    fresh.heartbeat("b", 12.0)
    fresh.tick(12.0)  # a is lost: what only a held is gone from its owners' accounts
    assert fresh.usage_by_owner() == {"B": {"dram": 128, "ssd": 0}}  # y's copy on b


def test_a_negative_quota_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        MasterConfig(quotas={"A": Quota(dram_bytes=-1)})
    with pytest.raises(ValueError):
        MasterConfig(default_quota=Quota(ssd_bytes=-1))


# --- random operation sequences ---------------------------------------------------------------

NODES = {
    "n0": [dram("n0", 1 * KB), ssd("n0", 2 * KB)],
    "n1": [dram("n1", 1 * KB)],
    "n2": [dram("n2", 1 * KB), ssd("n2", 1 * KB)],
}
KEYS = [f"k{i}" for i in range(10)]
OWNERS = ["A", "B", "C"]


@dataclass(frozen=True)
class Op:
    name: str
    key: str
    size: int
    replicas: int
    pin: Pin
    placement: Placement
    flag: bool
    dt: float
    outcomes: tuple[bool, ...]
    owner: str


OPS = ["put"] * 4 + ["start_put", "finish_put", "remove", "kill", "revive"] + ["lookup"] * 3
OPS += ["advance"] * 3 + ["finish_move"] * 2
op_strategy = hs.builds(
    Op,
    name=hs.sampled_from(OPS),
    key=hs.sampled_from(KEYS),
    size=hs.integers(64, 600),
    replicas=hs.integers(1, 2),
    pin=hs.sampled_from([Pin.NONE, Pin.NONE, Pin.SOFT, Pin.HARD]),
    placement=hs.sampled_from(list(Placement)),
    flag=hs.booleans(),
    dt=hs.floats(0.1, 4.0),
    outcomes=hs.lists(hs.booleans(), max_size=3).map(tuple),
    owner=hs.sampled_from(OWNERS),
)


class Model:
    """Drives a master with random puts, reads, removes, moves, node deaths and revivals, and
    checks after every step that its metadata is self-consistent and agrees with what the
    change stream told the world."""

    def __init__(self, **config: object) -> None:
        cfg = MasterConfig(lease_s=5.0, put_timeout_s=20.0, node_timeout_s=10.0, **config)  # type: ignore[arg-type]
        self.st = MasterState(cfg, random.Random(0))
        self.now = 0.0
        self.alive = set(NODES)
        for segs in NODES.values():
            for s in segs:
                self.st.mount(s, 0.0)
        self.leases: dict[str, float] = {}
        self.visible: set[str] = set()  # what ObjectStored / ObjectRemoved said
        self.holders: dict[str, set[str]] = {}  # nodes holding a key, per the change stream
        self.moves: list[Move] = []

    def step(self, op: Op) -> None:
        getattr(self, op.name)(op)
        self.absorb()
        self.check_ranges()
        self.check_objects()
        self.check_accounts()

    def absorb(self) -> None:
        for c in self.st.drain():
            if isinstance(c, ObjectStored):
                self.visible.add(c.key)
                self.holders[c.key] = {r.node_id for r in c.replicas}
            elif isinstance(c, ObjectRemoved):
                if c.reason == "evicted":
                    assert self.leases.get(c.key, -1.0) <= self.now, f"leased {c.key} evicted"
                if c.reason in ("revoked", "reclaimed"):
                    assert c.nodes == () and c.key not in self.visible
                else:
                    assert set(c.nodes) == self.holders.get(c.key, set())
                self.visible.discard(c.key)
                self.holders.pop(c.key, None)
                # A lease covers the object it was granted on: one put again later is new.
                self.leases.pop(c.key, None)
            elif isinstance(c, ReplicaDropped):
                if not c.node_keeps:
                    self.holders[c.key].discard(c.replica.node_id)
                if c.reason != "node_lost" and self.leases.get(c.key, -1.0) > self.now:
                    # a leased replica may stop being served, but its bytes stay allocated
                    held = self.st.ranges()[c.replica.segment_id]
                    assert any(o == c.replica.offset and w == f"{c.key}~held" for o, _, w in held)
            else:
                self.moves.append(c)

    def put(self, op: Op, *, end: bool = True) -> None:
        res = self.st.put_start(
            op.key, op.size, self.now, replicas=op.replicas, pin=op.pin, placement=op.placement,
            owner=op.owner,
        )  # fmt: skip
        cap = self.st.config.cap(op.owner, Tier.DRAM)
        if isinstance(res, PutPlan):
            assert len({r.segment_id for r in res.replicas}) == op.replicas
            assert not self.st.exists_many([op.key])[0]
            # A put never takes its owner over its DRAM cap (restore, not driven here, may).
            assert cap is None or self.st.usage_by_owner()[op.owner]["dram"] <= cap
            if end:
                assert self.st.put_end(op.key, self.now) is OK

    def start_put(self, op: Op) -> None:
        self.put(op, end=False)

    def finish_put(self, op: Op) -> None:
        (self.st.put_revoke if op.flag else self.st.put_end)(op.key, self.now)

    def lookup(self, op: Op) -> None:
        res = self.st.lookup(op.key, self.now)
        if isinstance(res, Lookup):
            assert op.key in self.visible
            assert all(r.state is ReplicaState.COMPLETE for r in res.replicas)
            tiers = [r.tier for r in res.replicas]
            assert tiers == sorted(tiers, key=lambda t: t is Tier.SSD)  # DRAM first
            self.leases[op.key] = res.lease_until
        else:
            assert op.key not in self.visible

    def remove(self, op: Op) -> None:
        res = self.st.remove(op.key, self.now, force=op.flag)
        if res is OK and not op.flag:
            assert self.leases.get(op.key, -1.0) <= self.now
        if res is OK:
            self.leases.pop(op.key, None)

    def finish_move(self, op: Op) -> None:
        """Nodes finish (True) or fail (False) some of the moves they were sent."""
        for ok in op.outcomes or (op.flag,):
            if self.moves:
                mv = self.moves.pop(op.size % len(self.moves))
                done = self.st.move_done if ok else self.st.move_failed
                done(mv.key, mv.dst.segment_id, self.now)

    def advance(self, op: Op) -> None:
        self.now += op.dt
        for n in self.alive:
            self.st.heartbeat(n, self.now)
        self.st.tick(self.now)

    def kill(self, op: Op) -> None:
        self.alive.discard(sorted(NODES)[op.size % len(NODES)])

    def revive(self, op: Op) -> None:
        n = sorted(NODES)[op.size % len(NODES)]
        if n not in self.alive and n not in self.st.nodes():
            assert isinstance(self.st.restore(n, NODES[n], [], self.now), Restored)
            self.alive.add(n)

    def check_ranges(self) -> None:
        status = {s.info.segment_id: s for s in self.st.segments()}
        for sid, spans in self.st.ranges().items():
            for (o1, l1, _), (o2, _, _) in itertools.pairwise(spans):
                assert o1 + l1 <= o2, (sid, spans)
            assert all(0 <= o and o + ln <= status[sid].info.size for o, ln, _ in spans)
            assert sum(ln for _, ln, _ in spans) == status[sid].used

    def check_objects(self) -> None:
        assert self.st.exists_many(KEYS) == [k in self.visible for k in KEYS]
        known = sum(self.st.object(k) is not None for k in KEYS)  # pending puts included
        assert known <= self.st.config.max_objects
        assert len(self.st) == len(self.visible)
        for k in KEYS:
            view = self.st.object(k)
            if view is None or not view.complete:
                assert view is None or all(r.state is ReplicaState.PENDING for r in view.replicas)
                continue
            assert view.replicas, k
            assert all(r.state is ReplicaState.COMPLETE for r in view.replicas)
            assert len({r.segment_id for r in view.replicas}) == len(view.replicas)
            assert self.holders[k] == {r.node_id for r in view.replicas}

    def check_accounts(self) -> None:
        """Each owner is charged exactly its objects' replicas and moves in flight, per tier
        (from the object views); together, every allocated range but the held ones."""
        want: dict[str, dict[str, int]] = {}
        for k in KEYS:
            view = self.st.object(k)
            if view is None:
                continue
            for r in [*view.replicas, *([view.move.dst] if view.move else [])]:
                tiers = want.setdefault(view.owner, dict.fromkeys(["dram", "ssd"], 0))
                tiers[r.tier.value] += align_up(r.size, self.st.config.alignment)
        got = self.st.usage_by_owner()
        assert got == want
        tier_of = {s.info.segment_id: s.info.tier.value for s in self.st.segments()}
        allocated = dict.fromkeys(["dram", "ssd"], 0)
        for sid, spans in self.st.ranges().items():
            allocated[tier_of[sid]] += sum(ln for _, ln, w in spans if not w.endswith("~held"))
        assert allocated == {t: sum(u[t] for u in got.values()) for t in allocated}


@settings(max_examples=120, deadline=None)
@given(ops=hs.lists(op_strategy, min_size=30, max_size=100))
def test_random_operation_sequences_keep_every_invariant(ops: list[Op]) -> None:
    model = Model()
    for op in ops:
        model.step(op)


@settings(max_examples=120, deadline=None)
@given(ops=hs.lists(op_strategy, min_size=30, max_size=100))
def test_random_operation_sequences_under_quotas_keep_every_invariant(ops: list[Op]) -> None:
    model = Model(
        quotas={"A": Quota(dram_bytes=700, ssd_bytes=600), "B": Quota(dram_bytes=1200)},
        default_quota=Quota(ssd_bytes=0),  # C: never offloaded, always dropped
    )
    for op in ops:
        model.step(op)


@settings(max_examples=120, deadline=None)
@given(ops=hs.lists(op_strategy, min_size=30, max_size=100))
def test_random_operation_sequences_under_an_object_count_limit_keep_every_invariant(
    ops: list[Op],
) -> None:
    model = Model(max_objects=4)
    for op in ops:
        model.step(op)
