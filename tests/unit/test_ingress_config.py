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
    assert "max_tokens" in decision.event.detail
    # The same message redelivered yields the same event id (dedupe makes it exactly-once).
    again = ingress.judge(bad, msg_id="m1", now=now)
    assert isinstance(again, ingress.Reject) and again.event.event_id == decision.event.event_id
    unreadable = ev.InvalidEvent("invalid_request", "not json", None)
    assert isinstance(ingress.judge(unreadable, msg_id="m2", now=now), ingress.Discard)


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
