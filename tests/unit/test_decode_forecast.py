"""FinishedDecodes: the sliding window of finished decodes the Conductor forecasts from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.core.decode_forecast import FinishedDecodes


def test_an_empty_window_forecasts_no_growth_and_no_horizon() -> None:
    f = FinishedDecodes(4)
    assert (f.mean_output, f.longest, f.durations) == (0.0, 0.0, 0)


def test_the_longest_decode_leaves_the_window_with_its_request() -> None:
    f = FinishedDecodes(3)
    f.add(100, 30.0)
    f.add(10, 2.0)
    f.add(None, 5.0)  # no output reported: its duration still counts
    f.add(20, None)  # never decoded here (its first token ended it): its output counts
    assert f.longest == 30.0 and f.durations == 3
    assert f.mean_output == pytest.approx((100 + 10 + 20) / 3)
    f.add(40, 1.0)  # the 30 s decode slides out
    assert f.longest == 5.0 and f.durations == 3
    assert f.mean_output == pytest.approx((10 + 20 + 40) / 3)


def test_negative_values_are_ignored_and_a_window_needs_room() -> None:
    f = FinishedDecodes(2)
    f.add(-1, -0.5)
    assert (f.durations, f.mean_output) == (0, 0.0)
    with pytest.raises(ValueError):
        FinishedDecodes(0)


@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 100)), max_size=40),
)
def test_the_window_matches_the_last_finished_requests(
    window: int, finished: list[tuple[int, float]]
) -> None:
    f = FinishedDecodes(window)
    for tokens, seconds in finished:
        f.add(tokens, seconds)
    last = finished[-window:]
    assert f.durations == len(last)
    assert f.longest == (max(s for _, s in last) if last else 0.0)
    mean = sum(t for t, _ in last) / len(last) if last else 0.0
    assert f.mean_output == pytest.approx(mean)
