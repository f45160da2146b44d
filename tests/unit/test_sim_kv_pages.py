"""The simulator's decode instance on a KV page pool (sim/decode.py over core/kv_admission).

A `Bench` drives one DecodeWorker and keeps its own model of the instance from the hooks
alone: the FIFO waiting queue (arrivals at the back, preempted requests at the front), the
members in join order and the pages they hold. Every hook checks the worker against that
model, and every step start (the cost model is asked for the step's time) checks the pages.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core.cost_model import Costs, DecodeModel, TransferModel, reference_costs
from mooncake.core.kv_admission import pages_for
from mooncake.sim import SimConfig, run_simulation
from mooncake.sim.decode import DecodeHooks, DecodeWorker, KvPool, emit_tokens
from mooncake.sim.loop import EventLoop
from mooncake.sim.request import SimRequest
from mooncake.trace import TraceRequest

REF = reference_costs()
LOAD = TransferModel(bandwidth_bytes_per_s=1e6, latency_s=0.5, bytes_per_token=100)
Arrival = tuple[float, int, int]  # (time, prompt tokens, output tokens)


def token_times(r: SimRequest) -> list[float]:
    assert r.first_token_at is not None
    times = [r.first_token_at]
    for g in r.gaps:
        times.append(times[-1] + g)
    return times


class Bench:
    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.loop = EventLoop()
        self.log: list[tuple[float, str, str]] = []
        self.queue: deque[str] = deque()  # the waiting queue, as the hooks tell it
        self.members: list[SimRequest] = []  # hold pages, in join order
        self.rejected: list[str] = []
        self.reqs: list[SimRequest] = []
        self.pages_seen: list[int] = []
        hooks = DecodeHooks(self._join, self._done, self._reject, self._preempt)
        costs = Costs(REF.prefill, self, LOAD)
        self.worker = DecodeWorker("d0", self.loop, costs, hooks, pool)

    def run(self, arrivals: list[Arrival]) -> Bench:
        for i, (at, prompt, output) in enumerate(arrivals):
            r = SimRequest(f"r{i}", at, prompt, output, ())
            self.reqs.append(r)
            self.loop.at(at, self._arrive, r)
        self.loop.run()
        return self

    def kinds(self, kind: str) -> list[str]:
        return [rid for _, k, rid in self.log if k == kind]

    def _note(self, kind: str, r: SimRequest) -> None:
        self.log.append((self.loop.now, kind, r.rid))

    def _arrive(self, r: SimRequest) -> None:
        r.first_token(self.loop.now)  # the prefill's token; decode makes the rest
        self.queue.append(r.rid)
        self._note("arrive", r)
        self.worker.join(r)

    def _join(self, r: SimRequest) -> None:
        assert self.queue.popleft() == r.rid, "joined out of FIFO order"
        self.members.append(r)
        self._note("join", r)

    def _preempt(self, r: SimRequest) -> None:
        assert r is self.members[-1], "the youngest member is the one preempted"
        self.members.pop()
        self.queue.appendleft(r.rid)
        self._note("preempt", r)

    def _done(self, r: SimRequest) -> None:
        assert r.generated == r.output
        self.members = [m for m in self.members if m is not r]
        self._note("done", r)

    def _reject(self, r: SimRequest) -> None:
        assert self.queue.popleft() == r.rid
        self.rejected.append(r.rid)
        self._note("reject", r)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """A step starts: the members' pages (each: its context and next token) fit."""
        pages = sum(pages_for(m.context + 1, self.pool.page_tokens) for m in self.members)
        assert pages <= self.pool.total_pages
        assert pages == self.worker.used_pages
        assert batch <= len(self.members) <= self.pool.max_batch
        self.pages_seen.append(pages)
        return 0.01 * (1 + batch)


