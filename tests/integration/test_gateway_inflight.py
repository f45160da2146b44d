"""The gateway's bound on requests in flight (`gateway.max_inflight`) over HTTP and a real
broker: the real app served by uvicorn on a socket, `NatsBackend` on the suite's NATS, and a
stub pipeline on `mc.req.submitted` that answers each request as its prompt says (hold it
open, answer it, reject it, or say nothing until the timeout). Past the limit a completion is
refused at once with 503 `gateway_overloaded` and `Retry-After`, and nothing is published for
it; a slot comes back however a request ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import uvicorn
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import GatewaySettings, Settings
from mooncake.gateway import GatewayOptions, NatsBackend, create_app
from mooncake.gateway.app import Gateway
from mooncake.gateway.inflight import (
    BODY_BYTES_PER_BYTE,
    INFLIGHT_BYTES,
    body_size,
    memory_parts,
)
from workers.gateway import _Server, bind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RETRY_AFTER_S = 4


def in_flight() -> float:
    return REGISTRY.get_sample_value("mc_gateway_completions_in_flight") or 0.0


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


@dataclass
class Pipeline:
    """Stands in for the Conductor and the workers: answers each submission as its prompt
    says ("hold", "answer", "reject"; anything else: silence), and records what came."""

    nc: NATS
    submitted: list[dict[str, Any]] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # request id -> reply subject

    async def on_submitted(self, msg: Msg) -> None:
        body = json.loads(msg.data)
        self.submitted.append(body)
        rid, reply, says = body["request_id"], body["reply_to"], body.get("prompt")
        if says == "reject":
            await self.reply(reply, type="request.rejected", request_id=rid,
                             reason="ttft_slo", detail="slow", stage="admission")  # fmt: skip
            return
        if says not in ("hold", "answer"):
            return
        await self.reply(reply, type="request.admitted", request_id=rid, policy="none",
                         prompt_tokens=1)  # fmt: skip
        if says == "answer":
            await self.finish(rid, reply)
        else:
            self.held[rid] = reply

    async def finish(self, rid: str, reply: str) -> None:
        await self.reply(reply, request_id=rid, index=0, token_ids=[7], text="ok")
        await self.reply(reply, request_id=rid, index=1, token_ids=[], text="", done=True,
                         finish_reason="stop")  # fmt: skip

    async def reply(self, subject: str, **body: Any) -> None:
        await self.nc.publish(subject, json.dumps(body).encode())


@dataclass
class Served:
    base_url: str
    model: str
    pipeline: Pipeline

    def body(self, says: str, *, stream: bool = False) -> dict[str, Any]:
        return {"model": self.model, "prompt": says, "max_tokens": 4, "stream": stream}

    @asynccontextmanager
    async def held(self) -> AsyncIterator[httpx.Response]:
        """A streamed request the pipeline holds open, on a connection of its own; leaving
        the block hangs up (the client's disconnect)."""
        async with (
            httpx.AsyncClient(base_url=self.base_url, timeout=10) as http,
            http.stream("POST", "/v1/completions", json=self.body("hold", stream=True)) as resp,
        ):
            assert resp.status_code == 200, await resp.aread()
            yield resp


Serve = Callable[..., AbstractAsyncContextManager[Served]]


@pytest.fixture
def serve(nats_url: str, namespace: str, tmp_path: Path) -> Serve:
    @asynccontextmanager
    async def run(**gateway: Any) -> AsyncIterator[Served]:
        g = GatewaySettings(retry_after_s=RETRY_AFTER_S, **gateway)
        settings = Settings(
            nats_url=nats_url, namespace=namespace, data_dir=tmp_path / "data", gateway=g
        )
        ns = ev.Namespace(namespace)
        nc = await nats.connect(nats_url)
        await ensure_streams(nc.jetstream(), settings)
        pipeline = Pipeline(nc)
        sub = await nc.subscribe(ns.of(ev.RequestSubmitted), cb=pipeline.on_submitted)
        backend = NatsBackend(nc, Publisher(nc, nc.jetstream(), ns), ns)
        # The completion routes take text prompts without a tokenizer: what the stub reads.
        app = create_app(backend, GatewayOptions.from_settings(settings), None)
        sock = bind("127.0.0.1", 0)
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1)
        server = _Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        port = sock.getsockname()[1]
        try:
            yield Served(f"http://127.0.0.1:{port}", settings.model_id, pipeline)
        finally:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 10)
            sock.close()
            gw: Gateway = app.state.gateway
            await gw.drain()
            await sub.unsubscribe()
            await nc.close()

    return run


async def test_past_the_limit_a_completion_is_503_and_nothing_is_published(
    serve: Serve,
) -> None:
    base = in_flight()
    async with serve(max_inflight=2) as gw:
        async with gw.held(), gw.held():
            assert in_flight() == base + 2
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http:
                for path, body in (
                    ("/v1/completions", gw.body("answer", stream=True)),
                    ("/v1/completions", gw.body("answer")),
                    ("/v1/chat/completions", {"model": gw.model, "messages": "not read"}),
                ):
                    resp = await http.post(path, json=body)
                    assert resp.status_code == 503, resp.text
                    assert resp.headers["retry-after"] == str(RETRY_AFTER_S)
                    err = resp.json()["error"]
                    assert err["code"] == "gateway_overloaded", err
                    assert "limit of 2 requests" in err["message"], err["message"]
                    assert "not accepted" in err["message"], err["message"]
                # Requests that are not completions are not counted, nor refused.
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/v1/models")).status_code == 200
                metrics = (await http.get("/metrics")).text
                assert "mc_gateway_completions_in_flight" in metrics
            await gw.pipeline.nc.flush()
            await asyncio.sleep(0.3)  # a submission published would have arrived by now
            assert [s["prompt"] for s in gw.pipeline.submitted] == ["hold", "hold"]
            assert in_flight() == base + 2
        await until(lambda: in_flight() == base)


