"""Byte-range allocator for one segment: best fit over a sorted free list, with coalescing.

The master owns one per mounted segment and never touches bytes. Sizes are rounded up to
`alignment` so every offset stays aligned (transports and O_DIRECT-style SSD I/O like that).

Free ranges are kept twice: by start (to find neighbours when freeing, O(log n)) and by
(length, start) (best fit is the first entry >= the request, O(log n)); the list inserts are
memmoves, cheap up to hundreds of thousands of fragments.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class Allocator:
    def __init__(self, size: int, alignment: int = 64) -> None:
        if size <= 0 or alignment <= 0:
            raise ValueError(f"bad allocator size={size} alignment={alignment}")
        self.size = size
        self.alignment = alignment
        self._starts: list[int] = [0]  # free range starts, sorted
        self._length: dict[int, int] = {0: size}  # free range start -> length
        self._by_size: list[tuple[int, int]] = [(size, 0)]  # (length, start), sorted
        self._live: dict[int, int] = {}  # allocated offset -> aligned length
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def aligned(self, n: int) -> int:
        return align_up(n, self.alignment)

    def allocated(self, offset: int) -> int | None:
        """The aligned length allocated at `offset`, or None."""
        return self._live.get(offset)

    def allocate(self, n: int) -> int | None:
        if n <= 0:
            raise ValueError(f"allocation of {n} bytes")
        need = self.aligned(n)
        i = bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._take(start, length)
        if length > need:
            self._put(start + need, length - need)
        self._live[start] = need
        self.used += need
        return start

    def reserve(self, offset: int, n: int) -> bool:
        """Allocate exactly [offset, offset+aligned(n)) if it is entirely free (restore after a
        master restart adopts ranges a node reports). False if misaligned, out of range or
        overlapping a live allocation."""
        if n <= 0 or offset < 0 or offset % self.alignment:
            return False
        need = self.aligned(n)
        i = bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        length = self._length[start]
        end = offset + need
        if end > start + length:
            return False
        self._take(start, length)
        if offset > start:
            self._put(start, offset - start)
        if start + length > end:
            self._put(end, start + length - end)
        self._live[offset] = need
        self.used += need
        return True

    def free(self, offset: int) -> None:
        length = self._live.pop(offset, None)
        if length is None:
            raise ValueError(f"free of offset {offset}: not allocated")
        self.used -= length
        start, end = offset, offset + length
        i = bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == end:  # coalesce with the right neighbour
            right = self._starts[i]
            end += self._length[right]
            self._take(right, self._length[right])
        if i > 0:  # ... and with the left one
            left = self._starts[i - 1]
            if left + self._length[left] == start:
                start = left
                self._take(left, self._length[left])
        self._put(start, end - start)

    def free_ranges(self) -> list[tuple[int, int]]:
        return [(s, self._length[s]) for s in self._starts]

    def live_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._live.items())

    def _put(self, start: int, length: int) -> None:
        insort(self._starts, start)
        self._length[start] = length
        insort(self._by_size, (length, start))

    def _take(self, start: int, length: int) -> None:
        del self._starts[bisect_left(self._starts, start)]
        del self._length[start]
        del self._by_size[bisect_left(self._by_size, (length, start))]
