"""The segment allocator: best fit, alignment, coalescing, exact reservations."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.store.allocator import Allocator


def take(a: Allocator, n: int) -> int:
    off = a.allocate(n)
    assert off is not None
    return off


def test_offsets_are_aligned_and_sizes_rounded_up() -> None:
    a = Allocator(1024, alignment=64)
    assert a.allocate(1) == 0
    assert a.allocate(65) == 64
    assert a.used == 64 + 128
    assert a.allocated(64) == 128
    assert a.free_bytes == 1024 - 192


def test_full_segment_refuses_and_free_makes_room_again() -> None:
    a = Allocator(256, alignment=64)
    offs = [a.allocate(64) for _ in range(4)]
    assert offs == [0, 64, 128, 192]
    assert a.allocate(1) is None
    assert a.largest_free == 0
    a.free(64)
    assert a.allocate(64) == 64


def test_best_fit_picks_the_smallest_hole_that_fits() -> None:
    a = Allocator(1024, alignment=64)
    offs = [take(a, 64) for _ in range(8)]  # 0..448
    a.free(offs[1])  # hole of 64 at 64
    a.free(offs[3])
    a.free(offs[4])  # hole of 128 at 192
    assert a.allocate(128) == 192  # not the big tail at 512
    assert a.allocate(64) == 64


def test_freeing_neighbours_coalesces() -> None:
    a = Allocator(512, alignment=64)
    offs = [take(a, 128) for _ in range(4)]
    for o in (offs[0], offs[2], offs[1], offs[3]):
        a.free(o)
    assert a.free_ranges() == [(0, 512)]
    assert a.allocate(512) == 0


def test_free_of_an_unknown_offset_is_a_bug() -> None:
    a = Allocator(512)
    off = a.allocate(64)
    assert off is not None
    with pytest.raises(ValueError):
        a.free(off + 64)
    a.free(off)
    with pytest.raises(ValueError):
        a.free(off)


def test_reserve_takes_exactly_a_free_range() -> None:
    a = Allocator(1024, alignment=64)
    assert a.reserve(256, 100)  # [256, 384)
    assert not a.reserve(320, 64)  # overlaps
    assert not a.reserve(10, 64)  # misaligned
    assert not a.reserve(1024, 64)  # out of range
    assert not a.reserve(960, 128)  # runs past the end
    assert a.reserve(0, 256)
    assert a.used == 384
    assert a.allocate(64) == 384
    a.free(256)
    assert a.allocate(128) == 256


def test_a_segment_that_is_not_a_multiple_of_the_alignment() -> None:
    a = Allocator(100, alignment=64)
    assert a.allocate(64) == 0
    assert a.allocate(1) is None  # 36 bytes left, less than one aligned unit
    assert a.free_bytes == 36


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 10**6)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 4096), alignment=st.sampled_from([1, 8, 64]), script=ops)
def test_allocations_never_overlap_and_account_exactly(
    size: int, alignment: int, script: list[tuple[bool, int, int]]
) -> None:
    a = Allocator(size, alignment)
    live: dict[int, int] = {}
    for is_alloc, n, pick in script:
        if is_alloc or not live:
            off = a.allocate(n)
            if off is None:
                need = -(-n // alignment) * alignment
                assert a.largest_free < need
                continue
            assert off % alignment == 0
            live[off] = a.allocated(off) or 0
            assert live[off] >= n
        else:
            off = sorted(live)[pick % len(live)]
            a.free(off)
            del live[off]
        spans = sorted(live.items())
        for (o1, l1), (o2, _) in itertools.pairwise(spans):
            assert o1 + l1 <= o2
        assert all(0 <= o and o + ln <= size for o, ln in spans)
        assert a.used == sum(live.values())
        assert a.used + a.free_bytes == size
        assert a.free_bytes == sum(ln for _, ln in a.free_ranges())
    for off in list(live):
        a.free(off)
    assert a.free_ranges() == [(0, size)]
    assert a.largest_free == size
