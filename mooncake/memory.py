"""A worker's memory: the default KV budget, the bound a worker states at start, and a C heap
that gives freed memory back.

KV budget. Every engine worker (prefill, decode) allocates one KV pool from its budget
(`Settings.kv_cache_bytes`, `MOONCAKE_KV_CACHE_BYTES`, `--kv-cache-bytes`). Unset, it is an
eighth of the machine's memory split over the engine workers that run on it (`mooncake up`
passes its own count; a worker started alone assumes it is the only one), clamped to
[512 MiB, 64 GiB]. Each engine worker also holds its model's weights (twice on the CPU: the
oneDNN-packed copy the GEMMs read), its store node's DRAM segment and the runtime, and the
machine has other processes. Under `up` the pools are mapped at start (`KVPool.prefault`),
so the budget is what each worker holds from the start: an eighth, 1.5 GiB for each of
`up`'s two engine workers on 24 GiB (a SmolLM2 pool of 34k tokens: eleven 3,000-token
contexts; the store pools more). It was a quarter over four workers, each touched only as
it filled (issue 42).

Stated bound. A worker logs at start what it may come to hold: weights + KV budget + its store
node's DRAM segment + a fixed allowance for everything else (the runtime, transients).
`mooncake bench memory` reports every role's peak against it (and against issue 15's
weights + KV + 600 MiB). RSS counts a shared page once in every process that maps it (the
shm transport maps the peers' segments it copies from), so the check on this bound is on
PSS, which counts each shared page as a share per process.

Control-plane bound. The gateway, the Conductor, the recorder and the store master hold no
model; each logs at start the most it may come to hold (`control_parts`): a runtime
allowance (`CONTROL_ALLOWANCE`) plus what each of its bounded tables takes at its limit,
from bytes per entry measured with tracemalloc (the gateway's requests and bodies in flight,
`gateway.max_inflight[_body_bytes]`; the Conductor's requests in flight and KV index keys,
`conductor.max_inflight` / `max_index_keys`; the store master's objects and journal,
`store.max_objects` / `journal_max`) plus, for each pull consumer it runs, its window of
delivered and unhandled messages (`bus.consume.window_bytes`).

Heap. glibc raises its mmap threshold each time a large block is freed, after which
allocations up to 32 MiB come from the heap, whose freed memory is rarely returned: loading
a GGUF model (dequantizing tensor by tensor) left ~440 MiB of free heap resident in every
worker. `keep_heap_small` fixes the threshold so large blocks are always mapped (and unmapped
when freed), and `release_free_heap` trims what the loader left behind. A prefill computes
inside `compute_heap`: its temporaries then come from the heap (a fresh mapping for each
was a third of its time in page faults), and the heap is trimmed when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from mooncake.config import Settings

log = logging.getLogger("mooncake.memory")

MIB, GIB = 1 << 20, 1 << 30
KV_SHARE_OF_MEMORY = 0.125
MIN_DEFAULT_KV = 512 * MIB
MAX_DEFAULT_KV = 64 * GIB
# Beyond weights, KV and the store segment: torch's runtime (~280 MiB resident here, ~210 of
# it its libraries), Python, and a prefill's activations (issue 15's figure).
OTHER_ALLOWANCE = 600 * MIB
# A control-plane role's runtime (Python, nats-py, pydantic, SQLAlchemy where it records):
# 114-121 MiB RSS at idle (2026-11-25, BENCHMARKS.md), doubled for transients.
CONTROL_ALLOWANCE = 256 * MIB
CONTROL_ROLES = ("gateway", "conductor", "recorder", "store_master")
M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
HEAP_MMAP_THRESHOLD = 1 * MIB
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's
# While a prefill computes (`compute_heap`): its temporaries come from the heap and stay
# there for the next layer's, up to these sizes.
COMPUTE_MMAP_THRESHOLD = 512 * MIB
COMPUTE_TRIM_THRESHOLD = 1 * GIB


def default_kv_cache_bytes(total_memory: int, engine_workers: int) -> int:
    """The KV budget of one engine worker when none is configured."""
    share = int(total_memory * KV_SHARE_OF_MEMORY) // max(engine_workers, 1)
    return max(MIN_DEFAULT_KV, min(share, MAX_DEFAULT_KV))


STORE_SHARE_OF_MEMORY = 1 / 32
MIN_DEFAULT_STORE = 256 * MIB


def default_store_bytes(total_memory: int, engine_workers: int) -> int:
    """The DRAM segment each engine worker's store node pools under `mooncake up` when none
    is configured: a 32nd of the machine over the engine workers (at least 256 MiB), so
    a segment holds a whole long prompt (an 8k-token SmolLM2 prompt's KV is 352 MiB; on 24
    GiB with `up`'s 2 engine workers a segment is 384 MiB). It is pre-touched at start: idle, a
    SmolLM2 worker holds its weights, the runtime and this (~1.3 GiB here)."""
    share = int(total_memory * STORE_SHARE_OF_MEMORY) // max(engine_workers, 1)
    return max(MIN_DEFAULT_STORE, min(share, MAX_DEFAULT_KV))


def machine_memory() -> int:
    return int(psutil.virtual_memory().total)


def bound_bytes(weights_bytes: int, kv_budget_bytes: int, store_segment_bytes: int = 0) -> int:
    """The most a prefill or decode worker may hold resident: weights, its KV pool, the DRAM
    segment its embedded store node pools (`store.dram_bytes`, shared memory its peers map
    too), and the allowance for everything else."""
    return weights_bytes + kv_budget_bytes + store_segment_bytes + OTHER_ALLOWANCE


def control_parts(role: str, settings: Settings) -> dict[str, int]:
    """What a control-plane role may hold, by part (bytes); their sum is its bound."""
    from mooncake.bus.consume import window_bytes

    window = window_bytes(settings.bus)
    parts = {"runtime": CONTROL_ALLOWANCE}
    if role == "gateway":
        from mooncake.gateway.inflight import memory_parts

        parts |= memory_parts(settings.gateway)
    elif role == "conductor":
        from mooncake.serving.conductor_setup import memory_parts as conductor_parts

        parts |= conductor_parts(settings) | {"consumers": 2 * window}
    elif role == "recorder":
        parts["consumers"] = 3 * window  # requests, metadata, dead letters
    elif role == "store_master":
        from mooncake.store.master import memory_parts as master_parts

        parts |= master_parts(settings.store)
    else:
        raise ValueError(f"{role!r} is no control-plane role ({', '.join(CONTROL_ROLES)})")
    return parts


def control_bound_bytes(role: str, settings: Settings) -> int:
    return sum(control_parts(role, settings).values())


def state_control_bound(role: str, settings: Settings) -> int:
    """Log the role's bound by part at start (as an engine worker logs its own); the bound."""
    parts = control_parts(role, settings)
    bound = sum(parts.values())
    said = " + ".join(f"{name} {size / MIB:.0f} MiB" for name, size in parts.items())
    log.info("memory: %s = bound %.0f MiB", said, bound / MIB)
    return bound


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(lib, "mallopt") or not hasattr(lib, "malloc_trim"):
        return None  # not glibc (musl, macOS): its allocator behaves otherwise
    return lib


def keep_heap_small() -> bool:
    """Map every allocation of 1 MiB or more on its own (unmapped when freed) instead of
    letting glibc's threshold climb; True if set (glibc only)."""
    lib = _libc()
    return bool(lib is not None and lib.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))


