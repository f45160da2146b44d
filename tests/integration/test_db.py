"""The Postgres record: migrations vs models, append-only log, stream-order projections,
rebuild identical to live, and a verification that can fail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.config import Settings
from mooncake.db.engine import check
from mooncake.db.rebuild import read_projections, rebuild, verify
from mooncake.db.record import Incoming, record_events

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_models_and_migrations_do_not_drift(settings: Settings) -> None:
    assert settings.database_url
    check(settings.database_url)  # raises alembic's CommandError on drift


def _lifecycle(rid: str, seq0: int) -> list[Incoming]:
    es: list[ev.Event] = [
        ev.RequestSubmitted(request_id=rid, token_ids=[1, 2, 3], occurred_at=T0),
        ev.RequestAdmitted(request_id=rid, policy="none", occurred_at=T0 + timedelta(seconds=1)),
        ev.PrefillStarted(request_id=rid, instance="p0", occurred_at=T0 + timedelta(seconds=2)),
        ev.RequestPrefilled(
            request_id=rid, instance="p0", prompt_tokens=3, cached_tokens=2,
            occurred_at=T0 + timedelta(seconds=3),
        ),
    ]  # fmt: skip
    return [Incoming(e, "MC_REQ", seq0 + i, e.SUBJECT) for i, e in enumerate(es)]


async def test_events_are_append_only(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await record_events(conn, _lifecycle("a", 1)[:1])
    with pytest.raises(DBAPIError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE events SET type = 'x'"))
    with pytest.raises(DBAPIError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM events"))


async def test_out_of_order_arrival_folds_in_stream_order_and_rebuild_is_identical(
    engine: AsyncEngine,
) -> None:
    a = _lifecycle("a", 1)
    b = _lifecycle("b", 10)
    kv = ev.KvObjectStored(key="k1", size_bytes=7, replicas=[ev.Replica(node="n", segment="s")])
    inst = ev.InstanceRegistered(instance_id="p0", role="prefill")
    meta = [Incoming(kv, "MC_META", 1, kv.SUBJECT), Incoming(inst, "MC_META", 2, inst.SUBJECT)]
    # a arrives scrambled across batches (a redelivery after a crash); b and a duplicate too.
    batches = [[a[1], b[0], meta[0]], [a[0], b[1], b[2]], [a[3], a[2], b[3], a[0]], [meta[1]]]
    for batch in batches:
        async with engine.begin() as conn:
            await record_events(conn, batch)
    async with engine.connect() as conn:
        live = await read_projections(conn)
    assert live["requests"]["a"]["status"] == "prefilled"
    assert live["requests"]["a"]["illegal_events"] == 0
    assert live["requests"]["a"]["cached_tokens"] == 2
    assert live["requests"]["b"]["status"] == "prefilled"
    assert set(live["kv_objects"]) == {"k1"} and set(live["instances"]) == {"p0"}
    assert await verify(engine) == []
    counts = await rebuild(engine)
    assert counts == {"requests": 2, "kv_objects": 1, "instances": 1}
    async with engine.connect() as conn:
        assert await read_projections(conn) == live


async def test_verify_detects_a_projection_that_drifted(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await record_events(conn, _lifecycle("a", 1))
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE requests SET output_tokens = 99"))
    diffs = await verify(engine)
    assert diffs and "output_tokens" in diffs[0]
    await rebuild(engine)
    assert await verify(engine) == []


async def test_an_event_id_reused_for_another_request_is_recorded_once_per_request(
    engine: AsyncEngine,
) -> None:
    """A client that reuses an event id for two requests: both submissions are facts (each
    request gets its row); the same message delivered again is still a duplicate."""

    def submitted(rid: str, seq: int) -> Incoming:
        e = ev.RequestSubmitted(event_id="NaN", request_id=rid, token_ids=[1], occurred_at=T0)
        return Incoming(e, "MC_REQ", seq, e.SUBJECT)

    a, b, c = submitted("a", 1), submitted("b", 2), submitted("c", 3)
    async with engine.begin() as conn:
        first = await record_events(conn, [a, b])  # the reuse inside one batch
    async with engine.begin() as conn:
        second = await record_events(conn, [c, b, a])  # across batches, and redeliveries
    assert (first.inserted, first.duplicates) == (2, 0)
    assert (second.inserted, second.duplicates) == (1, 2)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(text("SELECT request_id, event_id FROM events ORDER BY stream_seq"))
        ).all()
        live = await read_projections(conn)
    assert [r for r, _ in rows] == ["a", "b", "c"]
    assert rows[0][1] == "NaN" and len({e for _, e in rows}) == 3
    assert {k: v["status"] for k, v in live["requests"].items()} == dict.fromkeys(
        "abc", "submitted"
    )
    assert await verify(engine) == []


async def test_each_end_is_reported_by_exactly_one_recorded_batch(engine: AsyncEngine) -> None:
    """`RecordResult.ended` (what the per-tenant metrics count): a request's row in the batch
    that moved it into a terminal state, also when that batch closed a gap (the row folded
    again from the log); never again for a redelivery or a fact after the end."""
    a = _lifecycle("a", 1)
    done = ev.RequestCompleted(
        request_id="a", output_tokens=2, ttft_s=0.5, tbt_s=0.01,
        occurred_at=T0 + timedelta(seconds=4),
    )  # fmt: skip
    stopped = ev.DecodeStopped(request_id="a", instance="d0", reason="client", output_tokens=2)
    rejected = ev.RequestRejected(request_id="r", reason=ev.RejectReason.TENANT_QUOTA)
    end = Incoming(done, "MC_REQ", 5, done.SUBJECT)
    after = Incoming(stopped, "MC_REQ", 6, stopped.SUBJECT)
    batches = [
        [a[0], a[1], end],  # the end before its prefill: not applicable yet
        [a[2], a[3], Incoming(rejected, "MC_REQ", 7, rejected.SUBJECT)],  # the gap closes
        [end, a[0]],  # redeliveries
        [after],  # a fact after the end
    ]
    ended = []
    for batch in batches:
        async with engine.begin() as conn:
            ended.append((await record_events(conn, batch)).ended)
    closed = [("a", "completed"), ("r", "rejected")]
    assert [[(r["request_id"], r["status"]) for r in e] for e in ended] == [[], closed, [], []]
    row = ended[1][0]
    got = (row["tenant"], row["ttft_s"], row["prompt_tokens"], row["cached_tokens"])
    assert got == (ev.DEFAULT_TENANT, 0.5, 3, 2)


def _scripted() -> list[ev.Event]:
    """A history touching every branch of the request fold, with its timestamps."""

    def t(s: float) -> datetime:
        return T0 + timedelta(seconds=s)

    return [
        # "done": a prefill redelivered, a decode preempted, resumed and re-dispatched
        ev.RequestSubmitted(request_id="done", token_ids=[1, 2, 3, 4, 5],
                            params=ev.SamplingParams(max_tokens=8), client_id="c1",
                            occurred_at=t(0)),
        ev.RequestAdmitted(request_id="done", policy="early", prefill_instance="p0",
                           decode_instance="d0", predicted_ttft_s=0.5, predicted_tbt_s=0.04,
                           occurred_at=t(1)),
        ev.PrefillStarted(request_id="done", instance="p0", occurred_at=t(2)),
        ev.PrefillStarted(request_id="done", instance="p1", attempt=2, occurred_at=t(3)),
        ev.RequestPrefilled(request_id="done", instance="p1", prompt_tokens=5, cached_tokens=2,
                            remote_cached_tokens=1, prefill_s=0.3, occurred_at=t(4)),
        ev.DecodeStarted(request_id="done", instance="d0", occurred_at=t(5)),
        ev.DecodePreempted(request_id="done", instance="d0", occurred_at=t(6)),
        ev.DecodeResumed(request_id="done", instance="d0", occurred_at=t(7)),
        ev.DecodeStarted(request_id="done", instance="d1", attempt=2, occurred_at=t(8)),
        ev.RequestCompleted(request_id="done", output_tokens=7, finish_reason="length",
                            ttft_s=1.5, tbt_s=0.05, occurred_at=t(9)),
        ev.TokensNotStored(request_id="done", instance="d1", first_index=5, last_index=7,
                           occurred_at=t(10)),
        # "cancelled": its decode says how many tokens went out, after the cancellation
        ev.RequestSubmitted(request_id="cancelled", token_ids=[9], occurred_at=t(0)),
        ev.RequestAdmitted(request_id="cancelled", policy="none", occurred_at=t(1)),
        ev.PrefillStarted(request_id="cancelled", instance="p0", occurred_at=t(2)),
        ev.RequestPrefilled(request_id="cancelled", instance="p0", prompt_tokens=1,
                            occurred_at=t(3)),
        ev.DecodeStarted(request_id="cancelled", instance="d0", occurred_at=t(4)),
        ev.CancelRequested(request_id="cancelled", occurred_at=t(5)),
        ev.RequestCancelled(request_id="cancelled", stage="decode", occurred_at=t(6)),
        ev.DecodeStopped(request_id="cancelled", instance="d0", reason="client",
                         output_tokens=3, occurred_at=t(7)),
        # "rejected" at admission; "failed" at prefill
        ev.RequestSubmitted(request_id="rejected", token_ids=[1], occurred_at=t(0)),
        ev.RequestRejected(request_id="rejected", reason=ev.RejectReason.TTFT_SLO,
                           policy="early", occurred_at=t(1)),
        ev.RequestSubmitted(request_id="failed", token_ids=[1, 2], occurred_at=t(0)),
        ev.RequestAdmitted(request_id="failed", policy="none", occurred_at=t(1)),
        ev.PrefillStarted(request_id="failed", instance="p0", occurred_at=t(2)),
        ev.RequestFailed(request_id="failed", reason="prefill_error", stage="prefill",
                         occurred_at=t(3)),
        # "illegal": a completion straight after submission is counted, not applied
        ev.RequestSubmitted(request_id="illegal", token_ids=[1], occurred_at=t(0)),
        ev.RequestCompleted(request_id="illegal", output_tokens=1, occurred_at=t(1)),
    ]  # fmt: skip


# Worked out by hand from the history above, column by column (not by the fold under test).
EXPECTED = {
    "done": {
        "status": "completed", "client_id": "c1", "max_tokens": 8, "policy": "early",
        "prefill_instance": "p1", "decode_instance": "d1", "prompt_tokens": 5,
        "cached_tokens": 2, "remote_cached_tokens": 1, "output_tokens": 7,
        "prefill_attempts": 2, "decode_attempts": 2, "preemptions": 1,
        "predicted_ttft_s": 0.5, "predicted_tbt_s": 0.04, "prefill_s": 0.3, "ttft_s": 1.5,
        "tbt_s": 0.05, "finish_reason": "length", "reject_reason": None,
        "failure_reason": None, "cancel_requested": False, "illegal_events": 0,
        "finished_at": T0 + timedelta(seconds=9),
    },
    "cancelled": {
        "status": "cancelled", "policy": "none", "prefill_instance": "p0",
        "decode_instance": "d0", "prompt_tokens": 1, "output_tokens": 3,
        "prefill_attempts": 1, "decode_attempts": 1, "preemptions": 0,
        "finish_reason": None, "cancel_requested": True, "illegal_events": 0,
        "finished_at": T0 + timedelta(seconds=6),
    },
    "rejected": {
        "status": "rejected", "policy": "early", "reject_reason": "ttft_slo",
        "prefill_attempts": 0, "output_tokens": 0, "illegal_events": 0,
        "finished_at": T0 + timedelta(seconds=1),
    },
    "failed": {
        "status": "failed", "failure_reason": "prefill_error", "prefill_attempts": 1,
        "decode_attempts": 0, "prompt_tokens": 2, "illegal_events": 0,
        "finished_at": T0 + timedelta(seconds=3),
    },
    "illegal": {
        "status": "submitted", "output_tokens": 0, "illegal_events": 1, "finished_at": None,
    },
}  # fmt: skip


def _mismatches(requests: dict[str, dict[str, object]]) -> list[str]:
    return [
        f"{rid}.{col}: {requests[rid].get(col)!r} != {want!r}"
        for rid, cols in EXPECTED.items()
        for col, want in cols.items()
        if requests[rid].get(col) != want
    ]


async def _record_scripted(engine: AsyncEngine) -> dict[str, dict[str, object]]:
    items = [Incoming(e, "MC_REQ", i + 1, e.SUBJECT) for i, e in enumerate(_scripted())]
    for start in range(0, len(items), 7):  # several batches, as the recorder writes them
        async with engine.begin() as conn:
            await record_events(conn, items[start : start + 7])
    async with engine.connect() as conn:
        return (await read_projections(conn))["requests"]


async def test_the_requests_projection_equals_a_history_worked_out_by_hand(
    engine: AsyncEngine,
) -> None:
    """`verify` compares the live projection with a rebuild, and both run the same fold: it
    cannot catch a wrong fold. This compares the projection with hand-computed values."""
    requests = await _record_scripted(engine)
    assert set(requests) == set(EXPECTED)
    assert _mismatches(requests) == []


async def test_a_wrong_fold_passes_verify_but_not_the_hand_computed_history(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The companion: a fold that forgets preemptions agrees with its own rebuild."""
    from dataclasses import replace

    from mooncake.core import lifecycle

    right = lifecycle._fold

    def wrong(s: lifecycle.RequestState, e: ev.RequestEvent) -> lifecycle.RequestState:
        new = right(s, e)
        return replace(new, preemptions=0) if isinstance(e, ev.DecodePreempted) else new

    monkeypatch.setattr(lifecycle, "_fold", wrong)
    requests = await _record_scripted(engine)
    assert await verify(engine) == []  # blind to it
    assert _mismatches(requests) == ["done.preemptions: 0 != 1"]
