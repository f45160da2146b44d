"""A disaggregated decode instance: continuous batching over a pool of KV pages.

A step takes the cost model's `decode_step_s(batch, context tokens)` for the batch as it is
when the step starts; every running request gets one token per step.

KV pages (the rule is core/kv_admission.py, the one the live decode worker calls too):
- the instance holds `KvPool.total_pages` pages of `page_tokens` tokens (its KV capacity;
  `KvPool.unbounded()` when the configuration gives none: nothing ever waits for pages);
- requests that reach it wait in FIFO order and join at a step boundary when `admit` says
  JOIN (context = prompt + tokens generated so far); the head waiting blocks the rest, so no
  request overtakes another; one whose pages exceed the whole pool (`NEVER`) is handed to
  `on_reject`;
- a member (running, or rejoining: see below) holds the pages of its context plus its next
  token, `pages_for(context + 1)`; before each step, while the members' pages exceed the
  pool, the youngest member by join order (`victim`) is preempted: it drops its pages and goes
  back to the front of the waiting queue, ahead of new arrivals, keeping its tokens.

Reload cost of a preempted request (the model chosen, and why). Preemption drops the
sequence's KV from the instance's HBM; its prompt blocks are in the store (the prefill wrote
them) and its generated tokens' KV is taken to be swapped out to host memory as it leaves
(not charged: it runs beside the steps, not inside them). When it is admitted again it takes
its pages at once and then spends `costs.transfer.transfer_s(context)` loading its whole
context back, outside the batch; it joins the batch at the first step boundary after the
load. Charging the transfer engine's time for the whole context is the simplest model that
never makes a preemption free, and it reuses the one transfer predictor the Conductor uses;
it does not slow the other running sequences (the load is DMA, not compute). Nothing is
recomputed. The request's next token therefore comes late, and its TBT gap shows the whole
wait (`emit_tokens` measures each gap from its previous token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mooncake.core.cost_model import Costs
from mooncake.core.kv_admission import PoolState, Verdict, admit, pages_for, victim
from mooncake.sim.loop import EventLoop
from mooncake.sim.request import SimRequest

Hook = Callable[[SimRequest], None]
UNBOUNDED = 2**62  # pages or batch slots no run can reach


@dataclass(frozen=True, slots=True)
class KvPool:
    """A decode instance's KV page pool and batch limit."""

    page_tokens: int
    total_pages: int
    max_batch: int

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.total_pages < 1 or self.max_batch < 1:
            raise ValueError("a KV pool has positive page size, pages and batch size")

    @classmethod
    def unbounded(cls, max_batch: int | None = None) -> KvPool:
        """No KV limit (pages of one token, so page growth is plain token counting)."""
        return cls(1, UNBOUNDED, UNBOUNDED if max_batch is None else max_batch)

    @classmethod
    def sized(cls, capacity_tokens: int | None, page_tokens: int, max_batch: int | None) -> KvPool:
        """`capacity_tokens // page_tokens` pages; None: unbounded (and so is max_batch)."""
        if capacity_tokens is None:
            return cls.unbounded(max_batch)
        if capacity_tokens < page_tokens:
            raise ValueError(f"KV capacity {capacity_tokens} holds no page of {page_tokens}")
        batch = UNBOUNDED if max_batch is None else max_batch
        return cls(page_tokens, capacity_tokens // page_tokens, batch)


def _ignore(_req: SimRequest) -> None:
    return None


@dataclass(frozen=True, slots=True)
class DecodeHooks:
    on_join: Hook  # admitted: it holds its pages (a rejoin has req.preemptions > 0)
    on_done: Hook  # last token generated
    on_reject: Hook  # its pages exceed the whole pool: it cannot run here
    on_preempt: Hook = _ignore  # preempted: back to the front of the waiting queue


class DecodeWorker:
    def __init__(
        self, iid: str, loop: EventLoop, costs: Costs, hooks: DecodeHooks, pool: KvPool
    ) -> None:
        self.id, self.loop, self.costs, self.hooks, self.pool = iid, loop, costs, hooks, pool
        self.waiting: deque[SimRequest] = deque()  # FIFO; preempted ones go to the front
        self.members: dict[str, SimRequest] = {}  # hold pages: running, loading or ready
        self.order: dict[str, int] = {}  # member -> join number (victim: the youngest)
        self.running: list[SimRequest] = []  # in the batch
        self.loading: dict[str, int] = {}  # rejoining member -> its load's join number
        self.ready: list[SimRequest] = []  # loaded, joins the batch at the next boundary
        self.context = 0  # summed context of the running batch
        self.used_pages = 0  # pages the members hold: pages_for(context + 1) each
        # Running sequences by (context - steps) % page_tokens. Every step adds one token to
        # each of them and one to `steps`, so a sequence keeps its phase while it runs, and
        # the ones that fill a page at step k are one bucket: page growth costs O(1) a step.
        self.phases = [0] * pool.page_tokens
        self.stepping = False
        self.steps = 0
        self.joins = 0
        self.preemptions = 0

    def join(self, req: SimRequest) -> None:
        self.waiting.append(req)
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        if self.ready or self.waiting or self.used_pages > self.pool.total_pages:
            self._boundary()
        if not self.running:
            self.stepping = False
            return
        self.stepping = True
        self.steps += 1
        step_s = self.costs.decode.decode_step_s(len(self.running), self.context)
        self.loop.after(step_s, self._stepped)

    def _stepped(self) -> None:
        self.running, self.context = emit_tokens(
            self.running, self.context, self.loop.now, self._finished
        )
        # A sequence whose context is now a whole number of pages needs a fresh page for
        # its next token (pages_for(c + 1) - pages_for(c) == 1 exactly when c % pt == 0).
        self.used_pages += self.phases[-self.steps % self.pool.page_tokens]
        self._step()

    def _finished(self, req: SimRequest) -> None:
        del self.members[req.rid], self.order[req.rid]
        self.phases[self._phase(req)] -= 1
        # It held the pages of its context before this last token, plus that token's.
        self.used_pages -= pages_for(req.context, self.pool.page_tokens)
        self.hooks.on_done(req)

    def _phase(self, req: SimRequest) -> int:
        return (req.context - self.steps) % self.pool.page_tokens

    def _enter(self, req: SimRequest) -> None:
        """Into the running batch (at a step boundary)."""
        self.running.append(req)
        self.context += req.context
        self.phases[self._phase(req)] += 1

    # --- step boundary: pages for the next token, then joins --------------------------------

    def _boundary(self) -> None:
        for r in self.ready:
            self._enter(r)
        self.ready.clear()
        while self.used_pages > self.pool.total_pages:
            self._preempt(self.members[victim(self.order)])
        self._admit_waiting()

    def _preempt(self, req: SimRequest) -> None:
        del self.members[req.rid], self.order[req.rid]
        self.used_pages -= pages_for(req.context + 1, self.pool.page_tokens)
        if self.loading.pop(req.rid, None) is None:  # else: its load is dropped
            # By identity: SimRequest's dataclass equality compares every field.
            kept = [r for r in self.running if r is not req]
            if len(kept) < len(self.running):
                self.context -= req.context
                self.phases[self._phase(req)] -= 1
            self.running = kept
            self.ready = [r for r in self.ready if r is not req]
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)  # the older of two preempted at once ends up first
        self.hooks.on_preempt(req)

    def _state(self) -> PoolState:
        p = self.pool
        free = max(p.total_pages - self.used_pages, 0)
        return PoolState(p.page_tokens, p.total_pages, free, len(self.members), p.max_batch)

    def _admit_waiting(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            verdict = admit(self._state(), head.context)
            if verdict is Verdict.NEVER:
                self.waiting.popleft()
                self.hooks.on_reject(head)
                continue
            if verdict is not Verdict.JOIN:
                return  # WAIT_PAGES / WAIT_BATCH: the head waits, and so does everyone after
            self.waiting.popleft()
            self._take(head)

    def _take(self, req: SimRequest) -> None:
        self.joins += 1
        self.members[req.rid], self.order[req.rid] = req, self.joins
        self.used_pages += pages_for(req.context + 1, self.pool.page_tokens)
        self.hooks.on_join(req)
        if req.preemptions:  # its KV was dropped: load it back before it runs again
            self.loading[req.rid] = self.joins
            load_s = self.costs.transfer.transfer_s(req.context)
            self.loop.after(load_s, self._loaded, req, self.joins)
            return
        self._enter(req)

    def _loaded(self, req: SimRequest, join: int) -> None:
        if self.loading.get(req.rid) != join:
            return  # preempted again while loading: that load was dropped
        del self.loading[req.rid]
        self.ready.append(req)
        if not self.stepping:
            self._step()


def emit_tokens(
    running: list[SimRequest], context: int, now: float, on_done: Callable[[SimRequest], None]
) -> tuple[list[SimRequest], int]:
    """One decode step: every running request emits a token; finished ones leave (and
    release their context). Returns the requests still running and the batch's context."""
    context += len(running)
    keep: list[SimRequest] = []
    for r in running:
        # One more token at `now`, its gap from the previous one. Written out here, not a
        # method call: the simulator's innermost loop (~12 M in `simulate paper --quick`).
        r.gaps.append(now - r.last_token_at)
        r.last_token_at = now
        r.generated += 1
        if r.generated >= r.output:
            r.finished_at = now
            context -= r.context
            on_done(r)
        else:
            keep.append(r)
    return keep, context
