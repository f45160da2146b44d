"""Pure projection folds: (row | None, events in stream order) -> row | None.

The recorder applies them incrementally and `db rebuild` applies them from scratch; both
walk an entity's events in stream-sequence order, which is why the two always agree.
Rows are plain dicts with exactly the columns of the projection tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from mooncake import events as ev
from mooncake.core import lifecycle
from mooncake.core.lifecycle import RequestState, Status

Row = dict[str, Any]
SeqEvent = tuple[int, ev.Event]

REQ, KV, INST = "req:", "kv:", "inst:"
_STATE_FIELDS = tuple(f.name for f in fields(RequestState))


def entity_of(event: ev.Event) -> str:
    """The projection row an event folds into."""
    match event:
        case ev.RequestEvent():
            return REQ + event.request_id
        case ev.KvObjectStored() | ev.KvObjectRemoved():
            return KV + event.key
        case ev.InstanceRegistered() | ev.InstanceDeregistered():
            return INST + event.instance_id
    raise ValueError(f"event type {event.type} has no projection")  # pragma: no cover


def table_of(entity: str) -> str:
    if entity.startswith(REQ):
        return "requests"
    if entity.startswith(KV):
        return "kv_objects"
    if entity.startswith(INST):
        return "instances"
    raise ValueError(f"unknown entity {entity!r}")


def key_of(entity: str) -> str:
    return entity.split(":", 1)[1]


def fold(entity: str, row: Row | None, events: Iterable[SeqEvent]) -> Row | None:
    """Fold events (in stream order) into a row; `folded_events` counts every event folded,
    applied or not, so the recorder can tell whether a row has seen the whole log."""
    items = list(events)
    base = row["folded_events"] if row else 0
    if entity.startswith(REQ):
        out = _fold_request(row, items)
    else:
        apply_one = _apply_kv if entity.startswith(KV) else _apply_instance
        out = row
        for seq, e in items:
            out = apply_one(out, seq, e)
    if out is not None:
        out = {**out, "folded_events": base + len(items)}
    return out


# --- requests ---------------------------------------------------------------------------------


def _fold_request(row: Row | None, events: Iterable[SeqEvent]) -> Row | None:
    state = _state_from_row(row)
    illegal = row["illegal_events"] if row else 0
    last_seq = row["last_seq"] if row else 0
    for seq, e in events:
        assert isinstance(e, ev.RequestEvent)
        t = lifecycle.apply(state, e)
        if t.error:
            illegal += 1
        state = t.state
        last_seq = max(last_seq, seq)
    if state is None:
        # Only illegal events so far (e.g. a late event for a request never submitted):
        # keep no row; the events table still holds the facts.
        return None
    # Shallow (asdict deep-copies every value); the state's fields are all immutable scalars.
    out = {name: getattr(state, name) for name in _STATE_FIELDS}
    out["status"] = state.status.value
    out["illegal_events"] = illegal
    out["last_seq"] = last_seq
    return out


def _state_from_row(row: Row | None) -> RequestState | None:
    if row is None:
        return None
    values = {k: row[k] for k in _STATE_FIELDS}
    values["status"] = Status(values["status"])
    return RequestState(**values)


# --- kv_objects ------------------------------------------------------------------------------


def _apply_kv(row: Row | None, seq: int, e: ev.Event) -> Row | None:
    match e:
        case ev.KvObjectStored():
            replicas = [r.model_dump() for r in e.replicas]
            return {
                "key": e.key,
                "size_bytes": e.size_bytes,
                "replicas": replicas,
                "tier": replicas[0]["tier"] if replicas else "dram",
                "pin": e.pin,
                "stored_at": row["stored_at"] if row else e.occurred_at,
                "updated_at": e.occurred_at,
                "last_event_id": e.event_id,
                "last_seq": seq,
            }
        case ev.KvObjectRemoved():
            return None
    return row


# --- instances -------------------------------------------------------------------------------


def _apply_instance(row: Row | None, seq: int, e: ev.Event) -> Row | None:
    match e:
        case ev.InstanceRegistered():
            return {
                "instance_id": e.instance_id,
                "role": e.role,
                "host": e.host,
                "endpoint": e.endpoint,
                "capacity": dict(e.capacity),
                "status": "up",
                "registered_at": e.occurred_at,
                "updated_at": e.occurred_at,
                "down_reason": None,
                "last_event_id": e.event_id,
                "last_seq": seq,
            }
        case ev.InstanceDeregistered() if row is not None:
            return {
                **row,
                "status": "down",
                "down_reason": e.reason,
                "updated_at": e.occurred_at,
                "last_event_id": e.event_id,
                "last_seq": seq,
            }
    return row