def test_a_tiny_pool_preempts_the_youngest_and_everyone_finishes() -> None:
    # 12 pages of 4 tokens. A joins at once, B and C at the first step boundary (3 pages
    # each); all three grow towards 7 pages, so C (the youngest) goes first, then B.
    # D arrives while C waits; B, preempted after D arrived, still rejoins ahead of D.
    pool = KvPool(page_tokens=4, total_pages=12, max_batch=8)
    b = Bench(pool).run([(0.0, 7, 20), (0.0, 7, 20), (0.0, 7, 20), (0.5, 3, 4)])
    a, bb, c, _ = b.reqs
    assert all(r.done and r.generated == r.output for r in b.reqs)
    assert b.kinds("preempt")[:2] == ["r2", "r1"]
    assert a.preemptions == 0 and bb.preemptions >= 1 and c.preemptions >= 1
    assert b.worker.preemptions == sum(r.preemptions for r in b.reqs) == len(b.kinds("preempt"))
    at = {(k, rid): t for t, k, rid in reversed(b.log)}  # the first time of each
    assert at["preempt", "r2"] < at["arrive", "r3"] < at["preempt", "r1"]
    joins = b.kinds("join")
    assert joins.index("r3") > max(i for i, rid in enumerate(joins) if rid in ("r1", "r2"))
    assert max(b.pages_seen) == pool.total_pages
    assert b.worker.used_pages == 0 and not b.worker.members and not any(b.worker.phases)


def test_a_rejoin_waits_for_its_kv_to_load_and_the_gap_shows_it() -> None:
    pool = KvPool(page_tokens=4, total_pages=12, max_batch=8)
    b = Bench(pool).run([(0.0, 7, 20), (0.0, 7, 20), (0.0, 7, 20)])
    c = b.reqs[2]
    rejoin_at = [t for t, k, rid in b.log if k == "join" and rid == "r2"][1]
    times = token_times(c)
    nxt = next(t for t in times if t > rejoin_at)
    # Its context when it rejoined: the tokens it had before that moment.
    context = c.prompt + sum(1 for t in times if t <= rejoin_at)
    assert nxt - rejoin_at >= LOAD.transfer_s(context) - 1e-9
    assert max(c.gaps) >= LOAD.transfer_s(context)  # the TBT score sees the preemption
    assert len(c.gaps) == c.output - 1  # no token lost or doubled


def test_a_full_batch_keeps_the_rest_waiting_in_order() -> None:
    pool = KvPool(page_tokens=16, total_pages=1000, max_batch=2)
    b = Bench(pool).run([(0.0, 10, 5)] * 5)
    assert b.kinds("join") == [f"r{i}" for i in range(5)]
    assert all(r.done for r in b.reqs) and b.worker.preemptions == 0


def test_a_request_larger_than_the_pool_is_rejected_and_the_rest_run() -> None:
    pool = KvPool(page_tokens=4, total_pages=4, max_batch=8)
    b = Bench(pool).run([(0.0, 20, 3), (0.0, 5, 3)])
    assert b.rejected == ["r0"]
    assert b.reqs[1].done and not b.reqs[0].done


def test_a_pool_has_at_least_one_page() -> None:
    with pytest.raises(ValueError):
        KvPool.sized(8, 16, None)
    assert KvPool.sized(100, 16, None).total_pages == 6
    assert KvPool.sized(None, 16, 4).max_batch == 4
    with pytest.raises(ValueError):
        KvPool.sized(1000, 16, 0)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[KvPool, list[Arrival]]:
    n = draw(st.integers(1, 8))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.005, 0.02, 0.3]), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(2, 30), min_size=n, max_size=n))
    times = [sum(gaps[: i + 1]) for i in range(n)]
    pt = draw(st.sampled_from([1, 4, 16]))
    # Every request's whole life fits the pool alone: nothing is ever NEVER.
    least = max(pages_for(p + o + 1, pt) for p, o in zip(prompts, outputs, strict=True))
    total = draw(st.integers(least, least + 12))
    batch = draw(st.sampled_from([1, 2, 3, 64]))
    arrivals = list(zip(times, prompts, outputs, strict=True))
    return KvPool(pt, total, batch), arrivals


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_any_arrivals_all_finish_within_the_pool(w: tuple[KvPool, list[Arrival]]) -> None:
    pool, arrivals = w
    b = Bench(pool).run(arrivals)  # the Bench checks order, victims and pages as it runs
    assert not b.rejected
    for r in b.reqs:
        assert r.done and r.generated == r.output and len(r.gaps) == r.output - 1
        assert all(g >= 0 for g in r.gaps)
    assert b.worker.preemptions == len(b.kinds("preempt"))
    assert b.worker.used_pages == 0 and not b.worker.waiting and not b.worker.members


