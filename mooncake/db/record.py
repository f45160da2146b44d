"""Recording a batch of events: insert into `events` and update projections, one transaction.

Exactly-once effect: the insert is `ON CONFLICT (event_id) DO NOTHING ... RETURNING`, and
only the events that were really inserted are folded into the projections, in the same
transaction (an id reused for another entity is recorded under a derived id:
`record_events`). A redelivered batch (recorder killed before its acks) inserts nothing new and
changes nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, String, Table, any_, bindparam, func, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from mooncake import events as ev
from mooncake.core.lifecycle import TERMINAL, Status
from mooncake.db import projections as proj
from mooncake.db.models import DeadLetterRow, EventRow, InstanceRow, KvObjectRow, RequestRow

EVENTS: Table = EventRow.__table__  # type: ignore[assignment]
DEAD_LETTERS: Table = DeadLetterRow.__table__  # type: ignore[assignment]
TABLES: dict[str, Table] = {
    "requests": RequestRow.__table__,  # type: ignore[dict-item]
    "kv_objects": KvObjectRow.__table__,  # type: ignore[dict-item]
    "instances": InstanceRow.__table__,  # type: ignore[dict-item]
}
DLQ_PAYLOAD_LIMIT = 64 * 1024
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Incoming:
    """An event as it arrived: its place in the stream orders it in the projections."""

    event: ev.Event
    stream: str
    seq: int
    subject: str


@dataclass(frozen=True, slots=True)
class RecordResult:
    inserted: int
    duplicates: int
    illegal: int
    # `requests` rows this batch moved into a terminal state: each request's end appears
    # in exactly one committed batch (the per-tenant metrics count it there).
    ended: tuple[proj.Row, ...] = ()


# Multi-row statements send one array per column, in binary (no per-element quoting), and
# `unnest` them on the server: the SQL text stays small and constant (the driver and the
# server parse and plan it once) however many rows a batch has. Strings travel as text[],
# so the column's own length check applies on insert.
_PG = postgresql.dialect()  # type: ignore[no-untyped-call]
EVENT_COLUMNS = (
    "event_id", "type", "entity", "request_id", "stream", "stream_seq", "subject",
    "occurred_at", "schema_version", "traceparent", "payload",
)  # fmt: skip


def _array_type(col: Column[Any]) -> str:
    if isinstance(col.type, String):
        return "text[]"
    return f"{col.type.compile(dialect=_PG)}[]"


@functools.cache
def _unnest_insert(table_name: str, columns: tuple[str, ...], tail: str) -> str:
    """Driver-level SQL (psycopg `%(name)b` binary parameters, one array per column)."""
    table = EVENTS if table_name == EVENTS.name else TABLES[table_name]
    arrays = ", ".join(f"CAST(%({c})b AS {_array_type(table.c[c])})" for c in columns)
    names = ", ".join(f'"{c}"' for c in columns)
    return (
        f"INSERT INTO {table_name} ({names}) "
        f"SELECT {names} FROM unnest({arrays}) WITH ORDINALITY AS t({names}, n) "
        f"ORDER BY n {tail}"
    )


def _columns_of(
    rows: Sequence[dict[str, Any]],
    table: Table,
    columns: Sequence[str],
    json_text: frozenset[str] = frozenset(),
) -> dict[str, list[Any]]:
    """Rows -> one list per column. JSONB values are serialised here (None becomes JSON
    null, as SQLAlchemy's JSONB type does), except the columns in `json_text`, which hold
    JSON text already."""
    out: dict[str, list[Any]] = {}
    for c in columns:
        values = [r[c] for r in rows]
        if isinstance(table.c[c].type, JSONB) and c not in json_text:
            values = [json.dumps(v) for v in values]
        out[c] = values
    return out


def _event_row(i: Incoming) -> dict[str, object]:
    e = i.event
    return {
        "event_id": e.event_id,
        "type": e.type,
        "entity": proj.entity_of(e),
        "request_id": getattr(e, "request_id", None),
        "stream": i.stream,
        "stream_seq": i.seq,
        "subject": i.subject,
        "occurred_at": e.occurred_at,
        "schema_version": e.schema_version,
        "traceparent": e.traceparent,
        # The JSON text of model_dump(mode="json", exclude_none=True), serialised once.
        "payload": e.model_dump_json(exclude_none=True),
    }


def _any(column: Column[Any], values: list[str]) -> Any:
    """`column = ANY(:array)`: one parameter, not one per value."""
    return column == any_(bindparam(None, values, type_=ARRAY(String), expanding=False))


async def record_events(conn: AsyncConnection, batch: Sequence[Incoming]) -> RecordResult:
    """Insert the batch into `events` and fold what was new into the projections.

    An event id identifies an event *of one entity*: a message whose id is already recorded
    for the same entity is a duplicate (a redelivery, a client's retry) and changes nothing.
    One whose id is recorded for another entity (two requests whose client reused an event
    id) is a different fact, recorded under an id derived from its stream place
    (`reused_event_id`), so a redelivery of it is still a duplicate.

    Must run inside a transaction (the caller commits, then acks the messages).
    """
    unique: dict[tuple[str, str], Incoming] = {}
    for item in batch:
        unique.setdefault((item.event.event_id, _entity(item)), item)
    if not unique:
        return RecordResult(0, len(batch), 0)
    first: dict[str, Incoming] = {}
    for item in unique.values():
        first.setdefault(item.event.event_id, item)
    new = await _insert_events(conn, list(first.values()))
    recorded = {id(i) for i in new}
    missed = [i for i in unique.values() if id(i) not in recorded]
    if missed:  # rare: redeliveries, retries, reused ids
        owners = await _entities_of(conn, [i.event.event_id for i in missed])
        reused: dict[int, tuple[str, Incoming]] = {}  # id(re-keyed item) -> (its old id, it)
        for i in missed:
            if owners.get(i.event.event_id) != _entity(i):
                r = _reused(i)
                reused[id(r)] = (i.event.event_id, r)
        if reused:
            for r in await _insert_events(conn, [r for _, r in reused.values()]):
                log.warning(  # only when recorded: a redelivery of it is a plain duplicate
                    "event id %s of %s (%s seq %d) is recorded for another entity; its own: %s",
                    reused[id(r)][0], _entity(r), r.stream, r.seq, r.event.event_id,
                )  # fmt: skip
                new.append(r)
    illegal, ended = await _update_projections(conn, new)
    return RecordResult(len(new), len(batch) - len(new), illegal, tuple(ended))


# A JSON escape of U+0000 (not an escaped backslash followed by "u0000").
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
NUL_ON_THE_WIRE = b"\\u0000"  # how U+0000 appears in any JSON text (it must be escaped)


def storable(event: ev.Event) -> ev.Event:
    """The event as Postgres can keep it: U+0000, which neither `jsonb` nor `text` can hold,
    replaced by U+FFFD (the replacement character) in every string and key. A client may
    send one (a stop string), and a rejection may quote it back; without this, the event
    could not be recorded at all. Other events are returned as they are."""
    text = event.model_dump_json()
    clean = _NUL_ESCAPE.sub(r"\1\\ufffd", text)
    if clean == text:
        return event
    try:
        kept = type(event).model_validate_json(clean)
    except ValueError:  # a field that refuses U+FFFD: leave it to fail (and be dead-lettered)
        log.exception("%s %s holds U+0000 and cannot be recorded", event.type, event.event_id)
        return event
    log.warning("%s %s: U+0000 recorded as U+FFFD", event.type, event.event_id)
    return kept


def reused_event_id(event_id: str, stream: str, seq: int) -> str:
    """The id a reused event id is recorded under (deterministic: a redelivery of the same
    stream message maps to the same id)."""
    return ev.derived_event_id(event_id, f"reused:{stream}:{seq}")


def _entity(i: Incoming) -> str:
    return proj.entity_of(i.event)


def _reused(i: Incoming) -> Incoming:
    new_id = reused_event_id(i.event.event_id, i.stream, i.seq)
    return Incoming(i.event.model_copy(update={"event_id": new_id}), i.stream, i.seq, i.subject)


async def _insert_events(conn: AsyncConnection, items: list[Incoming]) -> list[Incoming]:
    """Insert; the items that were new (not already recorded under their id)."""
    stmt = _unnest_insert(
        EVENTS.name, EVENT_COLUMNS, "ON CONFLICT (event_id) DO NOTHING RETURNING event_id"
    )
    rows = [_event_row(i) for i in items]
    params = _columns_of(rows, EVENTS, EVENT_COLUMNS, json_text=frozenset({"payload"}))
    result = await conn.exec_driver_sql(stmt, params)
    inserted_ids = set(result.scalars())
    return [i for i in items if i.event.event_id in inserted_ids]


async def _entities_of(conn: AsyncConnection, event_ids: list[str]) -> dict[str, str]:
    rows = await conn.execute(
        select(EVENTS.c.event_id, EVENTS.c.entity).where(_any(EVENTS.c.event_id, event_ids))
    )
    return {event_id: entity for event_id, entity in rows}


async def _update_projections(
    conn: AsyncConnection, new: list[Incoming]
) -> tuple[int, list[proj.Row]]:
    """Fold the new events into their rows: the illegal transitions, and the requests
    that ended here."""
    by_entity: dict[str, list[proj.SeqEvent]] = defaultdict(list)
    for i in new:
        by_entity[proj.entity_of(i.event)].append((i.seq, i.event))
    by_table: dict[str, list[str]] = defaultdict(list)
    for entity in by_entity:
        by_table[proj.table_of(entity)].append(entity)
    logged = await _logged_counts(conn, list(by_entity))
    illegal, ended = 0, []
    for table_name in sorted(by_table):  # a fixed lock order across transactions
        entities = sorted(by_table[table_name])
        table = TABLES[table_name]
        existing = await _lock_rows(conn, table, [proj.key_of(e) for e in entities])
        upserts, deletes = [], []
        for entity in entities:
            key = proj.key_of(entity)
            items = sorted(by_entity[entity], key=lambda se: se[0])
            old = existing.get(key)
            if _continues(old, items, logged[entity]):
                new_row = proj.fold(entity, old, items)
            else:
                # A late or orphaned fact: fold this entity again, from the log, in order.
                new_row = proj.fold(entity, None, await load_entity_events(conn, entity))
            if table_name == "requests":
                before = old["illegal_events"] if old else 0
                illegal += (new_row["illegal_events"] if new_row else len(items)) - before
                if new_row is not None and _terminal(new_row) and not _terminal(old):
                    ended.append(new_row)
            if new_row is None:
                if old is not None:
                    deletes.append(key)
            else:
                upserts.append(new_row)
        await _write(conn, table, upserts, deletes)
    return illegal, ended


def _terminal(row: proj.Row | None) -> bool:
    return row is not None and Status(row["status"]) in TERMINAL


def _continues(old: dict | None, items: list[proj.SeqEvent], logged: int) -> bool:  # type: ignore[type-arg]
    """True when the new events simply extend what the row has folded: the log holds
    exactly the row's events plus these, and all of these come after the row's last."""
    if old is None:
        return logged == len(items)
    return bool(logged == old["folded_events"] + len(items) and items[0][0] > old["last_seq"])


async def _logged_counts(conn: AsyncConnection, entities: list[str]) -> dict[str, int]:
    rows = await conn.execute(
        select(EVENTS.c.entity, func.count())
        .where(_any(EVENTS.c.entity, entities))
        .group_by(EVENTS.c.entity)
    )
    return {entity: int(n) for entity, n in rows}


async def _lock_rows(conn: AsyncConnection, table: Table, keys: list[str]) -> dict[str, dict]:  # type: ignore[type-arg]
    pk = next(iter(table.primary_key.columns))
    rows = await conn.execute(select(table).where(_any(pk, keys)).with_for_update())
    return {r._mapping[pk.name]: dict(r._mapping) for r in rows}


async def load_entity_events(conn: AsyncConnection, entity: str) -> list[proj.SeqEvent]:
    rows = await conn.execute(
        select(EVENTS.c.stream_seq, EVENTS.c.payload)
        .where(EVENTS.c.entity == entity)
        .order_by(EVENTS.c.stream, EVENTS.c.stream_seq)
    )
    return [(seq, ev.event_from_payload(payload)) for seq, payload in rows]


async def _write(
    conn: AsyncConnection,
    table: Table,
    upserts: list[dict[str, Any]],
    deletes: list[str],
) -> None:
    pk = next(iter(table.primary_key.columns))
    if upserts:
        columns = tuple(c.name for c in table.columns)
        updates = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in columns if c != pk.name)
        stmt = _unnest_insert(
            table.name, columns, f"ON CONFLICT ({pk.name}) DO UPDATE SET {updates}"
        )
        await conn.exec_driver_sql(stmt, _columns_of(upserts, table, columns))
    if deletes:
        await conn.execute(table.delete().where(_any(pk, deletes)))


@dataclass(frozen=True, slots=True)
class DeadLetterIn:
    dlq_id: str
    consumer: str
    stream: str
    stream_seq: int
    subject: str
    reason: str
    detail: str
    payload: bytes


async def record_dead_letters(conn: AsyncConnection, items: Sequence[DeadLetterIn]) -> int:
    if not items:
        return 0
    rows = [
        {
            "dlq_id": d.dlq_id,
            "consumer": d.consumer,
            "stream": d.stream,
            "stream_seq": d.stream_seq,
            "subject": d.subject,
            "reason": d.reason,
            "detail": d.detail,
            "payload": d.payload[:DLQ_PAYLOAD_LIMIT],
            "payload_size": len(d.payload),
            "payload_sha256": hashlib.sha256(d.payload).hexdigest(),
        }
        for d in items
    ]
    stmt = pg_insert(DEAD_LETTERS).on_conflict_do_nothing(index_elements=["dlq_id"])
    result = await conn.execute(stmt.returning(DEAD_LETTERS.c.id), rows)
    return len(result.all())


async def lock_for_rebuild(conn: AsyncConnection) -> None:
    """Block new recordings (SHARE on events), then take the projections exclusively.

    The recorder takes events before projections too, so the two never deadlock.
    """
    await conn.execute(text("LOCK TABLE events IN SHARE MODE"))
    await conn.execute(text("LOCK TABLE requests, kv_objects, instances IN ACCESS EXCLUSIVE MODE"))
