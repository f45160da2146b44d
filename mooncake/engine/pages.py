"""The bookkeeping of a paged KV pool: which pages are free, who holds each page, and which
whole prompt blocks stay cached after their last user left. No tensors here (see
`engine.pool` for the memory): plain integers, so the laws are easy to test.

- A page is free, held (refcount >= 1: sequences using it), or idle (refcount 0 but part of
  a cached block, kept for the next request with that prefix).
- `alloc(n)` takes free pages first, then evicts idle blocks, least recently used first. It
  returns None when even that is not enough: asking is a value, never an exception.
- `publish(key, pages)` makes pages a cached block under its chained-hash key, so later
  sequences with the same prefix `lookup` it and share the pages (refcounted) instead of
  loading or computing them again. A block's pages are never written once published (the
  engine writes only at positions past a sequence's whole blocks).
- `cached_keys()` is what the worker announces to the Conductor's index as this instance's
  engine tier (`serving.engine_tier`).

Thread-safe: the engine thread and the event loop both allocate and release.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PageAllocator:
    def __init__(self, pages: int) -> None:
        if pages < 1:
            raise ValueError("a pool needs at least one page")
        self.total = pages
        self._free: list[int] = list(range(pages - 1, -1, -1))  # a stack: low ids first
        self._refs = [0] * pages
        self._block_of: dict[int, str] = {}  # page -> key of the cached block it belongs to
        self._blocks: dict[str, tuple[int, ...]] = {}  # key -> its pages
        self._idle: OrderedDict[str, None] = OrderedDict()  # unreferenced blocks, LRU first
        self._idle_pages = 0
        self._lock = threading.Lock()

    # --- counts ---------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Pages no one holds and no cached block keeps."""
        return len(self._free)

    @property
    def idle(self) -> int:
        """Pages of cached blocks no one holds (evicted when pages are needed)."""
        return self._idle_pages

    @property
    def available(self) -> int:
        """Pages `alloc` can hand out now: free plus evictable."""
        with self._lock:
            return len(self._free) + self._idle_pages

    @property
    def used(self) -> int:
        """Pages held by at least one sequence."""
        return self.total - self.available

    def cached_keys(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def refs(self, page: int) -> int:
        return self._refs[page]

    # --- pages ----------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """n pages held once by the caller, or None if the pool cannot give that many."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        with self._lock:
            if len(self._free) + self._idle_pages < n:
                return None
            while len(self._free) < n:
                self._evict_one()
            out = [self._free.pop() for _ in range(n)]
            for p in out:
                self._refs[p] = 1
            return out

    def retain(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                self._retain(p)

    def release(self, pages: Iterable[int]) -> None:
        """Drop one hold on each page; a page no one holds is freed, or kept idle when it
        belongs to a cached block."""
        with self._lock:
            touched: set[str] = set()
            for p in pages:
                if self._refs[p] < 1:
                    raise ValueError(f"page {p} released more often than held")
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    key = self._block_of.get(p)
                    if key is None:
                        self._free.append(p)
                    else:
                        touched.add(key)
            for key in touched:
                if all(self._refs[q] == 0 for q in self._blocks[key]):
                    self._idle[key] = None
                    self._idle_pages += len(self._blocks[key])

    # --- cached blocks ----------------------------------------------------------------------

    def lookup(self, key: str) -> tuple[int, ...] | None:
        """The pages of cached block `key`, now held once more by the caller; None if the
        pool does not have it."""
        with self._lock:
            pages = self._blocks.get(key)
            if pages is None:
                return None
            for p in pages:
                self._retain(p)
            return pages

    def contains(self, key: str) -> bool:
        return key in self._blocks

    def publish(self, key: str, pages: Sequence[int]) -> bool:
        """Keep `pages` (held by the caller, fully written) as cached block `key`. False
        (and nothing changes) if the key is cached already or a page belongs to a block."""
        with self._lock:
            if key in self._blocks or not pages:
                return False
            if any(self._refs[p] < 1 or p in self._block_of for p in pages):
                return False
            self._blocks[key] = tuple(pages)
            for p in pages:
                self._block_of[p] = key
            return True

    def evict_idle(self) -> int:
        """Evict every cached block no one holds (all of the pool's idle cache); returns how
        many pages that freed."""
        with self._lock:
            freed = self._idle_pages
            while self._idle:
                self._evict_one()
            return freed

    # --- internals --------------------------------------------------------------------------

    def _retain(self, p: int) -> None:
        if self._refs[p] == 0:
            key = self._block_of.get(p)
            if key is None:
                raise ValueError(f"page {p} is free: allocate it, do not retain it")
            if key in self._idle:
                del self._idle[key]
                self._idle_pages -= len(self._blocks[key])
        self._refs[p] += 1

    def _evict_one(self) -> None:
        key, _ = self._idle.popitem(last=False)
        pages = self._blocks.pop(key)
        self._idle_pages -= len(pages)
        for p in pages:
            del self._block_of[p]
            self._free.append(p)
