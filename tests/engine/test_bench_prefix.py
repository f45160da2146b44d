"""`bench engine`'s prefix fields on a small random model: the cached side's ceiling comes
from the two sides' GEMMs and attention, each timed at the rows that side computes."""

from __future__ import annotations

import pytest
import torch

from mooncake.bench import engine as bench
from mooncake.engine import Engine, ModelSpec, dummy_model

SPEC = ModelSpec(vocab_size=50, hidden=96, layers=2, heads=6, kv_heads=2, ffn=128, context=700)


def test_prefix_fields_time_the_cold_and_the_cached_side(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 512-token prompt, 448 of it cached in blocks of 64 (the bench's 7 of 8 blocks).
    monkeypatch.setattr(bench, "PREFIX_PROMPT", 512)
    monkeypatch.setattr(bench, "PREFIX_CACHED", 448)
    engine = Engine(dummy_model(SPEC, std=0.3), block_tokens=64)
    out = bench._bench_prefix(engine, 3, torch.device("cpu"), lambda _: None)
    gemm, attention = out["prefix_gemm_ratio"], out["prefix_attention_ratio"]
    ceiling = out["prefix_hit_ceiling"]
    assert isinstance(gemm, float) and isinstance(attention, float)
    assert isinstance(ceiling, float)
    # The cold side computes 8x the rows and ~4.6x the attention pairs (each of the last
    # 64 rows sees up to 512 keys): both ratios well above 1, the ceiling between them.
    assert gemm > 2 and attention > 1.5
    assert min(gemm, attention) <= ceiling <= max(gemm, attention)
    assert engine.pool.pages.used == 0  # the bench's sequences gave their pages back
