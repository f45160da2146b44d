"""The replayable token copy survives a broker that fails for a while (pure: fake bus)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake.namespace import Namespace
from mooncake.serving import streaming
from mooncake.serving.streaming import TokenBatch, TokenStreamer
from mooncake.work import TokenChunk


class FlakyJetStream:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.stored: list[list[int]] = []  # the indexes of each stored batch

    async def publish(self, subject: str, payload: bytes, **_: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise TimeoutError("no leader")
        self.stored.append([c.index for c in TokenBatch.model_validate_json(payload).chunks])


class Core:
    async def publish(self, subject: str, payload: bytes) -> None:
        pass


def chunk(i: int, done: bool = False) -> TokenChunk:
    return TokenChunk(request_id="r", index=i, token_ids=[] if done else [7], done=done)


async def test_a_failed_batch_is_sent_again_with_what_follows() -> None:
    js = FlakyJetStream(failures=1)
    s = TokenStreamer(Core(), js, Namespace("t"), flush_s=0.0, flush_tokens=1000)  # type: ignore[arg-type]
    s.open("r", "_INBOX.x")
    await s.emit(chunk(1))
    await s.flush_due()  # fails: kept
    assert js.stored == []
    await s.emit(chunk(2))
    await s.flush_due()
    assert js.stored == [[1, 2]]


async def test_the_final_batch_is_retried_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "FINAL_RETRY_DELAYS_S", (0.0, 0.0))
    js = FlakyJetStream(failures=2)
    s = TokenStreamer(Core(), js, Namespace("t"), flush_s=60.0, flush_tokens=1000)  # type: ignore[arg-type]
    s.open("r", None)
    await s.emit(chunk(1))
    await s.close(chunk(2, done=True))
    assert js.stored == [[1, 2]]  # third attempt

    js = FlakyJetStream(failures=5)
    s = TokenStreamer(Core(), js, Namespace("t"), flush_s=60.0, flush_tokens=1000)  # type: ignore[arg-type]
    s.open("r", None)
    await s.close(chunk(1, done=True))
    assert js.stored == [] and js.failures == 2  # three tries, then the warning
