"""KVCache capacity in whole 512-token blocks: an LRU set of block keys per node.

`insert` returns the keys it evicted so the caller can tell the Conductor's block index
(`BlocksRemoved`), exactly as the store's eviction events would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LRUBlocks:
    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def prefix_blocks(self, keys: Sequence[str]) -> int:
        """Leading keys held here (chained keys: a hole ends the prefix)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[str]) -> list[str]:
        """Store (or refresh) `keys` as most recently used; evict LRU beyond capacity."""
        cache = self._keys
        for k in keys:
            cache[k] = None
            cache.move_to_end(k)
        evicted: list[str] = []
        if self.capacity is not None:
            while len(cache) > self.capacity:
                evicted.append(cache.popitem(last=False)[0])
        return evicted
