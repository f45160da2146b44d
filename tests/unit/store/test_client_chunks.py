"""How a put batch is split for pipelining (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake.store.client import _chunks


def test_small_batch_is_one_chunk() -> None:
    assert _chunks([0, 1, 2], [10, 10, 10], 100) == [[0, 1, 2]]


def test_large_batch_splits_in_order_near_the_target() -> None:
    todo = list(range(64))
    chunks = _chunks(todo, [1 << 20] * 64, 4 << 20)
    assert [i for c in chunks for i in c] == todo
    assert len(chunks) == 8 and all(len(c) == 8 for c in chunks)  # target = total / 8


@given(st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=200))
def test_chunks_keep_every_item_once_and_in_order(sizes: list[int]) -> None:
    todo = [i * 3 for i in range(len(sizes))]
    chunks = _chunks(todo, sizes, 1000)
    assert [i for c in chunks for i in c] == todo
    assert all(c for c in chunks)
    assert len(chunks) <= max(1, len(sizes))
