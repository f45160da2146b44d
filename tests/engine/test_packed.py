"""GEMMs of PACK_MIN_ROWS or more rows (decode batches, prefill) run over oneDNN-packed copies
of the weights: same results as F.linear, and the copies follow every weight update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mooncake.engine import DecodeBatch, Engine, ModelSpec, SamplingParams, dummy_model
from mooncake.engine.gemm import ONEDNN, PACK_MIN_ROWS, SMALL_ROWS, PackedWeight, linear

SPEC = ModelSpec(vocab_size=50, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, context=300)

pytestmark = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")


def test_packed_linear_matches_f_linear() -> None:
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(40, 300, bias=False)
    packed = PackedWeight(layer)
    with torch.no_grad():
        w = layer.weight
        for shape in (
            (1, 40),
            (2, 40),
            (PACK_MIN_ROWS, 40),
            (8, 1, 40),
            (SMALL_ROWS, 40),
            (1, 70, 40),
        ):
            x = torch.randn(shape, generator=g)
            assert torch.allclose(linear(x, w, packed), F.linear(x, w), atol=1e-5), shape
        assert packed.packed is not None  # the few-row shapes above used it
        built = packed.packed
        linear(torch.randn(8, 40, generator=g), w, packed)
        assert packed.packed is built  # reused while the weight is unchanged


def test_packed_weight_follows_in_place_updates_and_replacement() -> None:
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(40, 64, bias=False)
    packed = PackedWeight(layer)
    x = torch.randn(8, 40, generator=g)
    with torch.no_grad():
        linear(x, layer.weight, packed)
        layer.weight.mul_(-2.0)  # in place: same tensor, new version
        assert torch.allclose(linear(x, layer.weight, packed), F.linear(x, layer.weight), atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(64, 40, generator=g))  # another tensor
        assert torch.allclose(linear(x, layer.weight, packed), F.linear(x, layer.weight), atol=1e-5)


def test_packed_path_is_skipped_when_autograd_records() -> None:
    layer = nn.Linear(40, 64, bias=False)
    packed = PackedWeight(layer)
    out = linear(torch.randn(8, 40), layer.weight, packed)
    assert out.requires_grad and packed.packed is None


def _decode(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
    batch = DecodeBatch(engine)
    params = SamplingParams(max_tokens=steps + 2, stop_on_eos=False)
    for i, p in enumerate(prompts):
        batch.add(str(i), engine.prefill(p), params)
    for _ in range(steps):
        batch.step()
    return [s.output for s in batch.slots], [s.kv.read(0, 0, s.kv.length) for s in batch.slots]


def test_batch_decode_follows_load_state_dict() -> None:
    """Fused q/k/v and gate/up weights are views the packed copies must see updated too."""
    a, b = dummy_model(SPEC, seed=1, std=0.3), dummy_model(SPEC, seed=2, std=0.3)
    g = torch.Generator().manual_seed(3)
    prompts = [[int(t) for t in torch.randint(0, 50, (n,), generator=g)] for n in (5, 9, 14, 20)]
    before, _ = _decode(Engine(a), prompts, 6)  # builds a's packed weights
    a.load_state_dict(b.state_dict())
    tokens_a, kv_a = _decode(Engine(a), prompts, 6)
    tokens_b, kv_b = _decode(Engine(b), prompts, 6)
    assert tokens_a == tokens_b and tokens_a != before
    for x, y in zip(kv_a, kv_b, strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_packed_only_weights_give_the_same_tokens_and_free_the_plain_copies() -> None:
    """Serving packs every GEMM weight once and frees the plain copy: the same logits (to
    float32 ordering), the same greedy tokens, at every batch size, and the weights occupy
    the embedding plus the packed copies only."""
    plain = dummy_model(SPEC, seed=3, std=0.3)
    served = dummy_model(SPEC, seed=3, std=0.3)
    params = sum(t.numel() * 4 for t in served.state_dict().values())
    assert served.pack_weights()
    linears = [w for name, w in served.state_dict().items() if name.endswith(
        ("q.weight", "k.weight", "v.weight", "o.weight", "gate.weight", "up.weight",
         "down.weight"))]  # fmt: skip
    assert linears and all(w.numel() == 0 for w in linears)
    assert served.weight_bytes() >= params  # the embedding stays plain beside its packed copy
    a, b = Engine(plain, block_tokens=16), Engine(served, block_tokens=16)
    prompts = [list(range(3, 3 + n)) for n in (1, 7, 33)]
    for p in prompts:
        torch.testing.assert_close(b.prefill(p).logits, a.prefill(p).logits, atol=1e-4, rtol=0)
    for engine in (a, b):
        batch = DecodeBatch(engine)
        for i, p in enumerate(prompts):
            batch.add(str(i), engine.prefill(p), SamplingParams(max_tokens=12, stop_on_eos=False))
        done = []
        while len(batch):
            done += batch.step()
        engine.tokens = {c.id: c.tokens for c in done}  # type: ignore[attr-defined]
    assert a.tokens == b.tokens  # type: ignore[attr-defined]
