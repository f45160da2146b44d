"""What every worker process does around its own loop: logging, tracing, metrics, signals,
the NATS connection and stream setup, and registering the instance in the record."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
import socket
import sys
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from mooncake import events as ev
from mooncake import memory
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.telemetry import setup_tracing, start_metrics_server

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    settings: Settings
    role: str
    instance_id: str
    nc: NATS
    js: JetStreamContext
    publisher: Publisher
    ns: ev.Namespace
    stop: asyncio.Event
    metrics_port: int | None


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )


def dump_stacks() -> None:
    """Every thread's stack and every asyncio task's, to the log (SIGUSR1): what a worker
    that stopped making progress is waiting on."""
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    for task in asyncio.all_tasks():
        log.warning("task %s (%s):\n%s", task.get_name(), _state(task), "".join(_awaiting(task)))


def _state(task: asyncio.Task[object]) -> str:
    return "cancelling" if task.cancelling() else "pending"


def _awaiting(task: asyncio.Task[object]) -> list[str]:
    """The task's coroutine and each one it awaits, down to the innermost (`print_stack`
    shows only the outermost of a suspended task)."""
    lines: list[str] = []
    coro: object = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines += traceback.format_stack(frame, limit=1)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


def default_instance_id(role: str) -> str:
    host = socket.gethostname().split(".")[0]
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in f"{role}-{host}")[:64]


@contextlib.asynccontextmanager
async def worker_context(
    settings: Settings, role: str, instance_id: str | None = None
) -> AsyncIterator[WorkerContext]:
    setup_tracing(settings, role)
    port = start_metrics_server(settings.metrics_port, settings.metrics_host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_stacks)
    instance = instance_id or default_instance_id(role)
    nc = await connect(settings, f"{role}:{instance}")
    js = nc.jetstream()
    await ensure_streams(js, settings)
    ns = ev.Namespace(settings.namespace)
    publisher = Publisher(nc, js, ns)
    ctx = WorkerContext(settings, role, instance, nc, js, publisher, ns, stop, port)
    await publisher.publish(
        ev.InstanceRegistered(
            instance_id=instance,
            role=role,
            host=socket.gethostname()[:255],
            endpoint=f"metrics:{port}" if port else "",
        )
    )
    log.info("%s %s up (metrics port %s)", role, instance, port)
    if role in memory.CONTROL_ROLES:  # an engine worker states its own, with its model's
        memory.state_control_bound(role, settings)
    try:
        yield ctx
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                publisher.publish(ev.InstanceDeregistered(instance_id=instance)), 5
            )
        with contextlib.suppress(Exception):
            await nc.drain()
        log.info("%s %s stopped", role, instance)
