"""Reading what a benchmark's requests became from the Postgres record (`events`,
`requests`). Shared by `bench overload` and `bench memory`.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

TERMINAL = ("request.completed", "request.failed", "request.cancelled", "request.rejected")
STAGES = ("request.submitted", "request.admitted", "request.prefill_started", "request.prefilled")
RECORDED = (*STAGES, *TERMINAL)
# request id -> its recorded decision and terminal events, in record order: (type, payload)
Record = dict[str, list[tuple[str, dict[str, Any]]]]


def libpq(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://) as psycopg takes it."""
    return "postgresql://" + url.split("://", 1)[1]


async def rows(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(libpq(database_url)) as conn:
        cur = await conn.execute(sql, params)
        return list(await cur.fetchall())


async def read_record(database_url: str, ids: list[str], within_s: float = 30.0) -> Record:
    """The admission and terminal events of `ids`, once every one of them has a terminal
    event recorded (or `within_s` has passed: then what there is)."""
    deadline = time.monotonic() + within_s
    while True:
        found = await rows(
            database_url,
            "SELECT request_id, type, payload FROM events "
            "WHERE request_id = ANY(%s) AND type = ANY(%s) ORDER BY id",
            ids, list(RECORDED),
        )  # fmt: skip
        record: Record = defaultdict(list)
        for rid, type_, payload in found:
            record[rid].append((type_, payload))
        ended = sum(1 for r in record.values() if any(t in TERMINAL for t, _ in r))
        if ended >= len(set(ids)) or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.5)


def terminals(record: Record, rid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(t, p) for t, p in record.get(rid, []) if t in TERMINAL]
