"""The per-client token bucket (mooncake.ratelimit): pure, time is an argument."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.ratelimit import ClientLimits, Limit, TokenBucket, retry_after_s


def test_a_full_bucket_gives_its_burst_then_one_per_interval() -> None:
    b = TokenBucket.full(Limit(rate_per_s=2.0, burst=3), now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)  # the next token in 1/rate
    assert b.take(0.25) == pytest.approx(0.25)  # a refusal takes nothing
    assert b.take(0.5) == 0.0
    assert b.take(0.5) == pytest.approx(0.5)


def test_refill_is_capped_at_the_burst() -> None:
    b = TokenBucket.full(Limit(rate_per_s=10.0, burst=5), now=0.0)
    for _ in range(5):
        b.take(0.0)
    assert b.take(3600.0) == 0.0
    assert b.tokens == pytest.approx(4.0)  # 5 (the cap), not 36,000, minus the one taken


def test_a_clock_that_steps_back_takes_nothing_away() -> None:
    b = TokenBucket.full(Limit(rate_per_s=1.0, burst=2), now=10.0)
    assert b.take(10.0) == 0.0
    assert b.take(5.0) == 0.0  # one token left, still there
    assert b.take(5.0) > 0


def test_disabled_limit_never_refuses() -> None:
    limits = ClientLimits(Limit(rate_per_s=0.0, burst=0))
    assert all(limits.take("flood", 0.0) == 0.0 for _ in range(10_000))
    assert len(limits) == 0  # nothing is even remembered


def test_a_limit_must_let_one_request_through() -> None:
    with pytest.raises(ValueError, match="burst"):
        Limit(rate_per_s=1.0, burst=0.5)


def test_one_clients_flood_does_not_touch_anothers_bucket() -> None:
    limits = ClientLimits(Limit(rate_per_s=1.0, burst=2))
    flood = [limits.take("greedy", 0.0) for _ in range(1000)]
    assert flood[:2] == [0.0, 0.0] and all(w > 0 for w in flood[2:])
    assert limits.take("polite", 0.0) == 0.0
    assert limits.take("polite", 0.0) == 0.0


def test_memory_is_bounded_and_the_least_recently_used_go() -> None:
    limits = ClientLimits(Limit(rate_per_s=1.0, burst=1), max_clients=3)
    for c in ("a", "b", "c"):
        assert limits.take(c, 0.0) == 0.0
    assert limits.take("a", 0.0) > 0  # "a" is now the most recent
    assert limits.take("d", 0.0) == 0.0  # evicts "b", the least recently used
    assert len(limits) == 3
    assert limits.take("a", 0.0) > 0  # "a" kept its (empty) bucket
    assert limits.take("b", 0.0) == 0.0  # "b" starts full again


def test_retry_after_is_whole_seconds_and_never_zero() -> None:
    assert retry_after_s(0.01) == 1
    assert retry_after_s(1.0) == 1
    assert retry_after_s(1.2) == 2


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 100.0),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=200),
)
def test_never_more_than_burst_plus_rate_times_elapsed(
    rate: float, burst: int, gaps: list[float]
) -> None:
    """The law of a token bucket: over any run from a full bucket, what gets through is at
    most burst + rate * elapsed, and a refused request is told a positive wait after which
    (with nothing else sent) it does get through."""
    b = TokenBucket.full(Limit(rate, burst), now=0.0)
    now, allowed = 0.0, 0
    for gap in gaps:
        now += gap
        wait = b.take(now)
        if wait == 0.0:
            allowed += 1
        else:
            assert wait > 0
            probe = TokenBucket(b.limit, b.tokens, b.updated_at)
            assert probe.take(now + wait + 1e-9) == 0.0
        assert allowed <= burst + rate * now + 1e-6
