"""The shm transport's split of a batch's copies over threads (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake.store.transfer.shm import split_moves


def _bytes(moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(destination, source) of every byte, in order."""
    return [(d + i, s + i) for d, s, n in moves for i in range(n)]


@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    parts=st.integers(1, 9),
)
def test_every_byte_is_copied_once_in_order_and_the_runs_are_balanced(
    sizes: list[int], parts: int
) -> None:
    moves, at = [], 0
    for k, n in enumerate(sizes):
        moves.append((10_000 * (k + 1), at, n))
        at += n
    runs = split_moves(moves, parts)
    assert _bytes([m for run in runs for m in run]) == _bytes(moves)
    assert all(n > 0 for run in runs for _, _, n in run)
    loads = [sum(n for _, _, n in run) for run in runs]
    assert len(runs) == min(parts, sum(sizes))
    assert max(loads) - min(loads) <= 1


def test_one_part_is_the_batch_itself() -> None:
    moves = [(100, 0, 5), (200, 5, 7)]
    assert split_moves(moves, 1) == [moves]
    assert split_moves(moves, 2) == [[(100, 0, 5), (200, 5, 1)], [(201, 6, 6)]]
