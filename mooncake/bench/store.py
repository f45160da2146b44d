"""`mooncake bench store`: put/get throughput through the real store, against plain baselines.

The store runs as it does in production: a private NATS, `mooncake worker store-master` and
`mooncake worker store-node` as their own processes; this process is the client. Per
transport (tcp, shm) and object size, objects are put and got in batches; each put is timed
from the call until `put_end` was acknowledged (the bytes are in the node's segment and
visible), each get from the call until the bytes are in the caller's buffer. Baselines in
the same run: tcp = two plain processes, one `sendall`-ing the same bytes over loopback, the
other `recv_into`-ing them into a preallocated buffer; shm = a plain memory copy.
"""

from __future__ import annotations

import asyncio
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
import numpy as np
import psutil

from mooncake.bench.store_baselines import tcp_baseline_gbps
from mooncake.namespace import Namespace
from mooncake.services import EmbeddedNats, ManagedProcess
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.segment import Segment
from mooncake.store.transfer.base import available

Log = Callable[[str], None]
KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 1 * MiB, 16 * MiB)
NAMESPACE = "bench_store"
NODE = "bench-node"


def spawn_store_role(
    role: str,
    name: str,
    nats_url: str,
    secret: str,
    tmp: Path,
    *,
    namespace: str = NAMESPACE,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """`mooncake worker <role>` (store-master, store-node) as its own process on a private
    broker, quiet, its log under `tmp/logs`; `env` adds or overrides settings."""
    full = dict(os.environ)
    full.update(
        {
            "MOONCAKE_NATS_URL": nats_url,
            "MOONCAKE_NAMESPACE": namespace,
            "MOONCAKE_DATA_DIR": str(tmp),
            "MOONCAKE_METRICS_PORT": "-1",
            "MOONCAKE_OTLP_ENDPOINT": "",
            "MOONCAKE_LOG_LEVEL": "WARNING",
            "MOONCAKE_STORE__SECRET": secret,
            "MOONCAKE_STORE__TRANSPORTS": '["shm", "tcp"]',
            **(env or {}),
        }
    )
    argv = [sys.executable, "-m", "mooncake.cli", "worker", role, "--instance", name]
    proc = ManagedProcess(name, argv, tmp / "logs" / f"{name}.log", 0, env=full)
    proc.spawn()
    return proc


def _spawn(
    role: str, name: str, nats_url: str, secret: str, tmp: Path, segment: int
) -> ManagedProcess:
    # The bench removes what it put; nothing should be evicted under it.
    env = {"MOONCAKE_STORE__DRAM_BYTES": str(segment), "MOONCAKE_STORE__HIGH_WATERMARK": "1.0"}
    return spawn_store_role(role, name, nats_url, secret, tmp, env=env)


async def wait_store_ready(client: StoreClient, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if await client.put("ready", b"x") is None:
                await client.remove("ready", force=True)
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the store did not come up (see its logs)")


def _sources(size: int, total: int, batch_bytes: int) -> tuple[int, list[np.ndarray]]:
    """How many objects to move, and one batch of distinct random source objects."""
    count = max(1, total // size)
    per_batch = max(1, min(count, batch_bytes // size))
    rng = np.random.default_rng(size)
    return count, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(per_batch)]


def memcpy_gbps(src: list[np.ndarray], count: int, *, shared: bool = True) -> float:
    """The shm baseline: a plain memory copy of the same objects into distinct places of a
    preallocated, pre-touched buffer, as the store copies them into a segment. `shared`: the
    buffer is a DRAM segment itself (/dev/shm, 4 KiB pages of tmpfs, ~8% slower to write
    here than anonymous memory, which the kernel may back with huge pages); otherwise
    anonymous memory."""
    size = src[0].nbytes
    nbytes = len(src) * size
    segment = Segment.create_dram("bench-baseline", "bench", nbytes) if shared else None
    # Both pre-touched: no page faults while timed.
    dst = np.frombuffer(segment.buf, dtype=np.uint8) if segment else np.ones(nbytes, np.uint8)
    try:
        start = time.perf_counter()
        for i in range(count):
            j = i % len(src)
            np.copyto(dst[j * size : (j + 1) * size], src[j])
        return count * size / (time.perf_counter() - start) / 1e9
    finally:
        del dst  # the segment's view, before the segment closes
        if segment is not None:
            segment.close()


async def _round(
    client: StoreClient, count: int, src: list[np.ndarray], tag: str
) -> tuple[float, float]:
    """Put then get `count` objects (batches of len(src)); seconds spent in each."""
    size = src[0].nbytes
    per_batch = len(src)
    dst = [np.ones(size, dtype=np.uint8) for _ in range(per_batch)]  # touched, as a KV cache is
    put_s = get_s = 0.0
    done = 0
    b = 0
    while done < count:
        n = min(per_batch, count - done)
        keys = [f"{tag}-{b}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        res = await client.put_many(list(zip(keys, src[:n], strict=True)))
        t1 = time.perf_counter()
        if any(r is not None for r in res):
            raise RuntimeError(f"put refused: {next(r for r in res if r is not None)}")
        sizes = await client.get_many_into(keys, dst[:n])
        t2 = time.perf_counter()
        if any(s != size for s in sizes) or not np.array_equal(dst[0], src[0]):
            raise RuntimeError("get returned wrong bytes")
        put_s += t1 - t0
        get_s += t2 - t1
        await client.remove_many(keys, force=True)
        done += n
        b += 1
    return put_s, get_s


async def _measure_size(
    clients: dict[str, StoreClient], size: int, total: int, reps: int, log: Log
) -> list[dict[str, Any]]:
    """One object size: `reps` blocks, each measuring the baselines and then every
    transport on total/reps bytes, so slow and fast moments of a shared machine fall on
    both sides alike. Baselines are the median of the blocks; put and get GB/s are over
    all bytes moved."""
    count, src = _sources(size, total, 64 * MiB)
    per_rep = max(1, count // reps)
    tcp_base: list[float] = []
    tcp_hot: list[float] = []
    mem_base: list[float] = []
    mem_anon: list[float] = []
    spent = {name: [0.0, 0.0] for name in clients}
    for rep in range(reps):
        block = per_rep * size
        tcp_base.append(await asyncio.to_thread(tcp_baseline_gbps, size, block, len(src)))
        tcp_hot.append(await asyncio.to_thread(tcp_baseline_gbps, size, block, 1))
        mem_base.append(memcpy_gbps(src, per_rep))
        mem_anon.append(memcpy_gbps(src, per_rep, shared=False))
        for name, client in clients.items():
            put_s, get_s = await _round(client, per_rep, src, f"{name}{size}r{rep}")
            spent[name][0] += put_s
            spent[name][1] += get_s
    rows = []
    moved = per_rep * reps * size
    for name, (put_s, get_s) in spent.items():
        put, get = moved / put_s / 1e9, moved / get_s / 1e9
        base = statistics.median(tcp_base if name == "tcp" else mem_base)
        row: dict[str, Any] = {
            "transport": name,
            "size": size,
            "put_gbps": round(put, 3),
            "get_gbps": round(get, 3),
            "baseline_gbps": round(base, 3),
            "ratio": round(min(put, get) / base, 3),
        }
        if name == "tcp":  # the same bytes into one buffer: cache-hot for small objects
            row["baseline_one_buffer_gbps"] = round(statistics.median(tcp_hot), 3)
        else:  # the copy into anonymous memory, for reference
            row["baseline_anon_gbps"] = round(statistics.median(mem_anon), 3)
        log(f"bench store: {row}")
        rows.append(row)
    return rows


async def _small_ops(client: StoreClient, n: int, batch: int) -> dict[str, float]:
    keys = [f"small-{i}" for i in range(n)]
    payload = np.ones(4 * KiB, dtype=np.uint8)
    for i in range(0, n, batch):
        res = await client.put_many([(k, payload) for k in keys[i : i + batch]])
        assert all(r is None for r in res)
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        assert all(await client.exists_many(keys[i : i + batch]))
    t1 = time.perf_counter()
    outs = [np.empty(4 * KiB, dtype=np.uint8) for _ in range(batch)]
    for i in range(0, n, batch):
        chunk = keys[i : i + batch]
        sizes = await client.get_many_into(chunk, outs[: len(chunk)])
        assert all(s == 4 * KiB for s in sizes)
    t2 = time.perf_counter()
    for i in range(0, n, batch):
        await client.remove_many(keys[i : i + batch], force=True)
    return {
        "small_exists_ops_per_s": round(n / (t1 - t0)),
        "small_get_ops_per_s": round(n / (t2 - t1)),
        "small_ops_per_s": round(min(n / (t1 - t0), n / (t2 - t1))),
    }


async def run_store_bench(
    *, total_mib: int = 768, small_ops: int = 20_000, reps: int = 3, log: Log = print
) -> dict[str, Any]:
    if total_mib < 16 or small_ops < 100 or not 1 <= reps <= 20:
        raise ValueError("total-mib must be >= 16, small-ops >= 100 and reps 1-20")
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-store-"))
    secret = secrets.token_hex(16)
    segment = 320 * MiB
    broker: EmbeddedNats | None = None
    procs: list[ManagedProcess] = []
    result: dict[str, Any] = {
        "segment_bytes": segment,
        "total_bytes": total_mib * MiB,
        "reps": reps,
    }
    try:
        broker = await asyncio.to_thread(lambda: EmbeddedNats.create(tmp).start())
        procs.append(_spawn("store-master", "bench-master", broker.url, secret, tmp, segment))
        procs.append(_spawn("store-node", NODE, broker.url, secret, tmp, segment))
        nc = await nats.connect(broker.url)
        rows: list[dict[str, Any]] = []
        try:
            ns = Namespace(NAMESPACE)
            clients = {
                name: StoreClient(nc, ns, ClientConfig(secret.encode(), (name,)))
                for name in ("tcp", "shm")
                if available(name)[0]
            }
            await wait_store_ready(clients["tcp"])
            for size in SIZES:
                rows += await _measure_size(clients, size, total_mib * MiB, reps, log)
            result["results"] = rows
            result.update(await _small_ops(clients["tcp"], small_ops, 1000))
            node = procs[1].proc
            assert node is not None
            rss = psutil.Process(node.pid).memory_info().rss
            result["node_rss_bytes"] = rss
            result["node_rss_over_segment_mb"] = round((rss - segment) / MiB, 1)
            for c in clients.values():
                await c.close()
        finally:
            await nc.drain()
        result["cpus"] = os.cpu_count()
        return result
    finally:
        for p in reversed(procs):
            await asyncio.to_thread(p.stop)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
