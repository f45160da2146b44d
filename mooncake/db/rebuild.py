"""Rebuild every projection from the `events` log, and compare rebuilt with live.

Both walk each entity's events in stream order through the same pure folds the recorder
uses (`mooncake.db.projections`), so a rebuild reproduces the live tables bit for bit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from mooncake import events as ev
from mooncake.db import projections as proj
from mooncake.db.record import EVENTS, TABLES, lock_for_rebuild

Rows = dict[str, dict[str, dict[str, Any]]]
INSERT_CHUNK = 2000


async def _entity_streams(conn: AsyncConnection) -> AsyncIterator[tuple[str, list[proj.SeqEvent]]]:
    result = await conn.stream(
        select(EVENTS.c.entity, EVENTS.c.stream_seq, EVENTS.c.payload)
        .order_by(EVENTS.c.entity, EVENTS.c.stream, EVENTS.c.stream_seq)
        .execution_options(yield_per=5000)
    )
    current: str | None = None
    items: list[proj.SeqEvent] = []
    async for entity, seq, payload in result:
        if entity != current:
            if current is not None:
                yield current, items
            current, items = entity, []
        items.append((seq, ev.event_from_payload(payload)))
    if current is not None:
        yield current, items


async def compute_projections(conn: AsyncConnection) -> Rows:
    """Every projection row, folded from the log (nothing is written)."""
    out: Rows = {name: {} for name in TABLES}
    async for entity, items in _entity_streams(conn):
        row = proj.fold(entity, None, items)
        if row is not None:
            out[proj.table_of(entity)][proj.key_of(entity)] = row
    return out


async def read_projections(conn: AsyncConnection) -> Rows:
    out: Rows = {}
    for name, table in TABLES.items():
        pk = next(iter(table.primary_key.columns)).name
        rows = await conn.execute(select(table))
        out[name] = {r._mapping[pk]: dict(r._mapping) for r in rows}
    return out


def diff_projections(live: Rows, rebuilt: Rows, limit: int = 20) -> list[str]:
    """Human-readable differences (empty when identical)."""
    diffs: list[str] = []
    for name in TABLES:
        a, b = live.get(name, {}), rebuilt.get(name, {})
        for key in sorted(a.keys() - b.keys())[:limit]:
            diffs.append(f"{name}[{key}]: live only")
        for key in sorted(b.keys() - a.keys())[:limit]:
            diffs.append(f"{name}[{key}]: rebuilt only")
        for key in sorted(a.keys() & b.keys()):
            if a[key] != b[key]:
                cols = [c for c in a[key] if a[key][c] != b[key].get(c)]
                diffs.append(
                    f"{name}[{key}]: "
                    + ", ".join(f"{c} live={a[key][c]!r} rebuilt={b[key].get(c)!r}" for c in cols)
                )
            if len(diffs) >= limit:
                return diffs
    return diffs


async def verify(engine: AsyncEngine) -> list[str]:
    """Compare the live projections with a rebuild, under a consistent snapshot."""
    async with engine.connect() as conn:
        await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        live = await read_projections(conn)
        rebuilt = await compute_projections(conn)
        await conn.rollback()
    return diff_projections(live, rebuilt)


async def rebuild(engine: AsyncEngine) -> dict[str, int]:
    """Drop every projection row and rebuild from `events`, atomically."""
    async with engine.begin() as conn:
        await lock_for_rebuild(conn)
        rebuilt = await compute_projections(conn)
        await conn.execute(text("TRUNCATE requests, kv_objects, instances"))
        for name, rows in rebuilt.items():
            values = list(rows.values())
            for start in range(0, len(values), INSERT_CHUNK):
                await conn.execute(TABLES[name].insert(), values[start : start + INSERT_CHUNK])
    return {name: len(rows) for name, rows in rebuilt.items()}
