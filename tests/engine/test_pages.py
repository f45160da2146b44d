"""The page allocator's laws, under random programs of alloc / release / publish / lookup:
no page is lost or handed out twice, refcounts return to zero, and eviction never frees a
page someone holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.engine.pages import PageAllocator

TOTAL = 24


def check(a: PageAllocator, held: dict[int, list[int]]) -> None:
    """Every page is exactly one of: free, held (refcount = holders), idle in the cache."""
    counts = [0] * TOTAL
    for pages in held.values():
        for p in pages:
            counts[p] += 1
    for p in range(TOTAL):
        assert a.refs(p) == counts[p], p
    free = set(a._free)
    assert len(free) == len(a._free), "a page is on the free list twice"
    idle = {p for key in a._idle for p in a._blocks[key]}
    held_pages = {p for p in range(TOTAL) if counts[p]}
    assert not free & held_pages and not idle & held_pages and not free & idle
    assert free | held_pages | idle == set(range(TOTAL))
    assert a.idle == len(idle) and a.available == len(free) + len(idle)
    for key in a._idle:  # an idle block has no holder at all
        assert all(counts[p] == 0 for p in a._blocks[key])


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "release", "publish", "lookup"]),
        st.integers(0, 7),  # a holder (a sequence)
        st.integers(0, 6),  # pages to allocate / a block key
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_programs_keep_every_page_accounted_for(program: list[tuple[str, int, int]]) -> None:
    a = PageAllocator(TOTAL)
    held: dict[int, list[int]] = {}
    for op, who, n in program:
        mine = held.setdefault(who, [])
        if op == "alloc":
            before = a.available
            got = a.alloc(n)
            if got is None:
                assert before < n
            else:
                assert len(got) == n and len(set(got)) == n
                mine.extend(got)
        elif op == "release" and mine:
            a.release(mine)
            mine.clear()
        elif op == "publish" and len(mine) >= 2:
            a.publish(f"k{n}", mine[:2])  # may refuse: key taken, page in a block
        elif op == "lookup":
            pages = a.lookup(f"k{n}")
            if pages is not None:
                mine.extend(pages)
        check(a, held)
    for pages in held.values():
        a.release(pages)
    held.clear()
    check(a, held)
    assert a.used == 0 and a.free + a.idle == TOTAL


def test_an_idle_block_is_reused_until_evicted_least_recently_used_first() -> None:
    a = PageAllocator(6)
    x, y = a.alloc(2), a.alloc(2)
    assert x is not None and y is not None
    assert a.publish("x", x) and a.publish("y", y)
    assert not a.publish("x", y)  # the key is cached already
    a.release(x)
    a.release(y)
    assert (a.free, a.idle, a.available) == (2, 4, 6)
    assert a.lookup("x") == tuple(x)  # a hit holds it again: not evictable now
    assert a.alloc(5) is None  # 2 free + y's 2 idle: not enough
    got = a.alloc(4)  # evicts y, never x
    assert got is not None and not set(got) & set(x)
    assert a.cached_keys() == ["x"]
    assert a.lookup("y") is None and a.contains("x")


def test_a_held_block_is_never_evicted() -> None:
    a = PageAllocator(4)
    pages = a.alloc(4)
    assert pages is not None and a.publish("b", pages[:2])
    a.release(pages[2:])
    assert a.alloc(3) is None  # only 2 free: the block is held
    assert a.alloc(2) is not None and a.contains("b")


def test_release_more_often_than_held_is_an_error() -> None:
    a = PageAllocator(2)
    pages = a.alloc(1)
    assert pages is not None
    a.release(pages)
    try:
        a.release(pages)
    except ValueError:
        return
    raise AssertionError("a double release went unnoticed")
