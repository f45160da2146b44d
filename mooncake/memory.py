"""A worker's memory: the default KV budget, the bound a worker states at start, and a C heap
that gives freed memory back.

KV budget. Every engine worker (prefill, decode) allocates one KV pool from its budget
(`Settings.kv_cache_bytes`, `MOONCAKE_KV_CACHE_BYTES`, `--kv-cache-bytes`). Unset, it is a
quarter of the machine's memory split over the engine workers that run on it (`mooncake up`
passes its own count; a worker started alone assumes it is the only one). A quarter, because
each engine worker also holds its model's weights (twice on the CPU: the oneDNN-packed copy
the GEMMs read), its store node's DRAM segment and the runtime, and the machine has other
processes; clamped to [512 MiB, 64 GiB].

Stated bound. A worker logs at start what it may come to hold: weights + KV budget + its store
node's DRAM segment + a fixed allowance for everything else (the runtime, transients).
`mooncake bench memory` reports every role's peak against it (and against issue 15's
weights + KV + 600 MiB). RSS counts a shared page once in every process that maps it (the
shm transport maps the peers' segments it copies from), so the check on this bound is on
PSS, which counts each shared page as a share per process.

Heap. glibc raises its mmap threshold each time a large block is freed, after which
allocations up to 32 MiB come from the heap, whose freed memory is rarely returned: loading
a GGUF model (dequantizing tensor by tensor) left ~440 MiB of free heap resident in every
worker. `keep_heap_small` fixes the threshold so large blocks are always mapped (and unmapped
when freed), and `release_free_heap` trims what the loader left behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import psutil

log = logging.getLogger("mooncake.memory")

MIB, GIB = 1 << 20, 1 << 30
KV_SHARE_OF_MEMORY = 0.25
MIN_DEFAULT_KV = 512 * MIB
MAX_DEFAULT_KV = 64 * GIB
# Beyond weights, KV and the store segment: torch's runtime (~280 MiB resident here, ~210 of
# it its libraries), Python, and a prefill's activations (issue 15's figure).
OTHER_ALLOWANCE = 600 * MIB
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
HEAP_MMAP_THRESHOLD = 1 * MIB


def default_kv_cache_bytes(total_memory: int, engine_workers: int) -> int:
    """The KV budget of one engine worker when none is configured."""
    share = int(total_memory * KV_SHARE_OF_MEMORY) // max(engine_workers, 1)
    return max(MIN_DEFAULT_KV, min(share, MAX_DEFAULT_KV))


STORE_SHARE_OF_MEMORY = 1 / 16
MIN_DEFAULT_STORE = 256 * MIB


def default_store_bytes(total_memory: int, engine_workers: int) -> int:
    """The DRAM segment each engine worker's store node pools under `mooncake up` when none
    is configured: a sixteenth of the machine over the engine workers (at least 256 MiB), so
    a segment holds a whole long prompt (an 8k-token SmolLM2 prompt's KV is 352 MiB; on 24
    GiB with 4 engine workers a segment is 376 MiB). It is pre-touched at start: idle, a
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
