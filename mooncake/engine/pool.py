"""One KV pool per engine, allocated once from a byte budget, in pages of a fixed token count.

Memory: one tensor [layers, 2, pages, kv_heads * page_tokens * head_dim], allocated when the
engine is built and never grown. Per layer, a page holds K transposed ([kv_heads, head_dim,
page_tokens]: the paged decode kernel's layout, see `engine.native`) and V as [kv_heads,
page_tokens, head_dim]. The allocation is not pre-touched: the kernel maps pages of it as
they are first written, so a worker's resident memory grows with the KV it actually held,
up to the budget and never past it. On Linux it is backed by transparent huge pages where
the kernel allows (`madvise`), which halves the TLB misses of reading pages scattered over
gigabytes.

Sequences hold pages through a `PagedKV` (their block table); the pool's `PageAllocator`
(engine.pages) counts who holds what, keeps finished prompts' whole blocks cached for
prefix sharing, and evicts them LRU when pages are needed.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine import native
from mooncake.engine.errors import EngineError
from mooncake.engine.pages import PageAllocator
from mooncake.engine.spec import ModelSpec

log = logging.getLogger("mooncake.engine.pool")

DEFAULT_PAGE_TOKENS = 16
# The element types the native kernels (engine.native) read a CPU pool in: float32, or
# bfloat16 (half the bytes a decode step reads and a store block carries).
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16)
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


class KVPoolExhausted(Exception):
    """The pool cannot give the pages a computation needs (callers ask first: `fits`)."""


def page_tokens_for(block_tokens: int, preferred: int = DEFAULT_PAGE_TOKENS) -> int:
    """The page size: the largest divisor of the store's block size up to `preferred`, so a
    block is always whole pages."""
    return math.gcd(block_tokens, preferred)


def pages_for(tokens: int, page_tokens: int) -> int:
    return -(-tokens // page_tokens)


@dataclass(frozen=True, slots=True)
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype

    @classmethod
    def of(cls, spec: ModelSpec, dtype: torch.dtype, page_tokens: int) -> PoolShape:
        return cls(spec.layers, spec.kv_heads, spec.head_dim, page_tokens, dtype)

    @property
    def page_elems(self) -> int:
        """Elements of one page's K (or V) in one layer."""
        return self.kv_heads * self.page_tokens * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer, K and V."""
        return self.layers * 2 * self.page_elems * self.dtype.itemsize

    def pages_in(self, budget_bytes: int) -> int:
        return budget_bytes // self.page_bytes


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros that cost no memory until written: on the CPU an anonymous mapping (the OS
    hands out zero pages on first touch; `torch.zeros` would write, and so map, all of it).
    Zeros, not garbage: a masked position still enters attention's matmul with V, and 0
    times a NaN left in recycled memory is NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    # Private: Python's default for an anonymous map is MAP_SHARED, which the kernel counts
    # as shared memory (and keeps out of transparent huge pages); the pool is this process's.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    area = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=flags)
    t = torch.frombuffer(area, dtype=dtype, count=count).view(shape)
    _madvise_huge(t)
    return t


def _madvise_huge(t: Tensor) -> None:
    if t.device.type != "cpu":
        return
    try:
        libc = ctypes.CDLL(None)
        start = t.data_ptr()
        aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
        length = (start + t.numel() * t.element_size() - aligned) // HUGE_PAGE * HUGE_PAGE
        if length > 0:
            libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), MADV_HUGEPAGE)
    except (OSError, AttributeError):  # not Linux: ordinary pages
        pass


class KVPool:
    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        *,
        budget_bytes: int,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
    ) -> None:
        self.shape = PoolShape.of(spec, dtype, page_tokens)
        self.spec, self.dtype, self.device = spec, dtype, device
        self.page_tokens = page_tokens
        pages = self.shape.pages_in(budget_bytes)
        if pages < 1:
            raise EngineError(
                f"a KV budget of {budget_bytes} bytes holds no page "
                f"({self.shape.page_bytes} bytes each)"
            )
        s = self.shape
        self.data = _zeroed((s.layers, 2, pages, s.page_elems), dtype, device)
        self.pages = PageAllocator(pages)
        self._k = [self.data[i, 0].view(pages, s.kv_heads, s.head_dim, s.page_tokens)
                   for i in range(s.layers)]  # fmt: skip
        self._v = [self.data[i, 1].view(pages, s.kv_heads, s.page_tokens, s.head_dim)
                   for i in range(s.layers)]  # fmt: skip
        # Every layer's at once (the native block copy's view)
        self._k_all = self.data[:, 0].view(s.layers, pages, s.kv_heads, s.head_dim, s.page_tokens)
        self._v_all = self.data[:, 1].view(s.layers, pages, s.kv_heads, s.page_tokens, s.head_dim)

    def prefault(self) -> None:
        """Map every page now (write its zeros): a prefill that takes pages never touched
        pays their first-touch faults inside its own time, ~0.4 s of a 2 s, 3,000-token
        SmolLM2 prefill on a 2-vCPU Xeon while the pool is still filling (issue 42). The
        pool is then resident at its budget from the start, as the worker states."""
        if self.device.type != "cpu":
            return
        flat = self.data.view(-1)
        step = 1 << 24  # elements a write (64 MiB of float32)
        for start in range(0, flat.numel(), step):
            flat[start : start + step].zero_()

    @property
    def capacity_tokens(self) -> int:
        return self.pages.total * self.page_tokens

    @property
    def budget_bytes(self) -> int:
        return self.pages.total * self.shape.page_bytes

    def k(self, layer: int) -> Tensor:
        """[pages, kv_heads, head_dim, page_tokens]: K, transposed within a page."""
        return self._k[layer]

    def v(self, layer: int) -> Tensor:
        """[pages, kv_heads, page_tokens, head_dim]."""
        return self._v[layer]

    @property
    def native_kv(self) -> bool:
        """Whether the native kernels read this pool: on the CPU, of NATIVE_KV_DTYPES."""
        return self.device.type == "cpu" and self.dtype in NATIVE_KV_DTYPES

    @property
    def kv_bf16(self) -> bool:
        """Whether the pool holds bfloat16 (the native kernels' KV_BF16 build reads it)."""
        return self.dtype == torch.bfloat16

    def fits(self, tokens: int) -> bool:
        """Could a new sequence of `tokens` tokens get its pages now?"""
        return pages_for(tokens, self.page_tokens) <= self.pages.available

    def sequence(self) -> PagedKV:
        return PagedKV(self)

    # --- token-level I/O ---------------------------------------------------------------------

    def locate(self, pages: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        """(page id, offset) of positions start..end-1 of a sequence with block table
        `pages` (a 1-D long tensor on the pool's device)."""
        pos = torch.arange(start, end, device=self.device)
        return pages[pos // self.page_tokens], pos % self.page_tokens

    @torch.inference_mode()
    def write(self, layer: int, page: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] of N tokens at (page[i], offset[i])."""
        self._k[layer][page, :, :, offset] = k.to(self.dtype)
        self._v[layer][page, :, offset, :] = v.to(self.dtype)

    @torch.inference_mode()
    def read(self, layer: int, pages: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K, V [kv_heads, end - start, head_dim] of positions start..end-1 (a copy)."""
        p = self.page_tokens
        first, last = start // p, pages_for(end, p)
        idx = pages[first:last]
        k = self._k[layer][idx].permute(1, 0, 3, 2).reshape(self.shape.kv_heads, -1,
                                                               self.shape.head_dim)  # fmt: skip
        v = self._v[layer][idx].transpose(0, 1).reshape(self.shape.kv_heads, -1,
                                                         self.shape.head_dim)  # fmt: skip
        lo = start - first * p
        return k[:, lo : lo + end - start], v[:, lo : lo + end - start]

    # --- block-level I/O (the store's byte layout, engine.kv) --------------------------------

    @torch.inference_mode()
    def read_blocks(self, layer: int, pages: Tensor, tokens: int) -> Tensor:
        """Layer `layer` of consecutive blocks of `tokens` tokens each, whose pages are
        `pages` (block-major), as [blocks, 2, kv_heads, tokens, head_dim] (a new tensor)."""
        s, per = self.shape, tokens // self.page_tokens
        n = pages.numel() // per
        k = self._k[layer][pages].view(n, per, s.kv_heads, s.head_dim, s.page_tokens)
        v = self._v[layer][pages].view(n, per, s.kv_heads, s.page_tokens, s.head_dim)
        k = k.permute(0, 2, 1, 4, 3).reshape(n, s.kv_heads, tokens, s.head_dim)
        v = v.permute(0, 2, 1, 3, 4).reshape(n, s.kv_heads, tokens, s.head_dim)
        return torch.stack((k, v), dim=1)

    def _block_writer(self) -> native.BlockWriter | None:
        """The native block copy (`native_kv` pools), or None: torch's copies."""
        if not self.native_kv:
            return None
        return native.load_block_writer(self.shape.head_dim, self.page_tokens, self.kv_bf16)

    @torch.inference_mode()
    def write_blocks(self, layer: int, pages: Tensor, blocks: Tensor) -> None:
        """The inverse of `read_blocks`: blocks [n, 2, kv_heads, tokens, head_dim] (any
        dtype, any device) into `pages` (block-major, tokens / page_tokens per block)."""
        self._write(slice(layer, layer + 1), pages, blocks[None])

    @torch.inference_mode()
    def write_layers(self, pages: Tensor, blocks: Tensor) -> None:
        """`write_blocks` for every layer at once: blocks [layers, n, 2, kv_heads, tokens,
        head_dim] (a cached prefix's blocks as the store holds them, n of them stacked)."""
        self._write(slice(0, self.shape.layers), pages, blocks)

    def _write(self, layers: slice, pages: Tensor, blocks: Tensor) -> None:
        _, n, _, heads, tokens, dim = blocks.shape
        per = tokens // self.page_tokens
        if tokens % self.page_tokens or pages.numel() != n * per:
            raise EngineError(f"{pages.numel()} pages for {n} blocks of {tokens} tokens")
        if pages.numel() and not 0 <= int(pages.min()) <= int(pages.max()) < self.pages.total:
            raise EngineError(f"pages outside the pool ({self.pages.total} pages)")
        src = blocks.to(device=self.device, dtype=self.dtype)
        writer = self._block_writer()
        if writer is not None and src.stride()[2:] == (heads * tokens * dim, tokens * dim, dim, 1):
            at = pages.to(torch.int32).contiguous()
            return writer(src, at, self._k_all[layers], self._v_all[layers])
        # Block by block, each page's K and V copied once from the block's strided view
        # (as one reshaped tensor they were copied twice: 7 % slower for a 1,792-token prefix).
        for i, layer in enumerate(range(layers.start, layers.stop)):
            split = src[i].view(n, 2, heads, per, self.page_tokens, dim)
            for j in range(n):
                at = pages[j * per : (j + 1) * per]
                self._k[layer].index_copy_(0, at, split[j, 0].permute(1, 0, 3, 2))
                self._v[layer].index_copy_(0, at, split[j, 1].permute(1, 0, 2, 3))


class PagedKV:
    """One sequence's KV in a pool: its block table (pages in order) and its length.

    The first `shared` pages came from cached blocks (other sequences may hold them too):
    they are never written. Pages are given back by `release` (also when the object is
    garbage collected, so an exception on the way cannot leak them).
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []  # never reassigned: the finalizer holds this list
        self.length = 0
        self.shared = 0
        self._table: Tensor | None = None
        self._finalizer = weakref.finalize(self, _release, pool.pages, self.pages)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_tokens

    @property
    def spec(self) -> ModelSpec:
        return self.pool.spec

    def table(self) -> Tensor:
        """The block table as a long tensor on the pool's device (cached until it grows)."""
        if self._table is None or self._table.numel() != len(self.pages):
            self._table = torch.tensor(self.pages, dtype=torch.long, device=self.pool.device)
        return self._table

    def reserve(self, tokens: int) -> bool:
        """Pages for `tokens` positions in all; False (nothing taken) if the pool lacks them."""
        need = pages_for(tokens, self.pool.page_tokens) - len(self.pages)
        if need <= 0:
            return True
        got = self.pool.pages.alloc(need)
        if got is None:
            return False
        self.pages.extend(got)
        return True

    def adopt(self, pages: tuple[int, ...] | list[int]) -> None:
        """Append pages of a cached block (already held for us by `lookup`)."""
        if len(self.pages) != self.shared:
            raise EngineError("cached blocks can only lead a sequence's pages")
        self.pages.extend(pages)
        self.shared += len(pages)
        self.length = len(self.pages) * self.pool.page_tokens

    def adopt_cached(self, keys: Sequence[str]) -> int:
        """Lead this (empty) sequence with the pool's cached blocks of `keys` (a prompt's
        chained block keys, in order) up to the first one the pool lacks: their pages are
        shared, not copied. Returns how many blocks were adopted."""
        if self.pages:
            raise EngineError("cached blocks can only lead a sequence's pages")
        n = 0
        for key in keys:
            pages = self.pool.pages.lookup(key)
            if pages is None:
                break
            self.adopt(pages)
            n += 1
        return n

    def publish_blocks(self, keys: Sequence[str], block_tokens: int) -> int:
        """Offer this sequence's whole blocks (block j under `keys[j]`, fully written) to the
        pool's cache, so later sequences with the same prefix share them; a key cached
        already keeps its pages (ours stay private). Returns how many became cached."""
        per = block_tokens // self.pool.page_tokens
        whole = min(len(keys), self.length // block_tokens)
        return sum(
            self.pool.pages.publish(keys[j], self.pages[j * per : (j + 1) * per])
            for j in range(whole)
        )

    def release(self) -> None:
        _release(self.pool.pages, self.pages)
        self.length = self.shared = 0
        self._table = None

    def read(self, layer: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K, V [kv_heads, end - start, head_dim] of positions start..end-1 (a copy)."""
        return self.pool.read(layer, self.table(), start, end)

    def layer_piece(self, layer: int, start: int, tokens: int) -> Tensor:
        """Layer `layer` of positions start..start+tokens-1 as the store's block layout
        [2, kv_heads, tokens, head_dim] (a new tensor)."""
        k, v = self.read(layer, start, start + tokens)
        return torch.stack((k, v))

    def piece(self, start: int, tokens: int) -> Tensor:
        """Every layer of positions start..start+tokens-1: [layers, 2, kv_heads, tokens,
        head_dim], a block (or a partial tail) as the store keeps it."""
        return torch.stack([self.layer_piece(i, start, tokens) for i in range(self.spec.layers)])

    def load_layer(self, layer: int, start: int, piece: Tensor) -> None:
        """Write layer `layer` of positions start..start+n-1 from `piece` [2, kv_heads, n,
        head_dim] (layer-wise loading); the pages must be reserved, `length` is unchanged."""
        n = piece.shape[2]
        if start < self.shared * self.pool.page_tokens:
            raise EngineError("cannot write into pages shared with other sequences")
        page, offset = self.pool.locate(self.table(), start, start + n)
        self.pool.write(layer, page, offset, piece[0].transpose(0, 1), piece[1].transpose(0, 1))

    def block_pages(self, index: int, block_tokens: int) -> list[int]:
        per = block_tokens // self.pool.page_tokens
        return self.pages[index * per : (index + 1) * per]


def _release(allocator: PageAllocator, pages: list[int]) -> None:
    if pages:
        held = list(pages)
        pages.clear()
        allocator.release(held)
