"""`memory.compute_heap`: inside the window a prefill's large temporaries are reused from
the heap layer after layer, where outside it each is a fresh mapping faulted in page by
page; the window nests, also in a worker's async window (`compute_window`);
`mapped_temporaries` turns it off (the benchmark's baseline). Run in child processes: the
allocator's settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mooncake import memory

LAYERS = r"""
import ctypes, ctypes.util, json, resource, sys, torch
from mooncake import memory

memory.keep_heap_small()  # as a worker runs between prefills

def layers(n=30):
    # a prefill's pattern: every layer allocates temporaries of a few MiB, writes and frees
    # them; minor page faults over the n layers
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = torch.ones(3 << 20)   # 12 MiB
        b = torch.ones(1 << 20)   # 4 MiB
        c = a[: 1 << 20] + b      # 4 MiB
        del a, b, c
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2

def mapped_on_its_own(mib):
    # a block larger than any the process freed before (no free chunk of the heap can hold
    # it): is it a mapping of its own (glibc's count of mapped bytes grows by it) or heap?
    before = libc.mallinfo2().hblkhd
    t = torch.ones(mib << 18)
    grown = libc.mallinfo2().hblkhd - before
    del t
    return grown >= mib << 20

out = {}
if sys.argv[1] == "window":
    out["outside"] = layers()
    with memory.compute_heap():
        with memory.compute_heap():  # nested: one window
            out["inside"] = layers()
        out["inner_closed"] = layers()  # the outer window is still open
        out["open"] = memory._computing
    out["closed"] = memory._computing
elif sys.argv[1] == "async":
    import asyncio

    async def work():
        async with memory.compute_window():  # a worker's window over its piece of work
            with memory.compute_heap():  # the engine's own, inside it
                out["engine"] = layers()
            out["after_engine"] = layers()  # the engine's window closed: the worker's holds
            out["mapped_open"] = mapped_on_its_own(32)
            out["open"] = memory._computing
        out["closed"] = memory._computing
        out["mapped_closed"] = mapped_on_its_own(256)

    asyncio.run(work())
else:
    with memory.mapped_temporaries(), memory.compute_heap():
        out["off"] = layers()
print(json.dumps(out))
"""
FRESH = 30 * (20 << 20 >> 12)  # 30 layers of 20 MiB in 4 KiB pages, each a fresh mapping


def _child(mode: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", LAYERS, mode], capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(memory._libc() is None, reason="glibc only")
def test_the_window_reuses_the_heap_layer_after_layer_and_nests() -> None:
    f = _child("window")
    assert f["outside"] > FRESH // 2, f  # mapped one by one: faulted in every layer
    assert f["inside"] < f["outside"] // 5, f  # reused from the heap
    assert f["inner_closed"] < f["outside"] // 5, f  # nested: still one window
    assert (f["open"], f["closed"]) == (1, 0), f


@pytest.mark.skipif(memory._libc() is None, reason="glibc only")
def test_a_workers_window_holds_the_heap_across_the_engines_until_its_work_is_done() -> None:
    f = _child("async")
    # The window's first layers grow the heap once (~11k faults here, 17k once on CI: the
    # first torch calls of the process are among them); mapped one by one it is ~150k.
    assert f["engine"] < FRESH // 5, f
    assert f["after_engine"] < FRESH // 10, f  # not trimmed when the engine's window closed
    assert (f["open"], f["closed"]) == (1, 0), f
    # Closed: large blocks are mapped on their own again. (Not asserted by the layers' faults
    # after the work: what the process allocated during the window may sit above the freed
    # temporaries, and the hole below it, given back by the trim, serves later temporaries of
    # its size from the heap: 35k-154k faults here from run to run, in a few classes.)
    assert (f["mapped_open"], f["mapped_closed"]) == (False, True), f


@pytest.mark.skipif(memory._libc() is None, reason="glibc only")
def test_mapped_temporaries_is_the_baseline_without_the_window() -> None:
    assert _child("off")["off"] > FRESH // 2
