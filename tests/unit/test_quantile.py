"""The one quantile (core/quantile.py): nearest rank, worked out by hand."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from mooncake.core.quantile import percentiles, quantile


def test_nearest_rank_by_hand() -> None:
    ten = [float(x) for x in range(10, 0, -1)]  # 10, 9, ..., 1: order does not matter
    assert quantile(ten, 0.5) == 5.0  # ceil(5) = 5th smallest
    assert quantile(ten, 0.9) == 9.0  # ceil(9) = 9th, not the largest
    assert quantile(ten, 0.91) == 10.0  # ceil(9.1) = 10th
    assert quantile(ten, 0.01) == 1.0
    assert quantile([], 0.5) is None
    assert quantile([3.0, math.inf], 0.9) == math.inf  # a miss counts
    assert percentiles([1.23456, 2.0], digits=2) == {"p50": 1.23, "p90": 2.0, "p99": 2.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1), st.floats(0.01, 1))
def test_at_least_q_of_the_values_are_at_or_below_it(xs: list[float], q: float) -> None:
    x = quantile(xs, q)
    assert x in xs
    at_or_below = sum(1 for v in xs if v <= x)
    below = sum(1 for v in xs if v < x)
    assert at_or_below >= q * len(xs) - 1e-9  # enough at or below
    assert below < q * len(xs) + 1e-9  # and it is the smallest such value
