"""Connecting to NATS (credentials, TLS, inbox prefix) and declaring the JetStream streams
(idempotently).

Every process of ours connects through `connect`, so one set of settings decides how it
authenticates (deploy/nats/auth.conf has a user per role), whether it uses TLS, and which
reply inboxes it uses: a user's permissions allow subscribing to its own inbox prefix only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import ssl
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from mooncake.bus import terminal
from mooncake.config import Settings
from mooncake.events import Namespace, StreamSpec

log = logging.getLogger(__name__)

DEFAULT_INBOX_PREFIX = "_INBOX"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StreamSetupError(RuntimeError):
    """A stream is missing and this connection may not (or could not) create it."""


def servers_of(url: str) -> list[str]:
    """`nats_url` may list several servers (a cluster's seeds), comma-separated."""
    return [u.strip() for u in url.split(",") if u.strip()]


def inbox_prefix(settings: Settings) -> str:
    """`nats_inbox_prefix`, else `_INBOX.<user>` for a user (its permissions allow exactly
    that), else NATS's default."""
    if settings.nats_inbox_prefix:
        return settings.nats_inbox_prefix
    user = settings.nats_user
    if user and _TOKEN.match(user):
        return f"{DEFAULT_INBOX_PREFIX}.{user}"
    return DEFAULT_INBOX_PREFIX


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """A client TLS context when a CA or a client certificate is configured, else None
    (a `tls://` URL alone then uses nats-py's default context with the system CAs)."""
    ca, cert, key = settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
    if ca is None and cert is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError("nats_tls_cert and nats_tls_key must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca else None)
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def auth_options(settings: Settings) -> dict[str, Any]:
    """nats-py `connect` keyword arguments for the configured credentials and TLS."""
    options: dict[str, Any] = {"inbox_prefix": inbox_prefix(settings)}
    password = settings.nats_password.get_secret_value() if settings.nats_password else None
    if password is None and settings.nats_password_file is not None:
        password = settings.nats_password_file.read_text().strip()
    if settings.nats_user:
        options["user"] = settings.nats_user
        if password is not None:
            options["password"] = password
    elif password is not None:
        raise ValueError("a NATS password needs a user (MOONCAKE_NATS_USER)")
    if settings.nats_token is not None:
        options["token"] = settings.nats_token.get_secret_value()
    if settings.nats_creds is not None:
        options["user_credentials"] = str(settings.nats_creds)
    ctx = tls_context(settings)
    if ctx is not None:
        options["tls"] = ctx
    return options


class NatsRefusedError(ConnectionError):
    """The broker refused this client: wrong or missing credentials, or a TLS certificate
    that does not verify. Retrying cannot fix either."""


def is_refusal(exc: BaseException) -> bool:
    if isinstance(exc, nats.errors.AuthorizationError | ssl.SSLCertVerificationError):
        return True
    return "authorization violation" in str(exc).lower()


async def connect(
    settings: Settings,
    name: str,
    *,
    connect_timeout: float = 5,
    max_reconnect_attempts: int = -1,
) -> NATS:
    """Connect as the configured user. By default retries forever until the broker answers
    and reconnects forever after: a broker restart (or a cluster node's loss) must not kill
    a worker. A refusal on the first connection (credentials, TLS verification) fails at
    once (`NatsRefusedError`). Short-lived clients (the CLI) pass limits."""
    nc = NATS()
    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def _on_error(exc: Exception) -> None:
        if not nc.is_connected and is_refusal(exc) and not refused.done():
            refused.set_result(exc)  # still connecting: give up, do not spin
            return
        log.warning("nats error (%s): %s", name, exc)

    async def _on_disconnect() -> None:
        if nc.is_closed:  # closed or drained on purpose (nats-py sets CLOSED before this)
            log.debug("nats connection closed (%s)", name)
            return
        log.warning("nats disconnected (%s)", name)

    async def _on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)

    options: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": max_reconnect_attempts,
        "reconnect_time_wait": 0.5,  # nats-py's stubs say int; it sleeps for any number
        "connect_timeout": connect_timeout,
        "allow_reconnect": True,
        "error_cb": _on_error,
        "disconnected_cb": _on_disconnect,
        "reconnected_cb": _on_reconnect,
    }
    connecting = asyncio.ensure_future(
        nc.connect(servers_of(settings.nats_url), **options, **auth_options(settings))
    )
    either: set[asyncio.Future[Any]] = {connecting, refused}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        connecting.cancel()
        raise
    if connecting.done():
        connecting.result()  # the connection's own error, if it failed otherwise
        return nc
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    with contextlib.suppress(Exception):
        await nc.close()
    who = settings.nats_user or ("a token" if settings.nats_token else "no credentials")
    raise NatsRefusedError(f"NATS refused the connection ({who}): {refused.result()}")


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


def config_drift(current: StreamConfig, wanted: StreamConfig) -> list[str]:
    """The fields we set whose value on the server differs from ours."""
    drift = []
    if sorted(current.subjects or []) != sorted(wanted.subjects or []):
        drift.append("subjects")
    for field in ("retention", "storage", "num_replicas", "discard"):
        if getattr(current, field) != getattr(wanted, field):
            drift.append(field)
    for field in ("duplicate_window", "max_age"):  # seconds; the server's 0 is our None
        if not math.isclose(getattr(current, field) or 0.0, getattr(wanted, field) or 0.0):
            drift.append(field)
    return drift


# What a request the server denies (permissions) or cannot answer looks like to nats-py.
_UNANSWERED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError)


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Create every stream (and the terminal-claims bucket) if missing; update a stream whose
    config drifted from ours. Safe to call repeatedly and from every process.

    Only what differs is updated, so a role whose NATS user may read stream info but not
    change streams (see deploy/nats/auth.conf) starts fine against streams an admin made.
    """
    ns = Namespace(settings.namespace)
    for spec in ns.streams():
        config = stream_config(spec, settings)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await _create(js, config)
            continue
        drift = config_drift(info.config, config)
        if not drift:
            continue
        try:
            await js.update_stream(config)
            log.info("updated stream %s (%s)", spec.name, ", ".join(drift))
        except (BadRequestError, *_UNANSWERED) as exc:
            # e.g. replicas cannot change on a single server, or this user may not update
            log.warning("stream %s kept its existing config (%s differ): %r", spec.name, drift, exc)
    try:
        await terminal.open_bucket(js, ns, settings.bus.replicas)
    except _UNANSWERED as exc:
        raise StreamSetupError(_denied(f"KV bucket {ns.stream(terminal.BUCKET)}", exc)) from exc


async def _create(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except _UNANSWERED as exc:
        raise StreamSetupError(_denied(f"stream {config.name}", exc)) from exc
    log.info("created stream %s %s", config.name, config.subjects)


def _denied(what: str, exc: Exception) -> str:
    return (
        f"{what} does not exist and could not be created ({exc!r}): this NATS user may lack "
        "$JS.API.STREAM.CREATE permission; start a role that may create it, or create it as "
        "the admin user"
    )
