"""The replayable token copy survives a broker that fails for a while, keeps index order, and
says so when it gives up (pure: a fake bus)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mooncake import events as ev
from mooncake.namespace import Namespace
from mooncake.serving.streaming import TokenBatch, TokenStreamer
from mooncake.work import TokenChunk

NS = Namespace("t")


class FlakyJetStream:
    """Fails the first `failures` publishes to the token copy (or all, with -1); holds each
    publish until `gate` is set when one is given."""

    def __init__(self, failures: int, gate: asyncio.Event | None = None) -> None:
        self.failures = failures
        self.gate = gate
        self.stored: list[list[int]] = []  # the indexes of each stored batch, in store order
        self.events: list[ev.Event] = []

    async def publish(self, subject: str, payload: bytes, **_: Any) -> None:
        if subject.startswith(NS.subject("mc.req.")):
            self.events.append(ev.parse_event(payload))
            return
        if self.gate is not None:
            await self.gate.wait()
        if self.failures != 0:
            self.failures -= 1
            raise TimeoutError("no leader")
        self.stored.append([c.index for c in TokenBatch.model_validate_json(payload).chunks])


class Core:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append(json.loads(payload))


def chunk(i: int, done: bool = False) -> TokenChunk:
    return TokenChunk(request_id="r", index=i, token_ids=[] if done else [7], done=done)


def streamer(js: FlakyJetStream, core: Core | None = None, **kw: Any) -> TokenStreamer:
    kw = {"flush_s": 60.0, "flush_tokens": 1000} | kw
    return TokenStreamer(core or Core(), js, NS, instance="d0", **kw)  # type: ignore[arg-type]


async def test_a_failed_batch_is_sent_again_with_what_follows() -> None:
    js = FlakyJetStream(failures=1)
    s = streamer(js, flush_s=0.0)
    s.open("r", "_INBOX.x")
    await s.emit(chunk(1))
    await s.flush_due()  # fails: kept
    assert js.stored == []
    await s.emit(chunk(2))
    await s.flush_due()
    assert js.stored == [[1, 2]]


async def test_the_final_batch_is_retried_through_a_failover_until_stored() -> None:
    # Four refusals in a row (the old streamer tried three times, then dropped the batch).
    js = FlakyJetStream(failures=4)
    s = streamer(js)
    s.open("r", None)
    await s.emit(chunk(1))
    await s.close(chunk(2, done=True))
    assert js.stored == [[1, 2]]
    assert js.events == []


async def test_the_final_batch_waits_for_a_batch_in_flight_and_carries_it_if_it_failed() -> None:
    """A flush in flight when the request ends: its batch fails (the broker is failing over)
    and the final batch must not be stored ahead of it or without it."""
    gate = asyncio.Event()
    js = FlakyJetStream(failures=1, gate=gate)
    s = streamer(js, flush_s=0.0)
    s.open("r", None)
    await s.emit(chunk(1))
    await s.emit(chunk(2))
    flushing = asyncio.create_task(s.flush_due())
    await asyncio.sleep(0)  # the flush holds [1, 2] in flight
    closing = asyncio.create_task(s.close(chunk(3, done=True)))
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(flushing, closing)
    assert js.stored == [[1, 2, 3]]


async def test_a_copy_given_up_is_recorded_and_told_to_the_client() -> None:
    js = FlakyJetStream(failures=-1)  # the copy never lands
    core = Core()
    s = streamer(js, core, give_up_s=0.3)
    s.open("r", "_INBOX.x")
    await s.emit(chunk(1))
    await s.close(chunk(2, done=True))
    assert js.stored == []
    (fact,) = js.events
    assert isinstance(fact, ev.TokensNotStored)
    assert (fact.request_id, fact.first_index, fact.last_index) == ("r", 1, 2)
    assert "no leader" in fact.detail
    told = [m for m in core.sent if m.get("type") == "request.tokens_not_stored"]
    assert [(m["first_index"], m["last_index"]) for m in told] == [(1, 2)]