_compute_lock = threading.Lock()
_computing = 0
_window_off = False  # `mapped_temporaries`: the baseline a benchmark measures against


@contextlib.contextmanager
def mapped_temporaries() -> Iterator[None]:
    """`compute_heap` does nothing inside this (every large temporary mapped on its own, as
    before it): what `bench engine` measures it against in the same run."""
    global _window_off
    before, _window_off = _window_off, True
    try:
        yield
    finally:
        _window_off = before


@contextlib.contextmanager
def compute_heap() -> Iterator[None]:
    """While a prefill computes: take its temporaries from the heap and keep what it frees
    there for the next layer, then give the free heap back to the OS (`release_free_heap`)
    and map large blocks on their own again (`keep_heap_small`).

    With every block of 1 MiB or more mapped on its own, each of a prefill's temporaries
    (an MLP's activations, a dequantized weight) was a fresh mapping the OS faults in page by
    page and unmaps when freed: 1.2 million page faults in a 2,048-token SmolLM2 prefill,
    a third of its time. Measured in the same process: 5.7-6.4 s -> 3.9-4.1 s
    (2026-11-28). Nested and concurrent uses share one window (a count); glibc only."""
    global _computing
    lib = _libc()
    if lib is None or _window_off:
        yield
        return
    with _compute_lock:
        _computing += 1
        if _computing == 1:
            lib.mallopt(M_MMAP_THRESHOLD, COMPUTE_MMAP_THRESHOLD)
            lib.mallopt(M_TRIM_THRESHOLD, COMPUTE_TRIM_THRESHOLD)
    try:
        yield
    finally:
        with _compute_lock:
            _computing -= 1
            if _computing == 0:
                lib.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
                lib.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
                lib.malloc_trim(0)


@contextlib.asynccontextmanager
async def compute_window() -> AsyncIterator[None]:
    """`compute_heap` around a piece of a worker's async work (a prefill and its hand-over,
    a CPP stage): the engine's own windows inside it nest, so the heap is given back once,
    when the work is done (not on the way to its first token), and in a worker thread (the
    trim of a 2,048-token prefill's heap takes ~10 ms)."""
    window = compute_heap()
    window.__enter__()
    try:
        yield
    finally:
        await asyncio.to_thread(window.__exit__, None, None, None)


def release_free_heap() -> None:
    """Give the free memory of every malloc arena back to the OS (after a model load, after
    each prefill): glibc keeps freed chunks under the mmap threshold resident, and a prefill
    frees hundreds of MiB of them (layer pieces on their way to the store, the engine's
    temporaries) in the arenas of the threads that allocated them."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)
