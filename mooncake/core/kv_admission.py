"""Admission to a decode instance's running batch by KV pages, and who is preempted when
pages run out. PURE: the live decode worker and the simulator's decode instance both call it.

A decode instance keeps its sequences' KV in a fixed pool of pages (engine.pool; PAPER.md §2:
decode instances admit by KV capacity). A request joins the batch only when the pool can give
the pages of its whole context (the prompt, the output tokens a preempted request already has,
and the next token) while keeping a reserve for the running sequences to grow. The reserve is
one page per running sequence: a sequence needs a new page every `page_tokens` steps, so with
it every running sequence can write a whole page more before anybody must be preempted, which
keeps joins from turning straight into preemptions. An instance with nothing running takes
any request whose pages fit at all, so the reserve never starves a request that fits the pool.

Pages a request already holds (leading prompt blocks it shares from the pool's cache) are not
asked for again. `free_pages` counts what the pool can hand out now: free pages and pages of
cached blocks nobody holds (evicted on demand).

When a step needs a page the pool cannot give, the youngest sequence (the last to join) leaves
first: it has done the least work, and the oldest finish and give their pages back soonest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    JOIN = "join"
    WAIT_PAGES = "wait_pages"  # not enough free pages now (after the reserve)
    WAIT_BATCH = "wait_batch"  # the batch has max_batch sequences
    NEVER = "never_fits"  # more pages than the whole pool: it cannot run here at all


@dataclass(frozen=True, slots=True)
class PoolState:
    """A decode instance's pool and batch as admission sees them."""

    page_tokens: int
    total_pages: int
    free_pages: int
    running: int
    max_batch: int

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.total_pages < 1 or self.max_batch < 1:
            raise ValueError("a pool has positive page size, pages and batch size")
        if not 0 <= self.free_pages <= self.total_pages or self.running < 0:
            raise ValueError("free pages within the pool, running not negative")


def pages_for(tokens: int, page_tokens: int) -> int:
    return -(-max(tokens, 0) // page_tokens)


def reserve_pages(running: int) -> int:
    """Pages kept free for the running sequences' growth (one each)."""
    return running


def admit(state: PoolState, context_tokens: int, held_pages: int = 0) -> Verdict:
    """May a request with `context_tokens` tokens of KV (its next token comes on top) join
    now, holding `held_pages` of the pages it needs already?"""
    whole = pages_for(context_tokens + 1, state.page_tokens)
    if whole > state.total_pages:
        return Verdict.NEVER
    if state.running >= state.max_batch:
        return Verdict.WAIT_BATCH
    need = max(whole - held_pages, 0)
    reserve = reserve_pages(state.running) if state.running else 0
    return Verdict.JOIN if need + reserve <= state.free_pages else Verdict.WAIT_PAGES


def pull_room(state: PoolState, unadmitted: int) -> int:
    """How many more work messages to ask the broker for. A message's prompt size is known
    only once it arrives, so work is taken one message at a time: the next is asked for when
    every message taken has its pages (`unadmitted` counts those that do not yet: just
    arrived, or waiting for pages, preempted ones included) and the batch has a free slot.
    Work the instance cannot hold yet stays on its queue, where the Conductor sees it."""
    if unadmitted or state.running >= state.max_batch:
        return 0
    return 1


def victim(joined: Mapping[str, int]) -> str:
    """The sequence to preempt: the youngest, by join order (ties: the larger id)."""
    if not joined:
        raise ValueError("nothing to preempt")
    return max(joined, key=lambda sid: (joined[sid], sid))
