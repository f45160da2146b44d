"""The engine's fast paths keep the plain semantics: fused q/k/v and gate/up weights follow
weight updates, the weight-major GEMM for few rows equals F.linear, and the batch's
paged KV gives each sequence the tokens it gets alone whoever joins and leaves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncake.engine import DecodeBatch, Engine, ModelSpec, SamplingParams, dummy_model, generate

SPEC = ModelSpec(vocab_size=50, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, context=700)


def test_fused_weights_follow_load_state_dict() -> None:
    a, b = dummy_model(SPEC, seed=1), dummy_model(SPEC, seed=2)
    tokens = list(range(1, 12))
    first = Engine(a).prefill(tokens).logits  # builds a's fused weights
    a.load_state_dict(b.state_dict())
    assert torch.equal(Engine(a).prefill(tokens).logits, Engine(b).prefill(tokens).logits)
    assert not torch.equal(first, Engine(a).prefill(tokens).logits)


def test_small_row_linear_matches_f_linear() -> None:
    from mooncake.engine.gemm import linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 40, generator=g)
    for shape in ((1, 40), (3, 1, 40), (8, 40), (2, 20, 40)):
        x = torch.randn(shape, generator=g)
        assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-5)


def test_many_row_gemm_over_a_plain_weight_matches_f_linear_and_keeps_autograd() -> None:
    """`gemm.dense` (oneDNN over a weight in plain layout, a prefill's dequantized slice)
    equals F.linear in float64 within float32 rounding; where gradients are wanted it is
    F.linear, so they flow; other dtypes take F.linear too."""
    from mooncake.engine import gemm

    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    for rows in (17, 256, 1030):
        x = torch.randn(rows, 200, generator=g)
        want = F.linear(x.double(), w.double())
        got = gemm.dense(x, w)
        assert got.shape == (rows, 300) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
        xs, ws = x[:, ::2], w[:, ::2]  # strided inputs
        assert torch.allclose(gemm.dense(xs, ws).double(), F.linear(xs.double(), ws.double()),
                              atol=1e-4)  # fmt: skip
    x = torch.randn(40, 200, generator=g, requires_grad=True)
    gemm.dense(x, w).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, w.sum(0).expand(40, -1), atol=1e-4)
    xb, wb = x.detach().bfloat16(), w.bfloat16()
    assert torch.equal(gemm.dense(xb, wb), F.linear(xb, wb))


def test_paged_batch_joins_leaves_and_page_crossings_match_alone() -> None:
    engine = Engine(dummy_model(SPEC, std=0.3))
    page = engine.pool.page_tokens
    g = torch.Generator().manual_seed(5)
    # One prompt ends just before a page boundary, another on it: decoding crosses pages.
    lengths = (4 * page - 3, 7, 2 * page, 90)
    prompts = [[int(t) for t in torch.randint(0, 50, (n,), generator=g)] for n in lengths]
    limits = (12, 3, 9, 5)  # leave at different steps, while others keep going
    params = [SamplingParams(max_tokens=m, stop_on_eos=False) for m in limits]
    alone = [generate(engine, [p], [s])[0].tokens for p, s in zip(prompts, params, strict=True)]
    batch = DecodeBatch(engine)
    done: dict[str, list[int]] = {}
    for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
        batch.add(str(i), engine.prefill(p), s)
        done.update((c.id, c.tokens) for c in batch.step())  # join between steps
    while len(batch):
        done.update((c.id, c.tokens) for c in batch.step())
    assert [done[str(i)] for i in range(4)] == alone
    assert engine.pool.pages.used == 0  # every page back: nothing kept a private copy


def test_long_prefill_in_row_chunks_matches_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill longer than ROW_CHUNK runs its row-wise parts chunk by chunk: logits (last
    position, every position) and the KV it stores equal those of one pass over all rows,
    from scratch and over a cached prefix, and for a chunk that does not divide the prompt."""
    from mooncake.engine import model as model_mod

    engine = Engine(dummy_model(SPEC, std=0.3), block_tokens=16)
    g = torch.Generator().manual_seed(9)
    tokens = [int(t) for t in torch.randint(0, 50, (101,), generator=g)]

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        last = engine.prefill(tokens)
        every = engine.prefill(tokens, all_logits=True)
        prefix = engine.prefix_from_blocks(engine.blocks(every.kv)[:2])
        over = engine.prefill(tokens, prefix=prefix, all_logits=True)
        kv = every.kv.piece(0, len(tokens))
        for p in (last, every, over):
            p.kv.release()
        return last.logits, every.logits, over.logits, kv

    one_pass = run()  # 101 positions <= ROW_CHUNK: the plain path
    monkeypatch.setattr(model_mod, "ROW_CHUNK", 7)
    chunked = run()
    for a, b in zip(one_pass, chunked, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert engine.pool.pages.used == 0
