"""The old contiguous KV layout kept as `bench memory`'s same-run baseline: it decodes the
tokens the paged batch decodes (so the ratio compares the same work), and `decode_ratio`
hands every page it used back to the pool."""

from __future__ import annotations

import torch

from mooncake.bench.contiguous import ContiguousBatch, copy_kv, decode_ratio, pool_bytes_needed
from mooncake.engine import DecodeBatch, Engine, ModelSpec, SamplingParams, dummy_model

SPEC = ModelSpec(vocab_size=61, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, context=128)


def engine() -> Engine:
    model = dummy_model(SPEC, seed=3, std=0.25)
    budget = pool_bytes_needed(SPEC, prompts=4, prompt_tokens=40, steps=6)
    return Engine(model, block_tokens=16, model_id="dummy", kv_budget_bytes=budget)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist() for n in (40, 23, 31, 9)]


def test_the_contiguous_baseline_decodes_what_the_paged_batch_decodes() -> None:
    e = engine()
    prefilled = [e.prefill(p) for p in prompts()]
    contiguous = ContiguousBatch(e, prefilled, steps=6)
    paged = DecodeBatch(e)
    params = SamplingParams(max_tokens=20, stop_on_eos=False)
    for i, p in enumerate(prefilled):
        paged.resume(str(i), copy_kv(e, p.kv), p.tokens, int(p.logits.argmax()), params)
    for _ in range(6):
        contiguous.step()
        paged.step()
    assert contiguous.next == [paged.running[str(i)].output[-1] for i in range(len(prefilled))]


def test_decode_ratio_measures_both_and_gives_the_pages_back() -> None:
    e = engine()
    out = decode_ratio(e, prompts(), steps=6, reps=2)
    assert out["paged_tok_s"] > 0 and out["contiguous_tok_s"] > 0 and out["ratio"] > 0
    assert e.pool.pages.available == e.pool.pages.total
