"""Connecting to NATS and declaring the JetStream streams (idempotently)."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from mooncake.config import Settings
from mooncake.events import Namespace, StreamSpec

log = logging.getLogger(__name__)


async def connect(settings: Settings, name: str) -> NATS:
    """Connect with unlimited reconnects: a broker restart must not kill a worker."""

    async def _on_error(exc: Exception) -> None:
        log.warning("nats error (%s): %s", name, exc)

    async def _on_disconnect() -> None:
        log.warning("nats disconnected (%s)", name)

    async def _on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)

    return await nats.connect(
        settings.nats_url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=_on_error,
        disconnected_cb=_on_disconnect,
        reconnected_cb=_on_reconnect,
    )


def stream_config(spec: StreamSpec, settings: Settings) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=settings.bus.replicas,
        duplicate_window=settings.bus.dedupe_window_s,
        discard=DiscardPolicy.OLD,
        max_age=spec.max_age_s,
    )


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Create every stream, or update it to the current config (safe to call repeatedly)."""
    for spec in Namespace(settings.namespace).streams():
        config = stream_config(spec, settings)
        try:
            await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(config)
            log.info("created stream %s %s", spec.name, spec.subjects)
            continue
        try:
            await js.update_stream(config)
        except BadRequestError as exc:  # e.g. replicas cannot change on a single server
            log.warning("stream %s kept its existing config: %s", spec.name, exc)