async def test_a_slot_comes_back_when_a_request_ends_or_its_client_hangs_up(
    serve: Serve,
) -> None:
    base = in_flight()
    async with serve(max_inflight=2) as gw, httpx.AsyncClient(base_url=gw.base_url) as http:
        async with gw.held():
            async with gw.held():
                assert (await http.post("/v1/completions", json=gw.body("x"))).status_code == 503
            # The second client hung up mid-stream: its slot is back.
            await until(lambda: in_flight() == base + 1)
            async with gw.held() as third:
                assert (await http.post("/v1/completions", json=gw.body("x"))).status_code == 503
                # One ends by its answer: the stream runs to [DONE], its slot comes back.
                rid = third.headers["x-request-id"]
                await gw.pipeline.finish(rid, gw.pipeline.held[rid])
                text = b"".join([chunk async for chunk in third.aiter_bytes()])
                assert text.endswith(b"data: [DONE]\n\n"), text
                await until(lambda: in_flight() == base + 1)
                resp = await http.post("/v1/completions", json=gw.body("answer"))
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == "ok"
            # A client that hangs up while it waits for a whole answer gives its slot back.
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=gw.body("hold"), timeout=0.3)
            await until(lambda: in_flight() == base + 1)
            resp = await http.post("/v1/completions", json=gw.body("answer"))
            assert resp.status_code == 200, resp.text
        await until(lambda: in_flight() == base)
        assert len(gw.pipeline.submitted) == 6  # the three refused were never published


async def test_every_way_a_request_ends_gives_its_slot_back(serve: Serve) -> None:
    """With one slot (a limit: refused while a request holds it), each request is served
    only if the one before gave its slot back: invalid, an unknown model, rejected by the
    pipeline, timed out (whole or streamed), answered, refused by the client's own limit."""
    base = in_flight()
    async with (
        serve(max_inflight=1, request_timeout_s=0.5, client_rate_per_s=0.001, client_burst=7)
        as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http,
    ):  # fmt: skip
        waiting = asyncio.create_task(http.post("/v1/completions", json=gw.body("silent")))
        await until(lambda: in_flight() == base + 1)
        refused = await http.post("/v1/completions", json=gw.body("answer"))
        assert refused.status_code == 503, refused.text
        assert (await waiting).status_code == 504
        cases: list[tuple[dict[str, Any], int]] = [
            ({"model": gw.model, "prompt": "x", "max_tokens": -1}, 400),
            ({"model": "gpt-5", "prompt": "x"}, 404),
            (gw.body("reject"), 429),
            (gw.body("silent"), 504),
            (gw.body("silent", stream=True), 504),
            (gw.body("answer"), 200),
            (gw.body("answer"), 429),  # the client's limit (burst 7) is spent: refused inside
        ]
        for body, status in cases:
            await until(lambda: in_flight() == base)
            resp = await http.post("/v1/completions", json=body)
            assert resp.status_code == status, (body, resp.text)
        assert resp.json()["error"]["code"] == "client_rate_limited"
        await until(lambda: in_flight() == base)
        # reject, the three silent, answer; the 503 never published
        assert len(gw.pipeline.submitted) == 5


async def test_past_the_body_bytes_in_flight_a_completion_is_503(serve: Serve) -> None:
    """Bodies count by their Content-Length against `max_inflight_body_bytes`: a large one
    that would go past it is refused (nothing published) while a small one still fits, and
    the bytes come back when the held request ends."""
    base = in_flight()
    async with (
        serve(max_inflight=10, max_body_bytes=4096, max_inflight_body_bytes=6000) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http,
    ):
        big = {**gw.body("answer"), "user": "x" * 3000}  # about 3.1 kB
        async with (
            http.stream("POST", "/v1/completions", json={**big, "prompt": "hold",
                                                         "stream": True}) as held,
        ):  # fmt: skip
            assert held.status_code == 200
            refused = await http.post("/v1/completions", json=big)
            assert refused.status_code == 503, refused.text
            err = refused.json()["error"]
            assert err["code"] == "gateway_overloaded"
            assert "6000 bytes of request bodies" in err["message"], err["message"]
            small = await http.post("/v1/completions", json=gw.body("answer"))
            assert small.status_code == 200, small.text
        await until(lambda: in_flight() == base)  # the held one's client hung up
        ok = await http.post("/v1/completions", json=big)
        assert ok.status_code == 200, ok.text
        assert [s["prompt"] for s in gw.pipeline.submitted] == ["hold", "answer", "answer"]


def test_body_size_is_the_content_length_else_the_largest_body() -> None:
    scope = {"headers": [(b"content-length", b"1200")]}
    assert body_size(scope, 4096) == 1200
    assert body_size({"headers": []}, 4096) == 4096  # chunked: the most it may be
    assert body_size({"headers": [(b"content-length", b"9999999")]}, 4096) == 4096
    assert body_size({"headers": [(b"content-length", b"twelve")]}, 4096) == 4096


def test_memory_parts_scale_with_the_limits() -> None:
    g = GatewaySettings(max_inflight=3, max_body_bytes=4096, max_inflight_body_bytes=8192)
    assert memory_parts(g) == {
        "inflight": 3 * INFLIGHT_BYTES,
        "bodies": 8192 * BODY_BYTES_PER_BYTE,
    }
    assert GatewaySettings().max_inflight == 512
    with pytest.raises(ValueError, match="could never be served"):
        GatewaySettings(max_body_bytes=8192, max_inflight_body_bytes=4096)
