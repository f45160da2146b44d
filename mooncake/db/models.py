"""SQLAlchemy models: the append-only `events` log, its projections, and dead letters.

The migrations in `migrations/` are generated from and checked against these models
(`mooncake db check` runs `alembic check`, and the test suite runs it too).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class EventRow(Base):
    """Every lifecycle and metadata fact, exactly once (unique event id), never updated."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(128), unique=True)
    type: Mapped[str] = mapped_column(String(64))
    # The projection row this event folds into: "req:<id>", "kv:<key>", "inst:<id>".
    entity: Mapped[str] = mapped_column(String(300))
    request_id: Mapped[str | None] = mapped_column(String(128), index=True)
    stream: Mapped[str] = mapped_column(String(64))
    stream_seq: Mapped[int] = mapped_column(BigInteger)
    subject: Mapped[str] = mapped_column(String(256))
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    schema_version: Mapped[int] = mapped_column(Integer)
    traceparent: Mapped[str | None] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)

    __table_args__ = (
        Index("ix_events_entity_seq", "entity", "stream", "stream_seq"),
        Index("ix_events_type_occurred", "type", "occurred_at"),
    )


class RequestRow(Base):
    """Projection: one row per request, the fold of its lifecycle events."""

    __tablename__ = "requests"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    submitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    slo_class: Mapped[str | None] = mapped_column(String(64))
    client_id: Mapped[str | None] = mapped_column(String(64))
    tenant: Mapped[str | None] = mapped_column(String(64), index=True)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    policy: Mapped[str | None] = mapped_column(String(32))
    prefill_instance: Mapped[str | None] = mapped_column(String(64))
    decode_instance: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    remote_cached_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    prefill_attempts: Mapped[int] = mapped_column(Integer)
    decode_attempts: Mapped[int] = mapped_column(Integer)
    preemptions: Mapped[int] = mapped_column(Integer, server_default="0")
    predicted_ttft_s: Mapped[float | None] = mapped_column(Float)
    predicted_tbt_s: Mapped[float | None] = mapped_column(Float)
    prefill_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tbt_s: Mapped[float | None] = mapped_column(Float)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    reject_reason: Mapped[str | None] = mapped_column(String(32))
    failure_reason: Mapped[str | None] = mapped_column(String(64))
    cancel_requested: Mapped[bool] = mapped_column(Boolean)
    last_event_id: Mapped[str | None] = mapped_column(String(128))
    # Lifecycle events of this request that were recorded but could not be applied.
    illegal_events: Mapped[int] = mapped_column(Integer)
    folded_events: Mapped[int] = mapped_column(Integer)
    last_seq: Mapped[int] = mapped_column(BigInteger)


class KvObjectRow(Base):
    """Projection: the store's objects (journaled by the master through events)."""

    __tablename__ = "kv_objects"

    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    replicas: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    tier: Mapped[str] = mapped_column(String(8))
    pin: Mapped[str] = mapped_column(String(8))
    stored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_event_id: Mapped[str] = mapped_column(String(128))
    # How many of the entity's events this row folds, and the newest one's stream sequence:
    # the recorder folds incrementally only when the log agrees with both.
    folded_events: Mapped[int] = mapped_column(Integer)
    last_seq: Mapped[int] = mapped_column(BigInteger)


class InstanceRow(Base):
    """Projection: every worker instance that ever registered, and whether it is up."""

    __tablename__ = "instances"

    instance_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    host: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(255))
    capacity: Mapped[dict[str, float]] = mapped_column(JSONB)
    status: Mapped[str] = mapped_column(String(8))
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    down_reason: Mapped[str | None] = mapped_column(String(200))
    last_event_id: Mapped[str] = mapped_column(String(128))
    # How many of the entity's events this row folds, and the newest one's stream sequence:
    # the recorder folds incrementally only when the log agrees with both.
    folded_events: Mapped[int] = mapped_column(Integer)
    last_seq: Mapped[int] = mapped_column(BigInteger)


class DeadLetterRow(Base):
    """A message some consumer could never process, with why and its (truncated) bytes."""

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    dlq_id: Mapped[str] = mapped_column(String(256), unique=True)
    consumer: Mapped[str] = mapped_column(String(64), index=True)
    stream: Mapped[str] = mapped_column(String(64))
    stream_seq: Mapped[int] = mapped_column(BigInteger)
    subject: Mapped[str] = mapped_column(String(256))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    payload_size: Mapped[int] = mapped_column(Integer)
    payload_sha256: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


PROJECTIONS = (RequestRow, KvObjectRow, InstanceRow)
