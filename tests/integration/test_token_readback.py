"""The token read-back service against a real broker: a request's copy written by the real
`TokenStreamer`, read back through `client.read_back` (what the gateway uses), and refused to
anyone who did not submit the request. Also the gateway end to end over HTTP: a token its
live stream lost comes back from the copy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.client import Outcome, ReadBackRefused, read_back
from mooncake.config import Settings
from mooncake.gateway import GatewayOptions, NatsBackend, create_app
from mooncake.serving.streaming import TokenStreamer
from mooncake.serving.token_readback import TokenReadBack
from mooncake.work import (
    READ_BACK_MAX_CHUNKS,
    ReadBackAnswer,
    ReadBackAsk,
    TokenChunk,
    WorkSubjects,
)

pytestmark = pytest.mark.integration


@dataclass
class Rig:
    nc: NATS
    ns: ev.Namespace
    streamer: TokenStreamer
    service: TokenReadBack

    async def stream(
        self, rid: str, reply_to: str | None, n: int, *, lose: frozenset[int] = frozenset(),
        finish: bool = True,
    ) -> None:  # fmt: skip
        """Stream `n` tokens of `rid` as a decode worker does (tokens 100 + i, text "t<i>"),
        each live except those in `lose` (dropped on the way, as core NATS drops what is
        published while a client reconnects), then the final chunk."""
        self.streamer.open(rid, reply_to)
        for i in range(n):
            c = TokenChunk(request_id=rid, index=i, token_ids=[100 + i], text=f"t{i}")
            await self.streamer.emit(c, live=i not in lose)
        await self.streamer.flush_due(now=float("inf"))
        if finish:
            done = TokenChunk(request_id=rid, index=n, done=True, finish_reason="length")
            await self.streamer.close(done)


@pytest_asyncio.fixture
async def rig(settings: Settings) -> AsyncIterator[Rig]:
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    service = TokenReadBack(nc, js, ns)
    await service.start()
    try:
        yield Rig(nc, ns, TokenStreamer(nc, js, ns, instance="d0"), service)
    finally:
        await service.stop()
        await nc.close()


async def test_the_submitter_reads_back_what_it_missed(rig: Rig) -> None:
    inbox = rig.nc.new_inbox()
    await rig.stream("rb-1", inbox, 6)
    out = Outcome("rb-1", reply_to=inbox)
    for i in (0, 1, 3):  # what arrived live
        out.take({"request_id": "rb-1", "index": i, "token_ids": [100 + i], "text": f"t{i}"})
    await read_back(rig.nc, rig.ns, out, within_s=5)
    assert out.token_ids == [100, 101, 102, 103, 104, 105]
    assert out.text == "t0t1t2t3t4t5"
    assert out.finish_reason == "length" and out.final_index == 6 and out.missing() == []
    assert out.repaired == 3


async def test_a_long_copy_comes_back_in_several_answers(rig: Rig) -> None:
    inbox = rig.nc.new_inbox()
    n = READ_BACK_MAX_CHUNKS * 2 + 100
    await rig.stream("rb-long", inbox, n)
    out = Outcome("rb-long", reply_to=inbox)
    await read_back(rig.nc, rig.ns, out, within_s=10)
    assert out.token_ids == [100 + i for i in range(n)]
    assert out.finished and out.missing() == []


async def test_a_running_request_reads_back_what_is_stored_so_far(rig: Rig) -> None:
    inbox = rig.nc.new_inbox()
    await rig.stream("rb-running", inbox, 5, finish=False)
    out = Outcome("rb-running", reply_to=inbox)
    await read_back(rig.nc, rig.ns, out, within_s=5)
    assert out.token_ids == [100, 101, 102, 103, 104] and out.finish_reason is None


async def test_someone_elses_request_is_refused(rig: Rig) -> None:
    owner = rig.nc.new_inbox()
    await rig.stream("rb-theirs", owner, 3)
    # Not knowing the request's reply subject: refused, nothing read.
    mine = Outcome("rb-theirs", reply_to=rig.nc.new_inbox())
    with pytest.raises(ReadBackRefused, match="not submitted with this reply subject"):
        await read_back(rig.nc, rig.ns, mine, within_s=5)
    assert mine.tokens == {}
    # Knowing it, but asking for the answer at a subject under another prefix (a user who
    # learned another's inbox, and can read only its own): refused before anything is read.
    ask = ReadBackAsk(request_id="rb-theirs", reply_to=owner)
    other = "_INBOX_OTHER.x"
    sub = await rig.nc.subscribe(other)
    await rig.nc.publish(WorkSubjects(rig.ns).read_back(), ask.to_json(), reply=other)
    answer = ReadBackAnswer.model_validate_json((await sub.next_msg(timeout=5)).data)
    assert answer.chunks == [] and answer.error and "under" in answer.error
    # A request streamed without a reply subject has no owner: nobody reads it back here.
    await rig.stream("rb-nobody", None, 2)
    with pytest.raises(ReadBackRefused):
        await read_back(rig.nc, rig.ns, Outcome("rb-nobody", reply_to=owner), within_s=5)


async def test_an_unreadable_ask_is_answered_with_the_reason(rig: Rig) -> None:
    subject = WorkSubjects(rig.ns).read_back()
    for body in (b"not json", json.dumps({"request_id": "x", "reply_to": "a b"}).encode()):
        reply = await rig.nc.request(subject, body, timeout=5)
        answer = ReadBackAnswer.model_validate_json(reply.data)
        assert answer.error and answer.error.startswith("invalid ask") and not answer.retry


async def test_asks_over_the_limit_are_told_to_retry(settings: Settings) -> None:
    """With every read slot taken, an ask is answered `busy` at once (and `read_back`
    asks again until a slot frees)."""
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        service = TokenReadBack(nc, js, ns, limit=0)
        await service.start()
        try:
            ask = ReadBackAsk(request_id="busy", reply_to=nc.new_inbox())
            reply = await nc.request(WorkSubjects(ns).read_back(), ask.to_json(), timeout=5)
            answer = ReadBackAnswer.model_validate_json(reply.data)
            assert answer.retry and answer.error and answer.error.startswith("busy")
            with pytest.raises(ReadBackRefused, match="busy"):
                await read_back(nc, ns, Outcome("busy", reply_to=ask.reply_to), within_s=0.5)
        finally:
            await service.stop()
    finally:
        await nc.close()


async def test_the_gateway_answers_whole_when_its_live_stream_lost_tokens(
    rig: Rig, settings: Settings, tmp_path: Path
) -> None:
    """Over HTTP through the real gateway app and broker: the decision and tokens 1 and 2
    never reach the gateway live; the answer is whole, read back through the service."""
    backend = NatsBackend(rig.nc, Publisher(rig.nc, rig.nc.jetstream(), rig.ns), rig.ns)
    options = GatewayOptions.from_settings(settings)
    app = create_app(backend, options, None)
    submitted: list[ev.RequestSubmitted] = []

    async def decode(msg: nats.aio.msg.Msg) -> None:  # stands in for the whole pipeline
        event = ev.parse_event(msg.data, subject=rig.ns.canonical(msg.subject))
        assert isinstance(event, ev.RequestSubmitted) and event.reply_to
        submitted.append(event)
        await rig.stream(event.request_id, event.reply_to, 4, lose=frozenset({1, 2}))

    sub = await rig.nc.subscribe(rig.ns.of(ev.RequestSubmitted), cb=decode)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw"
        ) as http:
            resp = await http.post(
                "/v1/completions",
                json={"model": options.model_id, "prompt": [1, 2, 3], "max_tokens": 4},
            )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "t0t1t2t3"
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert len(submitted) == 1
        assert submitted[0].request_id == resp.headers["x-request-id"]
    finally:
        await sub.unsubscribe()
        await app.state.gateway.drain()
