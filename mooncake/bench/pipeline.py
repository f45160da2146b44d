"""`mooncake bench pipeline`: what the pipeline itself costs, against bare nats-py.

The real worker processes (store master, Conductor, one prefill and one decode worker with a
tiny dummy model, so compute is negligible and measured) run on a private NATS.

- Overhead: one request in flight at a time, submit -> first token (token 0 arrives on the
  reply subject from the prefill worker), minus the model compute of that prefill (the
  worker's `prefill_s`). That is the time spent outside the model: admission, two JetStream
  hops with their acks and dedupe, store round trips, the token hop. Interleaved message by
  message with a bare nats-py relay over 3 persisted JetStream hops (`js.publish` per hop,
  the floor for a persisted hop in Python), measured in the same run: `overhead_ratio`.
- Admission throughput: a burst of submissions published at once; `admitted_req_s` is the
  sustained rate of admission decisions the Conductor publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake.bench.relays import RawJetStreamRelay, submitted
from mooncake.bus.publish import Publisher
from mooncake.client import ask
from mooncake.core.quantile import quantile
from mooncake.services import EmbeddedNats, ManagedProcess

Log = Callable[[str], None]
NAMESPACE = "bench_pipe"
ROLES = (("store-master", "bench-master"), ("conductor", "bench-conductor"),
         ("prefill", "prefill-0"), ("decode", "decode-0"))  # fmt: skip


def _env(nats_url: str, tmp: Path, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env.update(
        {
            "MOONCAKE_NATS_URL": nats_url,
            "MOONCAKE_NAMESPACE": NAMESPACE,
            "MOONCAKE_DATA_DIR": str(tmp),
            "MOONCAKE_METRICS_PORT": "-1",
            "MOONCAKE_LOG_LEVEL": "WARNING",
            "MOONCAKE_STORE__SECRET": secret,
            "MOONCAKE_STORE__DRAM_BYTES": str(64 << 20),
            "MOONCAKE_BLOCK_TOKENS": "16",
            "MOONCAKE_ENGINE__MODEL": "dummy",
            "MOONCAKE_ENGINE__THREADS": "1",
            # The dummy model's KV is 512 bytes per token: a 2 GiB pool (resident only as
            # written) holds the whole burst, so the burst measures admission, not the
            # decode instance's KV budget.
            "MOONCAKE_KV_CACHE_BYTES": str(2 << 30),
        }
    )
    return env


def _spawn(role: str, name: str, env: dict[str, str], tmp: Path) -> ManagedProcess:
    argv = [sys.executable, "-m", "mooncake.cli", "worker", role, "--instance", name]
    proc = ManagedProcess(name, argv, tmp / "logs" / f"{name}.log", 0, env=env)
    proc.spawn()
    return proc


def _p(values: list[float], q: float) -> float:
    return quantile(values, q) or 0.0


async def _ready(nc: NATS, ns: ev.Namespace, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        out = await ask(
            nc, token_ids=[1, 2, 3], ns=ns, params=ev.SamplingParams(max_tokens=1), timeout_s=10
        )
        if out.finished:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the pipeline did not answer (see the workers' logs)")


async def _overhead(
    nc: NATS, ns: ev.Namespace, url: str, requests: int, log: Log
) -> dict[str, Any]:
    prefilled: dict[str, float] = {}

    async def on_prefilled(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            body = json.loads(msg.data)
            prefilled[body["request_id"]] = float(body.get("prefill_s", 0.0))

    sub = await nc.subscribe(ns.of(ev.RequestPrefilled), cb=on_prefilled)
    relay = RawJetStreamRelay(url, submitted("relay-payload").to_json())
    await relay.start()
    over: list[float] = []
    raw: list[float] = []
    compute: list[float] = []
    try:
        for i in range(-10, requests):
            rid = f"bench-{secrets.token_hex(6)}"
            # Distinct prompts: no request reuses another's cached blocks.
            tokens = [(i * 7919 + k) % 1000 for k in range(40)]
            out = await ask(
                nc, token_ids=tokens, ns=ns, request_id=rid,
                params=ev.SamplingParams(max_tokens=1), timeout_s=30,
            )  # fmt: skip
            took_raw = await relay.once(i + 10)
            for _ in range(100):  # the prefilled event may trail the token by a moment
                if rid in prefilled:
                    break
                await asyncio.sleep(0.005)
            if i < 0 or out.ttft_s is None or rid not in prefilled:
                continue
            over.append(out.ttft_s - prefilled[rid])
            compute.append(prefilled[rid])
            raw.append(took_raw)
    finally:
        await relay.stop()
        await sub.unsubscribe()
    if len(over) < max(1, requests // 2):
        raise RuntimeError(f"only {len(over)} of {requests} requests produced a first token")
    o50, r50 = statistics.median(over) * 1e3, statistics.median(raw) * 1e3
    log(f"bench pipeline: overhead p50 {o50:.2f} ms vs raw 3-hop relay {r50:.2f} ms")
    return {
        "requests": len(over),
        "overhead_p50_ms": round(o50, 3),
        "overhead_p99_ms": round(_p(over, 0.99) * 1e3, 3),
        "compute_p50_ms": round(statistics.median(compute) * 1e3, 3),
        "raw_nats_p50_ms": round(r50, 3),
        "raw_nats_p99_ms": round(_p(raw, 0.99) * 1e3, 3),
        "overhead_ratio": round(o50 / r50, 3),
    }


async def _admission_rate(nc: NATS, ns: ev.Namespace, burst: int, log: Log) -> dict[str, Any]:
    admitted: list[float] = []
    rejected = 0
    ids = {f"burst-{secrets.token_hex(6)}-{i}" for i in range(burst)}
    all_decided = asyncio.Event()

    async def on_decision(msg: Msg) -> None:
        nonlocal rejected
        with contextlib.suppress(ValueError):
            body = json.loads(msg.data)
            if body.get("request_id") in ids:
                if body.get("type") == "request.admitted":
                    admitted.append(time.perf_counter())
                else:
                    rejected += 1
                if len(admitted) + rejected >= burst:
                    all_decided.set()

    subs = [
        await nc.subscribe(ns.of(ev.RequestAdmitted), cb=on_decision),
        await nc.subscribe(ns.of(ev.RequestRejected), cb=on_decision),
    ]
    batch = [
        ev.RequestSubmitted(
            request_id=rid, token_ids=[(i * 31 + k) % 1000 for k in range(40)],
            params=ev.SamplingParams(max_tokens=1),
        )
        for i, rid in enumerate(sorted(ids))
    ]  # fmt: skip
    started = time.perf_counter()
    await Publisher(nc, nc.jetstream(), ns).publish_many(batch)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_decided.wait(), 120)
    for s in subs:
        await s.unsubscribe()
    if not admitted:
        raise RuntimeError("no request of the burst was admitted")
    rate = len(admitted) / (max(admitted) - started)
    log(f"bench pipeline: {len(admitted)} of {burst} admitted at {rate:.0f}/s")
    return {"burst": burst, "admitted": len(admitted), "admitted_req_s": round(rate, 1)}


async def run_pipeline_bench(
    *, requests: int = 200, burst: int = 2000, log: Log = print
) -> dict[str, Any]:
    if requests < 10 or burst < 100:
        raise ValueError("requests must be >= 10 and burst >= 100")
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-pipe-"))
    broker: EmbeddedNats | None = None
    procs: list[ManagedProcess] = []
    try:
        broker = await asyncio.to_thread(lambda: EmbeddedNats.create(tmp).start())
        env = _env(broker.url, tmp, secrets.token_hex(16))
        procs = [_spawn(role, name, env, tmp) for role, name in ROLES]
        nc = await nats.connect(broker.url)
        ns = ev.Namespace(NAMESPACE)
        try:
            await _ready(nc, ns, 120)
            result: dict[str, Any] = {}
            result.update(await _overhead(nc, ns, broker.url, requests, log))
            result.update(await _admission_rate(nc, ns, burst, log))
            result["cpus"] = os.cpu_count()
            return result
        finally:
            await nc.drain()
    finally:
        for p in reversed(procs):
            await asyncio.to_thread(p.stop)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
