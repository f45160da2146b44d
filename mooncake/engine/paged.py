"""Attention backends over the paged KV pool (the decoder's `AttentionBackend`s).

- `PagedPrefill`: S new tokens of one sequence at positions start..start+S-1. Their k, v are
  written into the sequence's pages. On the CPU (a pool of float32 or bfloat16, queries of
  float32) the attention is then the
  native prefill kernel (engine.native), which reads every key, cached or new, in place
  from its pages (multiplying in bfloat16 where the engine asks for it, the CPU has
  AVX512_BF16 and that build measures faster here: `bf16_attention_speedup`). Elsewhere:
  with nothing cached, the fused causal kernel over the new tokens themselves (no pool
  read); otherwise the cached positions are read out of their pages once per layer and
  the new tokens attend to them and to themselves (on CUDA through the fused causal
  kernel aligned to the bottom right, no mask; on a CPU without a C compiler as two flash
  calls merged by their log-sum-exps, `merged_suffix_attention`; with a mask per run of
  rows only where this torch lacks that kernel).
- `PagedDecode`: one new token per sequence for a whole batch. The new k, v go into each
  sequence's next page slot, then attention reads every sequence's pages through its block
  table: by the native kernel (engine.native) on the CPU (a pool of float32 or bfloat16),
  else by gathering the
  pages into a padded tensor and masking (other devices and dtypes, or no C compiler).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from mooncake.engine import native
from mooncake.engine.model import attention, causal_suffix_attention, merged_suffix_attention
from mooncake.engine.pool import KVPool, PagedKV, pages_for
from mooncake.engine.speed import FASTER, speedup

# A prefill over a cached prefix attends in runs of this many query rows: the kernel makes a
# float mask of [rows, keys] out of the boolean one, so an 8k-token prompt in one run held a
# 256 MiB mask (and its 64 MiB boolean source) in every layer.
PREFIX_QUERY_ROWS = 1024
# False: the CPU masks in runs of rows even where the merged flash path is there (tests).
MERGED_ON_CPU = True
# False: the CPU takes the torch paths even where the native prefill kernel is there (tests).
NATIVE_PREFILL = True


def prefill_kernel(pool: KVPool, bf16: bool = False) -> native.PagedPrefill | None:
    """The native prefill kernel for `pool`'s shape and element type, where prefill attention
    takes it (a `native` pool); `bf16`: its bfloat16 build where the CPU has AVX512_BF16 and that
    build runs at least speed.FASTER times the float32 one's speed here
    (bf16_attention_speedup), else the float32 build."""
    if not (NATIVE_PREFILL and pool.native_kv):
        return None
    dim, page, kv = pool.shape.head_dim, pool.page_tokens, pool.kv_bf16
    if bf16 and native_bf16(dim, page) and (bf16_attention_speedup(dim, page, kv) or 0.0) >= FASTER:
        return native.load_prefill(dim, page, bf16=True, kv_bf16=kv)
    return native.load_prefill(dim, page, kv_bf16=kv)


def native_bf16(head_dim: int, page_tokens: int) -> bool:
    """Whether the native prefill kernel's bfloat16 build multiplies in bfloat16 here (the
    CPU has AVX512_BF16; elsewhere that build computes in float32, and calling it bfloat16
    would misname what runs)."""
    bf = native.load_prefill(head_dim, page_tokens, bf16=True)
    return bf is not None and bf.bf16


@functools.cache
def bf16_attention_speedup(head_dim: int, page_tokens: int, kv_bf16: bool = False) -> float | None:
    """How many times faster the native prefill kernel's bfloat16 build runs than its
    float32 one here over a pool of float32 (`kv_bf16`: of bfloat16): 256 new rows of 3 KV
    heads of 3 query heads each after 1,792 cached keys, at torch's thread count when first
    asked (speed.speedup: the best of 9 calls each, ~0.2 s once a process). None where there is no
    bfloat16 build (no AVX512_BF16, a head of other than a multiple of 32 floats, no C compiler).
    ~1.6x on a Zen 4 EPYC; 0.60-0.70x on a Xeon whose VM exposes AVX512_BF16 without AMX
    (engine.speed)."""
    f32 = native.load_prefill(head_dim, page_tokens, kv_bf16=kv_bf16)
    bf = native.load_prefill(head_dim, page_tokens, bf16=True, kv_bf16=kv_bf16)
    if f32 is None or bf is None or not native_bf16(head_dim, page_tokens):
        return None
    start = 1792
    q, k, v, table, scale = _probe_inputs(head_dim, page_tokens, start, 256, f32.kv_dtype)
    return speedup(lambda: bf(q, k, v, table, start, scale),
                   lambda: f32(q, k, v, table, start, scale))  # fmt: skip


def _probe_inputs(
    head_dim: int, page_tokens: int, start: int, new: int, kv: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """A prefill kernel's arguments for the probes: `new` rows of 3 KV heads of 3 query
    heads each after `start` cached keys in pages of `kv` (q, k pages, v pages, table,
    scale)."""
    kv_heads, group = 3, 3
    pages = pages_for(start + new, page_tokens)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, kv_heads, head_dim, page_tokens, generator=g).to(kv)
    v = torch.randn(pages, kv_heads, page_tokens, head_dim, generator=g).to(kv)
    q = torch.randn(new, kv_heads * group, head_dim, generator=g)
    return q, k, v, torch.arange(pages, dtype=torch.int32), head_dim**-0.5


@functools.cache
def torch_bf16_attention_speedup(
    head_dim: int, page_tokens: int, kv_bf16: bool = False
) -> float | None:
    """How many times faster torch's fused attention runs over bfloat16 copies of the keys
    and values (the copies inside the clock, as PagedPrefill reads them out of the pool's
    pages) than the native float32 kernel over the same pool (`kv_bf16`: of bfloat16) here:
    1,024 new rows of 3 KV heads of 3 query heads each after 1,024 cached keys, at torch's
    thread count when first asked (speed.speedup: the best of 9 calls each, once a process). None
    where the CPU has no bfloat16 instructions oneDNN uses or there is no native kernel to compare
    with. On a 2-vCPU Xeon with AMX: a 3,000-token SmolLM2 prefill 1.37x faster whole (attention in
    float32 was ~half of it), where the native bfloat16 build measured 0.57x (issue 42)."""
    from mooncake.engine.gemm import bf16_instructions

    f32 = native.load_prefill(head_dim, page_tokens, kv_bf16=kv_bf16)
    if f32 is None or not bf16_instructions():
        return None
    start, new, kv_heads = 1024, 1024, 3
    q, k, v, table, scale = _probe_inputs(head_dim, page_tokens, start, new, f32.kv_dtype)
    # The torch path's inputs as PagedPrefill has them: [1, heads, T, D] views of the pages.
    keys = k.permute(1, 0, 3, 2).reshape(1, kv_heads, -1, head_dim)[:, :, : start + new]
    values = v.transpose(0, 1).reshape(1, kv_heads, -1, head_dim)[:, :, : start + new]
    qt = q.transpose(0, 1)[None]
    bf = torch.bfloat16

    def torch_bf16() -> object:
        qb, kb, vb = qt.to(bf), keys.to(bf, copy=True), values.to(bf, copy=True)
        out = merged_suffix_attention(qb, kb, vb)
        return out if out is not None else causal_suffix_attention(qb, kb, vb)

    return speedup(torch_bf16, lambda: f32(q, k, v, table, start, scale))


def prefill_attention_choice(pool: KVPool, bf16: bool) -> str:
    """Which prefill attention a pool's prefills take: "torch bfloat16", "native bfloat16" or
    "native float32" on the CPU (with `bf16`, the fastest that measures at least
    speed.FASTER times the native float32 kernel's speed here), "torch" elsewhere."""
    if prefill_kernel(pool) is None:
        return "torch"
    if not bf16:
        return "native float32"
    dim, page, kv = pool.shape.head_dim, pool.page_tokens, pool.kv_bf16
    options = {
        "native bfloat16": (bf16_attention_speedup(dim, page, kv) or 0.0)
        if native_bf16(dim, page)
        else 0.0,
        "torch bfloat16": torch_bf16_attention_speedup(dim, page, kv) or 0.0,
    }
    best = max(options, key=lambda o: options[o])
    return best if options[best] >= FASTER else "native float32"


class PagedPrefill:
    """`bf16`: the native kernel multiplies in bfloat16 where the CPU has AVX512_BF16 dot
    products and they measure faster (EngineSettings.attention; prefill_kernel)."""

    def __init__(
        self, kv: PagedKV, start: int, new: int, *, bf16: bool = False, torch_bf16: bool = False
    ) -> None:
        self.kv, self.pool, self.start, self.new = kv, kv.pool, start, new
        self.page, self.offset = self.pool.locate(kv.table(), start, start + new)
        # torch_bf16: torch's fused attention over bfloat16 copies of the pool's
        # keys and values (oneDNN's bfloat16 products, AMX where the CPU has it), in place of
        # the native kernel, where it measured faster (`prefill_attention_choice`).
        self.torch_bf16 = torch_bf16 and self.pool.device.type == "cpu"
        # So a block whose GEMMs run in bfloat16 hands over q, k, v in it (model.Block).
        self.bf16_inputs = self.torch_bf16
        self.kernel = None if self.torch_bf16 else prefill_kernel(self.pool, bf16)
        if self.kernel is not None:
            self.pages = kv.table()[: pages_for(start + new, self.pool.page_tokens)].to(torch.int32)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.pool.write(layer, self.page, self.offset, k[0].transpose(0, 1), v[0].transpose(0, 1))
        if self.kernel is not None and q.dtype == torch.float32:
            # Every key read in place from its pages (engine.native's prefill kernel): the
            # new tokens' own, just written, and a cached prefix's alike.
            first = self.start + self.new - q.shape[2]  # the last position alone, or all
            out = self.kernel(q[0].transpose(0, 1), self.pool.k(layer), self.pool.v(layer),
                              self.pages, first, q.shape[-1] ** -0.5)  # fmt: skip
            return out.transpose(0, 1)[None]
        if self.torch_bf16 and q.dtype == torch.float32:
            bf = torch.bfloat16
            return self._torch(layer, q.to(bf), k.to(bf), v.to(bf)).to(q.dtype)
        return self._torch(layer, q, k, v)

    def _torch(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Torch's attention (the path off the native kernel), in q's dtype."""
        last_only = q.shape[2] == 1  # the last position alone sees every key: no mask
        if not self.start:
            return attention(q, k, v, None, causal=not last_only or k.shape[2] == 1)
        # The new k, v are in their pages now: one gather of every position, no concatenation.
        pk, pv = self.kv.read(layer, 0, self.start + k.shape[2])
        keys, values = pk.to(k.dtype)[None], pv.to(v.dtype)[None]
        if last_only:
            return attention(q, keys, values, None, causal=False)
        if q.device.type == "cuda":  # a fused causal kernel, no mask (model.causal_suffix_...)
            return causal_suffix_attention(q, keys, values)
        merged = merged_suffix_attention(q, keys, values) if MERGED_ON_CPU else None
        return merged if merged is not None else self._over_prefix(q, keys, values)

    def _over_prefix(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The new tokens' attention over the cached positions and themselves, in runs of
        PREFIX_QUERY_ROWS query rows: run [a, b) sees keys 0 .. start+b-1, every one but the
        last b-a by all of its rows (the mask is causal only there). The masks are made per
        layer, not kept: 0.4 ms for a run of 1,024 rows over 8k keys, ~0.1 s in all for an 8k
        prompt's ~15 s prefill; kept, they would hold ~37 MiB through it."""
        parts = []
        for a in range(0, q.shape[2], PREFIX_QUERY_ROWS):
            b = min(a + PREFIX_QUERY_ROWS, q.shape[2])
            seen = self.start + b
            mask = torch.ones((b - a, seen), dtype=torch.bool, device=q.device)
            mask[:, self.start + a :].tril_()
            parts.append(
                attention(q[:, :, a:b], keys[:, :, :seen], values[:, :, :seen], mask[None, None])
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def block_table(kvs: Sequence[PagedKV], rows: int, width: int, fill: int = 0) -> Tensor:
    """The block tables of `kvs` as one [rows, width] int32 tensor on the CPU, each row padded
    with page `fill` (past a sequence's length no page is read); rows past len(kvs) are all
    `fill`."""
    table = torch.full((rows, width), fill, dtype=torch.int32)
    for i, kv in enumerate(kvs):
        table[i, : len(kv.pages)] = torch.tensor(kv.pages, dtype=torch.int32)
    return table


class PagedDecode:
    """One decode step's attention for sequences with KV `kvs` (each already holding pages
    for its new token at position `kv.length`)."""

    def __init__(self, pool: KVPool, kvs: Sequence[PagedKV]) -> None:
        table = block_table(kvs, len(kvs), max(len(kv.pages) for kv in kvs))
        lengths = torch.tensor([kv.length for kv in kvs])
        self._setup(pool, lengths.to(pool.device), table.to(pool.device))

    @classmethod
    def of_tensors(cls, pool: KVPool, positions: Tensor, table: Tensor) -> PagedDecode:
        """The same step from tensors already on the pool's device: each row's new position
        and its block table (int32, padded with any page: past a row's length nothing is
        read). Only tensor ops from here on (no host sync): a CUDA graph can record it."""
        self = cls.__new__(cls)
        self._setup(pool, positions, table)
        return self

    def _setup(self, pool: KVPool, positions: Tensor, table: Tensor) -> None:
        self.pool = pool
        dev, p = pool.device, pool.page_tokens
        self.positions, self.table = positions, table
        rows = torch.arange(table.shape[0], device=dev)
        long_table = table.long()
        self.page = long_table[rows, positions // p]
        self.offset = positions % p
        self.lens = (positions + 1).to(torch.int32)
        self.kernel = None
        if pool.native_kv:
            self.kernel = native.load(pool.shape.head_dim, p, pool.kv_bf16)
        self._long_table = long_table

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.pool.write(layer, self.page, self.offset, k[:, :, 0], v[:, :, 0])
        b, heads, _, dim = q.shape
        kv_heads = k.shape[1]
        if self.kernel is not None and q.dtype == torch.float32:
            qg = q.reshape(b, kv_heads, heads // kv_heads, dim).contiguous()
            out = torch.empty_like(qg)
            self.kernel(qg, self.pool.k(layer), self.pool.v(layer), self.table, self.lens,
                        out, dim**-0.5)  # fmt: skip
            return out.view(b, heads, 1, dim)
        return self._gathered(layer, q)

    def _gathered(self, layer: int, q: Tensor) -> Tensor:
        """The portable path: every sequence's pages copied into a padded [B, kv_heads, T,
        D] tensor, padding masked out."""
        s = self.pool.shape
        b, widest = self._long_table.shape
        idx = self._long_table.reshape(-1)
        keys = self.pool.k(layer)[idx].view(b, widest, s.kv_heads, s.head_dim, s.page_tokens)
        keys = keys.permute(0, 2, 1, 4, 3).reshape(b, s.kv_heads, -1, s.head_dim)
        vals = self.pool.v(layer)[idx].view(b, widest, s.kv_heads, s.page_tokens, s.head_dim)
        vals = vals.transpose(1, 2).reshape(b, s.kv_heads, -1, s.head_dim)
        cols = torch.arange(keys.shape[2], device=q.device)[None, :]
        mask = (cols < self.lens[:, None])[:, None, None, :]
        # Masked positions still enter the matmuls (a score, then a weight of 0): zero what
        # is past each sequence's end, whatever an earlier user of the page left there.
        past = ~mask[:, :, 0, :, None]
        keys, vals = keys.masked_fill(past, 0), vals.masked_fill(past, 0)
        return attention(q, keys.to(q.dtype), vals.to(q.dtype), mask)
