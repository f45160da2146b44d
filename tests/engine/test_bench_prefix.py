"""`bench engine`'s prefix ceiling on a small random model: its GEMM and attention parts do
exactly the GEMM and attention work of the real cold and cached prefills (counted, not
timed: the clock is replaced by a count of the work each part did)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mooncake.bench import engine as bench
from mooncake.engine import Engine, ModelSpec, dummy_model
from mooncake.engine.model import Block
from mooncake.engine.paged import PagedPrefill

SPEC = ModelSpec(vocab_size=50, hidden=96, layers=3, heads=6, kv_heads=2, ffn=128, context=700)


def test_the_ceiling_times_the_prefills_own_gemms_and_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 512-token prompt, 448 of it cached in blocks of 64 (the bench's 7 of 8 blocks), and
    # rows in runs of 128, so the cold side's GEMMs are cut as a long prompt's are.
    monkeypatch.setattr(bench, "PREFIX_PROMPT", 512)
    monkeypatch.setattr(bench, "PREFIX_CACHED", 448)
    monkeypatch.setattr(bench, "ROW_CHUNK", 128)
    monkeypatch.setattr("mooncake.engine.model.ROW_CHUNK", 128)
    work = {"gemm": 0, "attention": 0}
    gemm, attend = Block._gemm, PagedPrefill.__call__

    def counted_gemm(self: Block, name: str, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        out = gemm(self, name, x, *rest)
        work["gemm"] += out.numel() * x.shape[-1]  # multiply-adds
        return out

    def counted_attention(self: PagedPrefill, layer: int, q: torch.Tensor, *kv: Any) -> Any:
        rows, first = q.shape[2], self.start + self.new - q.shape[2]
        work["attention"] += q.shape[1] * (rows * first + rows * (rows + 1) // 2)  # pairs
        return attend(self, layer, q, *kv)

    def counted_clock(fn: Callable[[], Any], _device: torch.device) -> float:
        before = work["gemm"] + work["attention"]
        fn()
        return float(work["gemm"] + work["attention"] - before)

    monkeypatch.setattr(Block, "_gemm", counted_gemm)
    monkeypatch.setattr(PagedPrefill, "__call__", counted_attention)
    monkeypatch.setattr(bench, "_timed", counted_clock)
    engine = Engine(dummy_model(SPEC, std=0.3), block_tokens=64)

    out = bench._bench_prefix(engine, 2, torch.device("cpu"), lambda _: None)

    # The same work counted in the real prefills, cold and over the cached blocks.
    prompt = bench._prompt(512, SPEC.vocab_size, 3)
    blocks = engine.blocks(engine.prefill(prompt).kv)[:7]
    sides = []
    for prefix in (None, engine.prefix_from_blocks(blocks)):
        work.update(gemm=0, attention=0)
        engine.prefill(prompt, prefix=prefix)
        sides.append(dict(work))
    cold, hit = sides
    assert cold["gemm"] > 7 * hit["gemm"] and cold["attention"] > 4 * hit["attention"]
    assert out["prefix_gemm_ratio"] == round(cold["gemm"] / hit["gemm"], 3)
    assert out["prefix_attention_ratio"] == round(cold["attention"] / hit["attention"], 3)
    both = (cold["gemm"] + cold["attention"]) / (hit["gemm"] + hit["attention"])
    assert out["prefix_hit_ceiling"] == round(both, 3)
    del blocks, prefix
    assert engine.pool.pages.used == 0  # the bench's sequences gave their pages back
