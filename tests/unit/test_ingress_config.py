"""Ingress decisions, settings, and consumer backoff."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mooncake import events as ev
from mooncake.bus.consume import backoff_delay
from mooncake.config import BusSettings, Settings, normalise_database_url
from mooncake.core import ingress


def test_ingress_accepts_rejects_or_discards() -> None:
    now = ev.utcnow()
    good = ev.RequestSubmitted(request_id="r", prompt="p")
    assert ingress.judge(good, msg_id="m", now=now) == ingress.Accept(good)
    bad = ev.InvalidEvent("invalid_request", "params.max_tokens: too small", "r9")
    decision = ingress.judge(bad, msg_id="m1", now=now)
    assert isinstance(decision, ingress.Reject)
    assert decision.event.request_id == "r9"
    assert decision.event.reason is ev.RejectReason.INVALID_REQUEST
    assert decision.event.stage == "ingress"
    assert decision.event.detail == "params.max_tokens: too small"  # the reason not repeated
    assert decision.reply_to is None  # none was readable
    big = ev.InvalidEvent("payload_too_large", "2000000 bytes", "r8", "_INBOX.x")
    told = ingress.judge(big, msg_id="m3", now=now)
    assert isinstance(told, ingress.Reject) and told.reply_to == "_INBOX.x"
    assert told.event.detail == "payload_too_large: 2000000 bytes"
    # The same message redelivered yields the same event id (dedupe makes it exactly-once).
    again = ingress.judge(bad, msg_id="m1", now=now)
    assert isinstance(again, ingress.Reject) and again.event.event_id == decision.event.event_id
    unreadable = ev.InvalidEvent("invalid_request", "not json", None)
    assert isinstance(ingress.judge(unreadable, msg_id="m2", now=now), ingress.Discard)


@pytest.mark.parametrize("reply_to", ["mc.req.submitted", "mc.tokens.r2", "mc.store.remove"])
def test_a_reply_to_inside_the_system_is_rejected(reply_to: str) -> None:
    """The workers publish decisions and tokens to `reply_to`: naming one of the system's
    own subjects would make them publish there for the client."""
    req = ev.RequestSubmitted(request_id="r", prompt="p", reply_to=reply_to)
    reserved = ingress.reserved_reply_prefixes("mc")
    decision = ingress.judge(req, msg_id="m", now=ev.utcnow(), reserved=reserved)
    assert isinstance(decision, ingress.Reject), decision
    assert decision.event.reason is ev.RejectReason.INVALID_REQUEST
    assert "reply_to" in decision.event.detail and decision.event.request_id == "r"
    inbox = req.model_copy(update={"reply_to": "_INBOX.abc"})
    assert ingress.judge(inbox, msg_id="m", now=ev.utcnow(), reserved=reserved) == (
        ingress.Accept(inbox)
    )
    # Another namespace's subjects are not this one's.
    other = ingress.reserved_reply_prefixes("prod")
    assert ingress.judge(inbox, msg_id="m", now=ev.utcnow(), reserved=other) == (
        ingress.Accept(inbox)
    )


@pytest.mark.parametrize(
    "reply_to", ["mc.req.>", "_INBOX.*", "a..b", ".a", "a.", "a b", "$JS.API.STREAM.DELETE.X"]
)
def test_a_reply_to_must_be_a_literal_subject(reply_to: str) -> None:
    with pytest.raises(ValidationError, match="reply_to"):
        ev.RequestSubmitted(request_id="r", prompt="p", reply_to=reply_to)


def test_settings_from_environment_with_nested_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_NAMESPACE", "alpha")
    monkeypatch.setenv("MOONCAKE_SLO__TTFT_S", "10")
    monkeypatch.setenv("MOONCAKE_DATABASE_URL", "postgresql://u@h:5/db")
    s = Settings()
    assert s.namespace == "alpha"
    assert s.slo.ttft_s == 10.0
    assert s.database_url == "postgresql+psycopg://u@h:5/db"


def test_bad_settings_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_BLOCK_TOKENS", "3")
    with pytest.raises(ValidationError, match="block_tokens"):
        Settings()
    monkeypatch.delenv("MOONCAKE_BLOCK_TOKENS")
    with pytest.raises(ValidationError, match="namespace"):
        Settings(namespace="Has.Dots")


def test_database_url_normalisation() -> None:
    assert normalise_database_url("postgres://a@b/c") == "postgresql+psycopg://a@b/c"
    assert normalise_database_url("postgresql+psycopg://a@b/c") == "postgresql+psycopg://a@b/c"


def test_backoff_grows_and_is_capped() -> None:
    bus = BusSettings(nak_base_delay_s=0.1, nak_max_delay_s=1.0)
    delays = [backoff_delay(n, bus) for n in range(1, 10)]
    assert delays == sorted(delays)
    assert delays[0] == pytest.approx(0.1)
    assert max(delays) == 1.0


def test_unexported_spans_are_not_recorded_but_context_still_propagates() -> None:
    """Sampling: with nowhere to export, spans are non-recording yet carry fresh ids, so
    a hop's traceparent still names its own span; a sampled parent is honoured."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased

    from mooncake import telemetry

    root = telemetry._RootSampler(1.0, enabled=False)
    tracer = TracerProvider(sampler=ParentBased(root)).get_tracer("t")
    with tracer.start_as_current_span("a") as a:
        assert not a.is_recording()
        carrier: dict[str, str] = {}
        telemetry.inject_headers(carrier)
        assert format(a.get_span_context().span_id, "016x") in carrier["traceparent"]
        assert int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # not sampled
    sampled_parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    ctx = telemetry.extract_context(sampled_parent)
    with tracer.start_as_current_span("child", context=ctx) as child:
        assert child.is_recording()
    root.enabled = True
    with tracer.start_as_current_span("b") as b:
        assert b.is_recording()
