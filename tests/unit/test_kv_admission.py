"""Admission to a decode batch by KV pages (core.kv_admission): its laws, and its edges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.core.kv_admission import (
    PoolState,
    Verdict,
    admit,
    pages_for,
    pull_room,
    reserve_pages,
    victim,
)


@st.composite
def pools(draw: st.DrawFn) -> PoolState:
    total = draw(st.integers(1, 400))
    return PoolState(
        page_tokens=draw(st.sampled_from([1, 4, 16, 32])),
        total_pages=total,
        free_pages=draw(st.integers(0, total)),
        running=draw(st.integers(0, 40)),
        max_batch=draw(st.integers(1, 40)),
    )


def test_pages_round_up() -> None:
    assert [pages_for(n, 16) for n in (0, 1, 15, 16, 17, 32)] == [0, 1, 1, 1, 2, 2]


def test_a_request_joins_an_empty_instance_whenever_its_pages_fit() -> None:
    s = PoolState(page_tokens=16, total_pages=10, free_pages=3, running=0, max_batch=4)
    assert admit(s, 47) is Verdict.JOIN  # 48 tokens with the next one: 3 pages
    assert admit(s, 48) is Verdict.WAIT_PAGES  # 49 tokens: 4 pages
    assert admit(s, 159) is Verdict.WAIT_PAGES
    assert admit(s, 160) is Verdict.NEVER  # 161 tokens: more than the whole pool


def test_running_sequences_keep_a_page_each_for_growth() -> None:
    s = PoolState(page_tokens=16, total_pages=10, free_pages=5, running=2, max_batch=4)
    assert reserve_pages(2) == 2
    assert admit(s, 47) is Verdict.JOIN  # 3 pages + 2 reserved = 5
    assert admit(s, 48) is Verdict.WAIT_PAGES  # 4 + 2 > 5
    # Pages it already shares from the pool's cache are not asked for again.
    assert admit(s, 48, held_pages=1) is Verdict.JOIN


def test_a_full_batch_waits_whatever_the_pages() -> None:
    s = PoolState(page_tokens=16, total_pages=10, free_pages=10, running=4, max_batch=4)
    assert admit(s, 1) is Verdict.WAIT_BATCH


@given(pools(), st.integers(0, 3000), st.integers(0, 50))
def test_a_join_never_dips_into_the_reserve(s: PoolState, context: int, held: int) -> None:
    verdict = admit(s, context, held)
    need = max(pages_for(context + 1, s.page_tokens) - held, 0)
    if verdict is Verdict.JOIN:
        assert s.running < s.max_batch
        assert need <= s.free_pages
        assert s.running == 0 or need + reserve_pages(s.running) <= s.free_pages
    if pages_for(context + 1, s.page_tokens) > s.total_pages:
        assert verdict is Verdict.NEVER


@given(pools(), st.integers(0, 3000))
def test_more_free_pages_never_turn_a_join_away(s: PoolState, context: int) -> None:
    more = PoolState(s.page_tokens, s.total_pages, s.total_pages, s.running, s.max_batch)
    if admit(s, context) is Verdict.JOIN:
        assert admit(more, context) is Verdict.JOIN


@given(pools(), st.integers(0, 3000))
def test_a_longer_context_never_joins_where_a_shorter_one_waits(s: PoolState, n: int) -> None:
    if admit(s, n + 1) is Verdict.JOIN:
        assert admit(s, n) is Verdict.JOIN


def test_work_is_taken_one_message_at_a_time_once_the_last_has_its_pages() -> None:
    s = PoolState(page_tokens=16, total_pages=10, free_pages=10, running=1, max_batch=4)
    assert pull_room(s, unadmitted=0) == 1
    assert pull_room(s, unadmitted=1) == 0  # just arrived, or waiting for pages
    full = PoolState(page_tokens=16, total_pages=10, free_pages=10, running=4, max_batch=4)
    assert pull_room(full, unadmitted=0) == 0


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 100), min_size=1))
def test_the_youngest_is_preempted_first(joined: dict[str, int]) -> None:
    v = victim(joined)
    assert joined[v] == max(joined.values())


def test_nothing_to_preempt_is_an_error() -> None:
    with pytest.raises(ValueError):
        victim({})


def test_impossible_pools_are_refused() -> None:
    with pytest.raises(ValueError):
        PoolState(page_tokens=16, total_pages=10, free_pages=11, running=0, max_batch=1)
    with pytest.raises(ValueError):
        PoolState(page_tokens=0, total_pages=10, free_pages=1, running=0, max_batch=1)
