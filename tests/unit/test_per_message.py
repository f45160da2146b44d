"""`per_message`: a failing handler's message is retried, never a dead consumer; a broker
outage (the transient bus errors) is one warning line, any other failure a traceback."""

from __future__ import annotations

import logging

import nats.errors
import pytest
from nats.aio.msg import Msg

from mooncake.bus.consume import Delivery, Outcome, Retry, per_message


def delivery(seq: int) -> Delivery:
    reply = f"$JS.ACK.MC_REQ.c.1.{seq}.{seq}.1700000000000000000.0"
    return Delivery(Msg(None, subject="mc.req.submitted", reply=reply, data=b"{}"))  # type: ignore[arg-type]


async def test_a_broker_outage_is_a_retry_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(d: Delivery) -> Outcome:
        if d.stream_seq == 1:
            raise nats.errors.TimeoutError
        raise ValueError("a bug")

    with caplog.at_level(logging.WARNING, logger="mooncake.bus.consume"):
        outcomes = await per_message(handler, "t")([delivery(1), delivery(2)])
    assert [type(o) for o in outcomes] == [Retry, Retry]
    outage, bug = caplog.records
    assert outage.levelno == logging.WARNING and outage.exc_info is None
    assert "bus unavailable" in outage.getMessage() and "seq 1" in outage.getMessage()
    assert bug.levelno == logging.ERROR and bug.exc_info is not None  # a real failure: traced
