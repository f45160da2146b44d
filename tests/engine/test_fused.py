"""The fused decode step (engine.fused, native/decode_layer.c) against the model's own forward
over PagedDecode: the same logits up to rounding order, the same KV written into the pages,
the same greedy tokens; and where it does not apply, the eager path.

Tolerance: both run float32 over the same quantized blocks; they differ in the order of sums
(norms, attention) and in fused multiply-adds, ~1e-5 relative per layer. ATOL 2e-3 on
logits of O(10) is the tolerance of test_reference.py; a wrong RoPE pair, KV slot, head
grouping or norm moves logits by O(1).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from mooncake.engine import DecodeBatch, Decoder, Engine, ModelSpec, SamplingParams, generate
from mooncake.engine.gguf_loader import LoadedModel
from mooncake.engine.model import Block
from mooncake.engine.paged import PagedDecode
from mooncake.engine.quant import QuantWeight, from_gguf_blocks

ATOL = 2e-3
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def _quantize(model: Decoder, type_name: str = "Q4_1") -> Decoder:
    """Every projection of `model` (random init) kept as gguf-quantized blocks."""
    qtype = GGMLQuantizationType[type_name]
    layers: list[dict[str, QuantWeight]] = []
    for block in model.layers:
        assert isinstance(block, Block)
        parts = {}
        for name in PROJECTIONS:
            w = getattr(block, name).weight.detach().numpy()
            parts[name] = from_gguf_blocks(type_name, quantize(w, qtype), w.shape)
        layers.append(parts)
    model.use_quantized(layers)
    return model


def _one_step(engine: Engine, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step over the prompts' KV, fused and eager, from the same state
    (both write the same new token's KV into the same slots)."""
    assert engine.fused is not None
    kvs = [engine.prefill(p).kv for p in prompts]
    for kv in kvs:
        assert kv.reserve(kv.length + 1)
    ids = torch.tensor([[(7 * i + 3) % engine.spec.vocab_size] for i in range(len(prompts))])
    backend = PagedDecode(engine.pool, kvs)
    with torch.inference_mode():
        eager = engine.model(ids, backend.positions[:, None], backend)
        written = [engine.pool.read(layer, torch.tensor(kv.pages), 0, kv.length + 1)
                   for layer in (0, engine.spec.layers - 1) for kv in kvs]  # fmt: skip
        fused = engine.fused(ids, backend)
        rewritten = [engine.pool.read(layer, torch.tensor(kv.pages), 0, kv.length + 1)
                     for layer in (0, engine.spec.layers - 1) for kv in kvs]  # fmt: skip
    for (k0, v0), (k1, v1) in zip(written, rewritten, strict=True):
        # float32: the new token's k, v to rounding order; bfloat16: rounded from values
        # that close, at most one unit in the last place apart (2^-8 relative).
        if k0.dtype == torch.bfloat16:
            for a, b in ((k0, k1), (v0, v1)):
                a, b = a.float(), b.float()
                assert ((a - b).abs() <= 2**-7 * a.abs() + 1e-6).all()
        else:
            assert torch.allclose(k0, k1, atol=1e-4) and torch.allclose(v0, v1, atol=1e-4)
    for kv in kvs:
        kv.release()
    return fused, eager


@pytest.mark.parametrize(
    ("spec", "type_name"),
    [
        # GQA, rotary on part of the head, prompts across several pages
        (
            ModelSpec(
                vocab_size=96,
                hidden=64,
                layers=2,
                heads=4,
                kv_heads=2,
                ffn=96,
                context=256,
                rope_dim=8,
            ),
            "Q4_1",
        ),
        # multi-head (no grouping), Q8_0 blocks
        (
            ModelSpec(vocab_size=80, hidden=64, layers=3, heads=2, kv_heads=2, ffn=64, context=256),
            "Q8_0",
        ),
    ],
)
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_fused_step_equals_eager_step(spec: ModelSpec, type_name: str, kv: str) -> None:
    """Over a pool of float32 and of bfloat16 (both steps read the same rounded KV)."""
    torch.manual_seed(0)
    model = _quantize(Decoder(spec).eval(), type_name)
    engine = Engine(model, block_tokens=16, kv=kv)  # type: ignore[arg-type]
    assert engine.pool.dtype == getattr(torch, kv)
    assert engine.decode_path == "fused"
    rng = np.random.default_rng(1)
    for batch in (1, 2, 3, 8, 11):  # every GEMM tile (8, 4, 2, 1 rows) and remainders
        prompts = [list(rng.integers(0, spec.vocab_size, int(rng.integers(1, 70))))
                   for _ in range(batch)]  # fmt: skip
        fused, eager = _one_step(engine, prompts)
        assert fused.shape == eager.shape == (batch, spec.vocab_size)
        assert (fused - eager).abs().max().item() <= ATOL


def test_smollm2_fused_generation_equals_eager(
    smollm2: LoadedModel, engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    """Continuous batching of three chat prompts: the same greedy tokens either way."""
    assert engine.decode_path == "fused"  # the served model: quantized, on the CPU
    eager = Engine(smollm2.model, smollm2.tokenizer, block_tokens=engine.block_tokens,
                   decode="eager")  # fmt: skip
    assert eager.decode_path == "eager"
    prompts = [chat(t) for t in ("What is the capital of France?", "Write a haiku.", "Hi")]
    params = [SamplingParams(max_tokens=20, stop_on_eos=False)] * 3
    fused_out = generate(engine, prompts, params)
    eager_out = generate(eager, prompts, params)
    assert [c.tokens for c in fused_out] == [c.tokens for c in eager_out]
    fused, eager_logits = _one_step(engine, prompts)
    assert (fused - eager_logits).abs().max().item() <= ATOL


def test_float32_weights_decode_eagerly() -> None:
    spec = ModelSpec(vocab_size=64, hidden=64, layers=1, heads=4, kv_heads=2, ffn=64, context=64)
    engine = Engine(Decoder(spec).eval(), block_tokens=16)
    assert engine.decode_path == "eager" and engine.fused is None
    batch = DecodeBatch(engine)
    done = batch.add("a", engine.prefill([1, 2, 3]), SamplingParams(max_tokens=2))
    assert done is None
    [completion] = batch.step()  # the second token, by the eager path, ends it (max_tokens)
    assert len(completion.tokens) == 2 and completion.finish_reason == "length"
