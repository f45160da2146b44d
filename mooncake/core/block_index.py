"""The global block index: which nodes hold which KV block key (PAPER.md §2-§3).

Keys are chained (`mooncake.hashing`), so "the longest prefix of a prompt held by node X"
is a walk along the prompt's key chain that stops at the first key X does not hold, and
"the longest prefix anywhere in the pool" stops at the first key nobody holds.

Built for millions of keys: each key maps to an *interned* frozenset of holder nodes, so
the hundreds of thousands of keys with the same holders share one set object and the index
costs one dict slot per key. Which holders keep a key only on SSD (offloaded, PAPER.md §2) is
a second, usually much smaller map of the same kind: a read from there costs the SSD's time,
not DRAM's. Mutable by design (copying a million-entry map per update would
be O(N)); owned by one `ClusterView` and changed only through its `apply`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_EMPTY: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Where a key chain's prefix lives.

    `best_blocks`: leading blocks held somewhere in the pool (possibly spread over nodes).
    `node_blocks`: for each node holding at least the first block, its longest local prefix.
    `full_holders`: nodes that hold all `best_blocks` themselves (a single-source transfer).
    """

    best_blocks: int
    node_blocks: dict[str, int]
    full_holders: frozenset[str]

    def local_blocks(self, node: str) -> int:
        return self.node_blocks.get(node, 0)


NO_MATCH = PrefixMatch(0, {}, _EMPTY)


class BlockIndex:
    """`max_keys`: the most keys it holds (its memory bound); a new key past it is not
    indexed (`refused` counts them): a cache miss for the prompts that would have used it,
    never a hit on a block that is not there."""

    def __init__(self, max_keys: int | None = None) -> None:
        self.max_keys = max_keys
        self.refused = 0
        self._holders: dict[str, frozenset[str]] = {}
        # key -> the holders that keep it only on SSD (a subset of its holders)
        self._ssd: dict[str, frozenset[str]] = {}
        self._interned: dict[frozenset[str], frozenset[str]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def _intern(self, holders: frozenset[str]) -> frozenset[str]:
        return self._interned.setdefault(holders, holders)

    def keys(self) -> list[str]:
        """Every key some node holds (O(index): for checks and benches, not decisions)."""
        return list(self._holders)

    def holders(self, key: str) -> frozenset[str]:
        return self._holders.get(key, _EMPTY)

    def add(self, node: str, keys: Iterable[str]) -> None:
        one = self._intern(frozenset((node,)))
        index = self._holders
        room = None if self.max_keys is None else self.max_keys - len(index)
        for key in keys:
            old = index.get(key)
            if old is None:
                if room is not None:
                    if room <= 0:
                        self._refuse()
                        continue
                    room -= 1
                index[key] = one
            elif node not in old:
                index[key] = self._intern(old | one)

    def _refuse(self) -> None:
        if not self.refused:
            log.warning(
                "KV index full (%d keys): blocks past it are not indexed (cache misses); "
                "raise conductor.max_index_keys if memory allows", self.max_keys,
            )  # fmt: skip
        self.refused += 1

    def remove(self, node: str, keys: Iterable[str]) -> None:
        index = self._holders
        for key in keys:
            old = index.get(key)
            if old is None or node not in old:
                continue
            if len(old) == 1:
                del index[key]
            else:
                index[key] = self._intern(old - {node})
            if self._ssd:
                self._unmark(self._ssd, node, key)

    def to_ssd(self, node: str, keys: Iterable[str]) -> None:
        """`node` now keeps these keys (those it holds) only on SSD."""
        one = self._intern(frozenset((node,)))
        ssd = self._ssd
        for key in keys:
            if node not in self._holders.get(key, _EMPTY):
                continue
            old = ssd.get(key)
            if old is None:
                ssd[key] = one
            elif node not in old:
                ssd[key] = self._intern(old | one)

    def to_dram(self, node: str, keys: Iterable[str]) -> None:
        """`node` holds these keys in DRAM again (a promotion)."""
        if self._ssd:
            for key in keys:
                self._unmark(self._ssd, node, key)

    def _unmark(self, table: dict[str, frozenset[str]], node: str, key: str) -> None:
        old = table.get(key)
        if old is None or node not in old:
            return
        if len(old) == 1:
            del table[key]
        else:
            table[key] = self._intern(old - {node})

    def ssd_holders(self, key: str) -> frozenset[str]:
        """The holders of `key` that keep it only on SSD."""
        return self._ssd.get(key, _EMPTY)

    @property
    def has_ssd(self) -> bool:
        """Whether any holder keeps any key only on SSD."""
        return bool(self._ssd)

    def pool_ssd_blocks(
        self, keys: Sequence[str], lo: int, hi: int, exclude: frozenset[str] = frozenset()
    ) -> int:
        """How many of `keys[lo:hi]` no node (outside `exclude`) holds in DRAM: a fetch of
        them from the pool reads an SSD."""
        ssd = self._ssd
        if not ssd or hi <= lo:
            return 0
        n = 0
        for key in keys[lo:hi]:
            on_ssd = ssd.get(key)
            if on_ssd is not None and not (self._holders.get(key, _EMPTY) - exclude - on_ssd):
                n += 1
        return n

    def drop_node(self, node: str) -> int:
        """Forget every block of a lost node: O(index) — rare (a node failure), so the index
        keeps no node -> keys reverse map (that would double its memory)."""
        affected = [k for k, h in self._holders.items() if node in h]
        self.remove(node, affected)
        return len(affected)

    def match(self, keys: Sequence[str], exclude: frozenset[str] = frozenset()) -> PrefixMatch:
        """Longest prefix of `keys` in the pool and on every node that holds part of it;
        the blocks of nodes in `exclude` (whose index is not exact) count as not there."""
        if exclude:
            return self._match_without(keys, exclude)
        index = self._holders
        first = index.get(keys[0]) if keys else None
        if first is None:
            return NO_MATCH
        alive = first
        node_blocks: dict[str, int] = {}
        best = 1
        for i in range(1, len(keys)):
            held = index.get(keys[i])
            if held is None:
                break
            best = i + 1
            if held is not alive and alive:
                kept = alive & held
                if len(kept) != len(alive):
                    for node in alive - kept:
                        node_blocks[node] = i
                    alive = kept
        # Nodes alive to the end hold all `best` blocks; of those we must say which.
        for node in alive:
            node_blocks[node] = best
        return PrefixMatch(best, node_blocks, alive)

    def _match_without(self, keys: Sequence[str], exclude: frozenset[str]) -> PrefixMatch:
        """`match` over the holders less `exclude` (rare: while a node resyncs)."""
        best, node_blocks, alive = 0, {}, frozenset[str]()
        for i, key in enumerate(keys):
            held = self._holders.get(key, frozenset()) - exclude
            if not held:
                break
            if i == 0:
                alive = held
            else:
                for node in alive - held:
                    node_blocks[node] = i
                alive = alive & held
            best = i + 1
        if not best:
            return NO_MATCH
        for node in alive:
            node_blocks[node] = best
        return PrefixMatch(best, node_blocks, alive)