# --- no capacity: the decode instance as it was before pages -----------------------------------


class UnpagedWorker:
    """The decode instance before KV pages (verbatim logic): the oracle for `capacity None`."""

    def __init__(self, loop: EventLoop, model: DecodeModel) -> None:
        self.loop, self.model = loop, model
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []
        self.context = 0
        self.stepping = False

    def join(self, req: SimRequest) -> None:
        self.joining.append(req)
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        for r in self.joining:
            self.running.append(r)
            self.context += r.context
        self.joining.clear()
        if not self.running:
            self.stepping = False
            return
        self.stepping = True
        self.loop.after(self.model.decode_step_s(len(self.running), self.context), self._stepped)

    def _stepped(self) -> None:
        self.running, self.context = emit_tokens(
            self.running, self.context, self.loop.now, lambda _r: None
        )
        self._step()


def _replay(arrivals: list[Arrival], make: Callable[[EventLoop], object]) -> list[object]:
    loop = EventLoop()
    worker = make(loop)
    reqs = [SimRequest(f"r{i}", at, p, o, ()) for i, (at, p, o) in enumerate(arrivals)]

    def arrive(r: SimRequest) -> None:
        r.first_token(loop.now)
        worker.join(r)  # type: ignore[attr-defined]

    for r in reqs:
        loop.at(r.arrival, arrive, r)
    loop.run()
    return [(r.first_token_at, tuple(r.gaps), r.finished_at, r.preemptions) for r in reqs]


def _paged(pool: KvPool) -> Callable[[EventLoop], DecodeWorker]:
    hooks = DecodeHooks(lambda _r: None, lambda _r: None, lambda _r: None)
    return lambda loop: DecodeWorker("d0", loop, REF, hooks, pool)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.01, 0.05, 1.0]),
            st.integers(1, 30_000),
            st.integers(2, 40),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_no_capacity_decodes_exactly_as_before(steps: list[Arrival]) -> None:
    at, arrivals = 0.0, []
    for gap, prompt, output in steps:
        at += gap
        arrivals.append((at, prompt, output))
    before = _replay(arrivals, lambda loop: UnpagedWorker(loop, REF.decode))
    assert _replay(arrivals, _paged(KvPool.sized(None, 16, None))) == before
    assert _replay(arrivals, _paged(KvPool.sized(10**12, 16, None))) == before


# --- the whole system -----------------------------------------------------------------------------

ONE = SimConfig(prefill_instances=1, decode_instances=1, policy="none")


def _trace(n: int, prompt: int, output: int) -> list[TraceRequest]:
    return [
        TraceRequest(i, 0.1 * i, prompt, output, tuple(range(100 * i, 100 * i + prompt // 512)))
        for i in range(n)
    ]


def test_the_system_reports_preemptions_when_capacity_binds() -> None:
    # The Conductor fits prompts (3 x 1500 <= 6000); the decode instance also needs the
    # growth: 3 x (1500 + 600) > 6000, so the youngest is preempted and rejoins.
    cfg = dataclasses.replace(ONE, kv_capacity_tokens=6000, page_tokens=16)
    res = run_simulation(_trace(3, 1500, 600), cfg)
    m = res.metrics
    assert m["completed"] == 3 and m["rejected"] == 0
    assert m["preemptions"] > 0 and m["preempted_requests"] >= 1
    assert all(r.generated == r.output for r in res.requests)
    assert res.requests[0].preemptions == 0  # the oldest is never the victim


def test_the_system_with_ample_capacity_matches_no_capacity() -> None:
    trace = _trace(12, 3000, 40)
    runs = [
        run_simulation(trace, dataclasses.replace(ONE, kv_capacity_tokens=cap, speed=4.0))
        for cap in (None, 10**12)
    ]
    a, b = ([(r.ttft, tuple(r.gaps), r.finished_at) for r in x.requests] for x in runs)
    assert a == b and runs[0].metrics["preemptions"] == 0
