"""Projection folds: incremental folding equals folding from scratch (the rebuild law)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake import events as ev
from mooncake.db import projections as proj
from mooncake.db.record import _continues


def _request_events() -> list[ev.Event]:
    rid = "r1"
    return [
        ev.RequestSubmitted(request_id=rid, token_ids=[1, 2]),
        ev.RequestAdmitted(request_id=rid, policy="none"),
        ev.RequestAdmitted(request_id=rid, policy="none"),  # illegal: counted, not applied
        ev.PrefillStarted(request_id=rid, instance="p0"),
        ev.RequestPrefilled(request_id=rid, instance="p0", prompt_tokens=2, cached_tokens=1),
        ev.DecodeStarted(request_id=rid, instance="d0"),
        ev.RequestCompleted(request_id=rid, output_tokens=3),
    ]


def _kv_events() -> list[ev.Event]:
    rep = [ev.Replica(node="n0", segment="s0"), ev.Replica(node="n1", segment="s1", tier="ssd")]
    return [
        ev.KvObjectStored(key="k", size_bytes=10, replicas=rep[:1]),
        ev.KvObjectStored(key="k", size_bytes=10, replicas=rep, pin="soft"),
        ev.KvObjectRemoved(key="k", reason="evicted"),
        ev.KvObjectStored(key="k", size_bytes=12, replicas=rep[1:]),
    ]


def _instance_events() -> list[ev.Event]:
    return [
        ev.InstanceRegistered(instance_id="p0", role="prefill", capacity={"slots": 4}),
        ev.InstanceDeregistered(instance_id="p0", reason="killed"),
        ev.InstanceRegistered(instance_id="p0", role="prefill"),
    ]


SEQUENCES = {"req:r1": _request_events(), "kv:k": _kv_events(), "inst:p0": _instance_events()}


def _seq(events: list[ev.Event]) -> list[proj.SeqEvent]:
    return [(i + 1, e) for i, e in enumerate(events)]


def test_request_fold_counts_illegal_events_and_tracks_the_sequence() -> None:
    row = proj.fold("req:r1", None, _seq(_request_events()))
    assert row is not None
    assert row["status"] == "completed"
    assert row["illegal_events"] == 1
    assert row["last_seq"] == 7
    assert row["cached_tokens"] == 1


def test_kv_and_instance_folds() -> None:
    kv = proj.fold("kv:k", None, _seq(_kv_events()))
    assert kv is not None and kv["size_bytes"] == 12 and kv["tier"] == "ssd"
    assert proj.fold("kv:k", None, _seq(_kv_events()[:3])) is None  # removed
    inst = proj.fold("inst:p0", None, _seq(_instance_events()[:2]))
    assert inst is not None and inst["status"] == "down" and inst["down_reason"] == "killed"


def test_entities_and_tables() -> None:
    for entity, events in SEQUENCES.items():
        assert {proj.entity_of(e) for e in events} == {entity}
        proj.table_of(entity)
    assert proj.key_of("kv:a:b") == "a:b"


@given(st.sampled_from(sorted(SEQUENCES)), st.data())
def test_folding_in_two_steps_equals_folding_at_once(entity: str, data: st.DataObject) -> None:
    events = _seq(SEQUENCES[entity])
    cut = data.draw(st.integers(min_value=0, max_value=len(events)))
    once = proj.fold(entity, None, events)
    first = proj.fold(entity, None, events[:cut])
    rest = events[cut:]
    if first is not None or cut == 0:
        assert proj.fold(entity, first, rest) == once
    if rest:
        # The recorder folds on incrementally only when the log agrees with the row; a
        # row that vanished (a removed object) while the log holds its events does not.
        assert _continues(first, rest, logged=len(events)) == (first is not None or cut == 0)


def test_a_late_event_is_never_folded_incrementally() -> None:
    events = _seq(_request_events())
    row = proj.fold("req:r1", None, [events[0], events[2]])
    assert row is not None
    assert not _continues(row, [events[1]], logged=3)  # older than the row's last
    assert not _continues(row, [events[3]], logged=5)  # a gap: the log has more
    assert _continues(row, [events[3]], logged=3)
