"""A corpus of bad messages on the public subject never crashes a consumer: each becomes a
`request.rejected` (reason invalid_request) when its request id can be read, or a dead
letter otherwise, and the next good message is processed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.services import EmbeddedNats
from mooncake.work import LoadReport, WorkSubjects

from helpers import Worker, scalar, wait_for

pytestmark = pytest.mark.integration


def _submitted(**fields: object) -> bytes:
    return json.dumps({"type": "request.submitted", **fields}).encode()


READABLE = {  # request id -> payload
    "bad-type": b'{"type":"request.exploded","request_id":"bad-type"}',
    "bad-missing": _submitted(request_id="bad-missing"),
    "bad-wrong-type": _submitted(request_id="bad-wrong-type", prompt=42),
    "bad-negative": _submitted(request_id="bad-negative", prompt="hi", params={"max_tokens": -3}),
    "bad-extra": _submitted(request_id="bad-extra", prompt="hi", evil=True),
    "bad-huge": _submitted(request_id="bad-huge", prompt="x" * (2 * 1024 * 1024)),
}
UNREADABLE = [
    b"not json",
    b"\x00\xff\xfe binary",
    b'{"type":"request.submitted","prompt":"no id"}',
    b"[1,2,3]",
    b"",
]


async def test_bad_corpus_is_rejected_or_dead_lettered_and_work_goes_on(
    own_nats: EmbeddedNats, settings: Settings, engine: AsyncEngine, tmp_path: Path
) -> None:
    # Our own broker: it allows 8 MiB payloads, so the 2 MB message reaches the consumers.
    settings = Settings(**{**settings.model_dump(), "nats_url": own_nats.url})
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    workers = [Worker(r, settings, tmp_path).start() for r in ("recorder", "conductor")]

    async def instances() -> None:  # a prefill and a decode instance, as load reports
        subjects = WorkSubjects(ns)
        for seq in range(1, 1_000_000):
            for iid, role in (("p0", "prefill"), ("d0", "decode")):
                r = LoadReport(instance=iid, role=role, node=iid, seq=seq, at=time.time())
                await nc.publish(subjects.load(iid), r.to_json())
            await asyncio.sleep(0.2)

    reporting = asyncio.create_task(instances())
    try:
        subject = ns.of(ev.RequestSubmitted)
        for payload in [*READABLE.values(), *UNREADABLE]:
            await js.publish(subject, payload)
        good = ev.RequestSubmitted(request_id="good-after", prompt="still serving?")
        await Publisher(nc, js, ns).publish(good)

        async def good_admitted() -> bool:
            status = await scalar(
                engine,
                "SELECT coalesce(max(status), '') FROM requests WHERE request_id = 'good-after'",
            )
            return status == "admitted"

        await wait_for(good_admitted, 60, "the good request to be admitted")

        async def all_rejected() -> bool:
            n = await scalar(
                engine,
                "SELECT count(*) FROM requests WHERE status='rejected' "
                "AND reject_reason='invalid_request' AND request_id = ANY(:ids)",
                ids=list(READABLE),
            )
            return n == len(READABLE)

        await wait_for(all_rejected, 30, "every readable bad request to be rejected")

        async def dead_lettered() -> bool:
            n = await scalar(engine, "SELECT count(*) FROM dead_letters WHERE consumer='conductor'")
            return n == len(UNREADABLE)

        await wait_for(dead_lettered, 30, "every unreadable message to be dead-lettered")
        assert all(w.proc is not None and w.proc.poll() is None for w in workers), "a crash"
    finally:
        reporting.cancel()
        codes = [w.stop() for w in workers]
        await nc.close()
    assert codes == [0, 0]
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT reason, payload_size FROM dead_letters WHERE consumer='conductor'")
            )
        ).all()
    assert {r.reason for r in rows} == {"invalid_request"}
    assert sorted(r.payload_size for r in rows) == sorted(len(p) for p in UNREADABLE)
    huge = await scalar(
        engine, "SELECT payload->>'detail' FROM events WHERE request_id='bad-huge' "
        "AND type='request.rejected'"
    )  # fmt: skip
    assert "payload_too_large" in str(huge)
