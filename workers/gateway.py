"""The gateway process: the OpenAI-compatible HTTP API (`mooncake.gateway`) served by
uvicorn on `gateway.host:gateway.port`, submitting to `mc.req.submitted` and answering from
each request's reply subject.

The listening socket is bound before anything else, so a port that is taken fails the
start at once with a clear message (and port 0 becomes a concrete, logged port). The
process's signals stay with the worker runtime: uvicorn is told to exit when the runtime's
stop event is set, finishes the responses in flight (within a grace period), and the
cancels of abandoned requests are published before the bus connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import replace

import uvicorn

from mooncake.aio import cancel_all
from mooncake.config import Settings
from mooncake.gateway import GatewayOptions, NatsBackend, create_app
from mooncake.gateway.app import Gateway
from mooncake.model_info import model_header
from workers.runtime import configure_logging, worker_context

log = logging.getLogger("mooncake.gateway")

GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers (the worker runtime owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        return None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or ValueError naming the address (the CLI prints it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def main(settings: Settings, instance_id: str | None = None) -> None:
    g = settings.gateway
    sock = bind(g.host, g.port)
    try:
        # The tokenizer turns prompts into token ids and applies the chat template.
        model = await asyncio.to_thread(model_header, settings.engine)
        options = replace(GatewayOptions.from_settings(settings), context=model.spec.context)
        async with worker_context(settings, "gateway", instance_id) as ctx:
            app = create_app(NatsBackend(ctx.nc, ctx.publisher, ctx.ns), options, model.tokenizer)
            config = uvicorn.Config(
                app,
                log_level=settings.log_level.lower(),
                log_config=None,  # uvicorn's loggers go through the worker's logging
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=int(GRACE_S),
            )
            server = _Server(config)
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            stopping = asyncio.create_task(ctx.stop.wait())
            host, port = sock.getsockname()[:2]
            log.info("OpenAI-compatible API on http://%s:%s/v1", host, port)
            try:
                await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                server.should_exit = True
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(serving), GRACE_S + 5)
                await cancel_all([serving, stopping])
                gateway: Gateway = app.state.gateway
                await gateway.drain(GRACE_S)
            if serving.done() and not serving.cancelled() and serving.exception() is not None:
                raise RuntimeError("the HTTP server stopped") from serving.exception()
    finally:
        sock.close()


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))
