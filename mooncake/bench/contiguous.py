"""The engine's old KV layout, kept as a same-run baseline for the paged pool.

Before the pool, a decode batch kept its sequences' KV in one tensor per layer,
[2, slots, kv_heads, capacity, head_dim] with capacity = the longest member, grown by
doubling (unbounded memory: that is what the pool replaced). Its step wrote each new token
in place and attended over the slots with a length mask, with no gather; `decode_ratio`
measures the pool's step (page tables, native kernel) against it at the same batch, same
prompts, same model, back to back.

Only what a decode step needs is kept: the slots filled once from prefilled KV, then
`step` (greedy), no joining or leaving. `mooncake bench memory` reports the ratio at batch 32
(`paged_vs_contiguous_decode_b32`) while this old path still exists.
"""

from __future__ import annotations

import statistics

import torch
from torch import Tensor

from mooncake.engine import (
    DecodeBatch,
    Engine,
    KVPoolExhausted,
    ModelSpec,
    PagedKV,
    Prefilled,
    SamplingParams,
)
from mooncake.engine.model import attention
from mooncake.engine.pool import DEFAULT_PAGE_TOKENS
from mooncake.engine.speed import seconds as _timed


class ContiguousBatch:
    """A greedy decode batch over [2, B, kv_heads, capacity, head_dim] per layer."""

    def __init__(self, engine: Engine, prefilled: list[Prefilled], steps: int) -> None:
        self.engine = engine
        s = engine.spec
        self.lengths = [len(p.tokens) for p in prefilled]
        capacity = max(self.lengths) + steps + 1
        shape = (2, len(prefilled), s.kv_heads, capacity, s.head_dim)
        dtype, dev = engine.model.dtype, engine.device
        self.layers = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(s.layers)]
        self.next: list[int] = []
        for b, p in enumerate(prefilled):
            n = len(p.tokens)
            for layer, t in enumerate(self.layers):
                k, v = p.kv.read(layer, 0, n)
                t[0, b, :, :n], t[1, b, :, :n] = k, v
            self.next.append(int(p.logits.argmax()))

    @torch.inference_mode()
    def step(self) -> None:
        dev = self.engine.device
        ids = torch.tensor([[t] for t in self.next], device=dev)
        pos = torch.tensor(self.lengths, device=dev)
        total = max(self.lengths) + 1
        rows = torch.arange(len(self.lengths), device=dev)
        mask: Tensor | None = None
        if min(self.lengths) != max(self.lengths):
            cols = torch.arange(total, device=dev)[None, :]
            mask = (cols <= pos[:, None])[:, None, None, :]
        layers = self.layers

        def backend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            t = layers[layer]
            b = q.shape[0]
            t[:, rows, :, pos] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)
            keys, values = t[0, :b, :, :total], t[1, :b, :, :total]
            return attention(q, keys, values, mask, causal=False)

        logits = self.engine.model(ids, pos[:, None], backend)
        self.next = logits.argmax(-1).tolist()
        self.lengths = [n + 1 for n in self.lengths]


def decode_ratio(
    engine: Engine, prompts: list[list[int]], steps: int, reps: int
) -> dict[str, float]:
    """Decode tok/s of the paged batch and of the contiguous baseline over the same
    prompts (greedy, `steps` steps after a warm-up step), paired repetitions; the ratio is
    the median of the per-repetition ratios (paged over contiguous). The prompts are
    prefilled once; every run starts from a copy of their KV (prefill is not timed)."""
    prefilled = [engine.prefill(p) for p in prompts]

    def paged() -> float:
        batch = DecodeBatch(engine)
        params = SamplingParams(max_tokens=steps + 2, stop_on_eos=False)
        for i, p in enumerate(prefilled):
            first = int(p.logits.argmax())
            batch.resume(str(i), copy_kv(engine, p.kv), p.tokens, first, params)
        batch.step()
        took = _timed(lambda: [batch.step() for _ in range(steps)])
        for sid in list(batch.running):
            batch.cancel(sid)  # its pages back to the pool for the next run
        return took

    def contiguous() -> float:
        batch = ContiguousBatch(engine, prefilled, steps + 1)
        batch.step()
        return _timed(lambda: [batch.step() for _ in range(steps)])

    a, b = [], []
    for _ in range(reps):
        a.append(paged())
        b.append(contiguous())
    for p in prefilled:
        p.kv.release()
    tokens = len(prompts) * steps
    return {
        "paged_tok_s": round(tokens / statistics.median(a), 1),
        "contiguous_tok_s": round(tokens / statistics.median(b), 1),
        "ratio": round(statistics.median(y / x for x, y in zip(a, b, strict=True)), 3),
    }


def copy_kv(engine: Engine, kv: PagedKV) -> PagedKV:
    """A private copy of a sequence's KV in the same pool."""
    out = engine.new_kv()
    if not out.reserve(kv.length):
        raise KVPoolExhausted(f"no room for a copy of {kv.length} tokens of KV")
    for layer in range(engine.spec.layers):
        out.load_layer(layer, 0, kv.layer_piece(layer, 0, kv.length))
    out.length = kv.length
    return out


def pool_bytes_needed(engine_spec: ModelSpec, prompts: int, prompt_tokens: int, steps: int) -> int:
    """KV budget `decode_ratio` needs: the prefilled prompts and one decoding copy of each
    (page rounding and the engine's minimum of one context + 2 blocks on top)."""
    per_seq = prompt_tokens + steps + 2 + 2 * DEFAULT_PAGE_TOKENS
    tokens = prompts * (prompt_tokens + per_seq) + engine_spec.context
    return tokens * engine_spec.kv_bytes_per_token(4) + (64 << 20)
