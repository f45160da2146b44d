"""Weights kept in GGUF's quantized blocks (engine.quant): the same values as gguf's own
dequantization, products equal to float32 GEMMs over those values, and a model whose logits
stay within a stated tolerance of the float32 one.

Tolerance: the blocks hold exactly the values `gguf.quants.dequantize` gives (checked bit for
bit below), and the activations stay float32, so a product differs from the float32 GEMM
only by the order of its sums. For a whole SmolLM2 forward that is ~1e-4 on logits of
O(10-30) (measured: 1.4e-4 over 1,200 positions), so LOGIT_ATOL = 2e-3 (the tolerance of
test_reference.py) catches any real error (a wrong nibble order or scale moves logits by
O(1)) and allows reordering.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.engine import DecodeBatch, Engine, SamplingParams, native
from mooncake.engine.errors import EngineError
from mooncake.engine.gguf_loader import LoadedModel
from mooncake.engine.model import Block
from mooncake.engine.quant import QuantWeight, from_gguf_blocks, permute_rows
from mooncake.engine.spec import ModelSpec

LOGIT_ATOL = 2e-3
TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    """A random matrix quantized by gguf, as a QuantWeight, and gguf's dequantization of it."""
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(data, qtype)
    return from_gguf_blocks(type_name, raw, (rows, cols)), dequantize(raw, qtype)


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_hold_the_files_values_exactly(type_name: str) -> None:
    w, expected = _blocks(type_name, 24, 96, seed=1)
    assert np.array_equal(w.dequantize().numpy(), expected)  # the native dequantization
    ids = torch.tensor([[5, 0], [23, 5]])
    assert np.array_equal(w.rows(ids).numpy(), expected[ids.numpy()])  # the torch lookup


@settings(max_examples=40, deadline=None)
@given(
    type_name=st.sampled_from(TYPES),
    rows=st.integers(1, 40),  # every tile (1..8 rows) and the sliced prefill path
    out_features=st.integers(1, 70),
    blocks=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_products_equal_float32_gemm(
    type_name: str, rows: int, out_features: int, blocks: int, seed: int
) -> None:
    w, dense = _blocks(type_name, out_features, 32 * blocks, seed)
    x = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((rows, 32 * blocks)))
    x = x.float()
    want = x @ torch.from_numpy(dense).t()
    got = w(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    scale = want.abs().max().item() + 1
    assert (got - want).abs().max().item() <= 1e-5 * scale * blocks


def test_many_rows_are_sliced_and_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's product over a matrix larger than a slice: dequantized a slice at a time."""
    import mooncake.engine.quant as quant

    monkeypatch.setattr(quant, "SLICE_FLOATS", 64 * 5)  # 5 rows of 64 columns a slice
    w, dense = _blocks("Q4_1", 23, 64, seed=3)
    x = torch.randn(3, 17, 64)
    want = x @ torch.from_numpy(dense).t()
    assert torch.allclose(w(x), want, atol=1e-4)


def test_prefill_products_share_one_buffer_and_stay_right() -> None:
    """Slices of different weights, one after the other and from two threads at once, go
    through the one dequantization buffer (or a new tensor while another thread holds it):
    every product is its own weight's."""
    import threading

    import mooncake.engine.quant as quant
    from mooncake.engine.quant import DIRECT_ROWS

    weights = [_blocks(t, 40 + 7 * i, 64 * (1 + i % 3), seed=20 + i) for i, t in
               enumerate(TYPES * 3)]  # fmt: skip
    xs = [torch.randn(DIRECT_ROWS + 9, w.in_features) for w, _ in weights]
    wants = [x @ torch.from_numpy(d).t() for x, (_, d) in zip(xs, weights, strict=True)]
    seen: list[int] = []

    def run(order: list[int]) -> None:
        for i in order:
            got = weights[i][0](xs[i])
            assert torch.allclose(got, wants[i], atol=1e-4), i
            seen.append(i)

    run(list(range(len(weights))))
    assert quant.SCRATCH._buf is not None  # taken by the sliced path
    kept = quant.SCRATCH._buf.data_ptr()
    order = [i % len(weights) for i in range(60)]
    threads = [threading.Thread(target=run, args=(order[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == len(weights) + 60  # no thread died on a wrong product
    assert quant.SCRATCH._buf.data_ptr() == kept  # kept, not made again


@pytest.mark.parametrize("compiled", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("type_name", TYPES)
def test_bfloat16_dequantization_is_the_float32_values_rounded(
    type_name: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dequantized to bfloat16 (for GEMMs in bfloat16): each value is the file's float32
    value rounded to the nearest even, as torch rounds, for every row range and into a
    given buffer; other dtypes are refused."""
    if not compiled:
        monkeypatch.setattr(native, "load_quant", lambda: None)
    w, dense = _blocks(type_name, 37, 96, seed=11)
    want = torch.from_numpy(dense).bfloat16()
    got = w.dequantize(dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    buf = torch.full((37 * 96,), float("nan"), dtype=torch.bfloat16)
    part = w.dequantize(5, 30, out=buf, dtype=torch.bfloat16)
    assert torch.equal(part, want[5:30])
    with pytest.raises(EngineError, match="float32 or bfloat16"):
        w.dequantize(dtype=torch.float16)
    if compiled:  # the native kernels write into the buffer: one of another dtype is refused
        with pytest.raises(EngineError, match="buffer"):
            w.dequantize(out=torch.empty(37 * 96), dtype=torch.bfloat16)


def _quant_build(flags: tuple[str, ...]) -> ctypes.CDLL:
    """quant_gemm.c built with `flags` (skip where it does not build here)."""
    path = native.build(native.QUANT_SOURCE, flags)
    if path is None:
        pytest.skip(f"quant_gemm.c does not build here with {flags}")
    return ctypes.CDLL(str(path))


@pytest.mark.parametrize(
    "flags", [(), ("-mno-avx512bf16",), ("-mno-avx512f",)], ids=["native", "no-bf16", "avx2"]
)
def test_every_build_dequantizes_to_the_same_values(flags: tuple[str, ...]) -> None:
    """quant_gemm.c built for this machine, without AVX512_BF16 (the rounding in plain C)
    and without AVX-512 (as on an AVX2 CPU): float32 and bfloat16 values the same as
    gguf's, rounded as torch rounds."""
    lib = _quant_build(flags)
    for type_name in TYPES:
        w, dense = _blocks(type_name, 37, 96, seed=13)
        for dtype, name in ((torch.float32, "dequant"), (torch.bfloat16, "dequant_bf16")):
            fn = getattr(lib, f"mc_{w.kind}_{name}")
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
            out = torch.empty(37, 96, dtype=dtype)
            assert fn(w.qs.data_ptr(), w.scales.data_ptr(), out.data_ptr(), 0, 37, 96, 2) == 0
            assert torch.equal(out, torch.from_numpy(dense).to(dtype)), (type_name, name)


@pytest.mark.parametrize(
    "flags",
    [(), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")],
    ids=["native", "avx2", "portable"],
)
def test_every_build_multiplies_every_row_count(flags: tuple[str, ...]) -> None:
    """The direct GEMM (a decode batch's) of 1..17 rows, built for this machine, without
    AVX-512 (an AVX2 CPU) and with neither (plain C): a tile for each count up to 8, then
    whole 8s and one tile for the rest; every row equals the float32 GEMM's."""
    lib = _quant_build(flags)
    for type_name in TYPES:
        w, dense = _blocks(type_name, 37, 96, seed=17)
        fn = getattr(lib, f"mc_{w.kind}_gemm")
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        for rows in range(1, 18):
            x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, 96))).float()
            y = torch.full((rows, 37), float("nan"))
            assert fn(w.qs.data_ptr(), w.scales.data_ptr(), x.data_ptr(), y.data_ptr(),
                      rows, 37, 96, 2) == 0  # fmt: skip
            want = x @ torch.from_numpy(dense).t()
            scale = want.abs().max().item() + 1
            assert (y - want).abs().max().item() <= 1e-5 * scale * 3, (type_name, rows)


@pytest.mark.parametrize("type_name", TYPES)
def test_bfloat16_products_are_float32s_within_their_rounding(type_name: str) -> None:
    """GEMMs of many rows in bfloat16 (Decoder.use_bf16_gemms): the float32 product of the
    operands rounded to bfloat16, up to the float32 sums' order and the result's rounding
    (2^-8 of it); within bfloat16's rounding of the float32 product; few rows (a decode
    batch) stay exactly float32."""
    from mooncake.engine.quant import DIRECT_ROWS

    w, dense = _blocks(type_name, 70, 192, seed=12)
    x = torch.randn(DIRECT_ROWS + 40, 192)
    got = w(x, bf16=True)
    assert got.dtype == torch.float32 and got.shape == (DIRECT_ROWS + 40, 70)
    rounded = x.bfloat16().float() @ torch.from_numpy(dense).bfloat16().float().t()
    assert torch.allclose(got, rounded, rtol=2**-8, atol=1e-3 * rounded.abs().max().item())
    exact = x @ torch.from_numpy(dense).t()
    scale = exact.abs().max().item()
    assert 0 < (got - exact).abs().max().item() <= 0.02 * scale  # it did round, not far
    few = x[:DIRECT_ROWS]
    assert torch.equal(w(few, bf16=True), w(few))
    # Left in bfloat16 (a prefill's activations between GEMMs): the same values, and a
    # bfloat16 input is the float32 one as the GEMM rounds it.
    kept = w(x, bf16=True, out_bf16=True)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), got)
    assert torch.equal(w(x.bfloat16(), bf16=True), got)
    assert w(few, out_bf16=True).dtype == torch.float32  # no bfloat16 GEMM, nothing kept


def test_without_a_compiler_the_torch_path_gives_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    for type_name in TYPES:
        w, dense = _blocks(type_name, 20, 64, seed=4)
        x = torch.randn(5, 64)
        native_out = w(x)
        monkeypatch.setattr(native, "load_quant", lambda: None)
        fresh = QuantWeight(w.kind, w.qs, w.scales, w.out_features, w.in_features)
        assert torch.allclose(fresh(x), native_out, atol=1e-4)
        assert np.array_equal(fresh.dequantize().numpy(), dense)
        monkeypatch.undo()


def test_bad_shapes_are_refused() -> None:
    w, _ = _blocks("Q8_0", 4, 64, seed=5)
    with pytest.raises(EngineError, match="32-value blocks"):
        QuantWeight("q8", w.qs[:, :48], w.scales[:, :1], 4, 48)
    with pytest.raises(EngineError, match="expected"):
        QuantWeight("q8", w.qs, w.scales[:, :1], 4, 64)
    with pytest.raises(EngineError, match="inputs"):
        w(torch.randn(2, 32))
    q4, _ = _blocks("Q4_1", 4, 64, seed=6)
    with pytest.raises(EngineError, match="one kind"):
        QuantWeight.cat([w, q4])


def test_fused_and_permuted_rows() -> None:
    a, da = _blocks("Q4_1", 6, 64, seed=7)
    b, db = _blocks("Q4_1", 3, 64, seed=8)
    fused = QuantWeight.cat([a, b])
    assert np.array_equal(fused.dequantize().numpy(), np.concatenate([da, db]))
    order = np.array([2, 0, 1, 5, 4, 3])
    assert np.array_equal(permute_rows(a, order).dequantize().numpy(), da[order])


def test_a_partly_quantized_fused_gemm_falls_back_to_float() -> None:
    spec = ModelSpec(vocab_size=64, hidden=64, layers=1, heads=4, kv_heads=2, ffn=96, context=64)
    block = Block(spec)
    q, dense_q = _blocks("Q8_0", 64, 64, seed=9)
    o, _ = _blocks("Q4_1", 64, 64, seed=10)
    block.use_quantized({"q": q, "o": o})
    assert set(block.quant) == {"o"}  # k and v have no blocks: q, k, v stay float
    assert np.array_equal(block.q.weight.detach().numpy(), dense_q)
    assert block.o.weight.numel() == 0  # the float copy of o is freed


def test_smollm2_quantized_matches_float32(
    smollm2: LoadedModel,
    smollm2_float32: LoadedModel,
    engine: Engine,
    chat: Callable[[str], list[int]],
) -> None:
    """The served model (quantized blocks) against the same file dequantized to float32:
    logits within LOGIT_ATOL, the same greedy tokens, ~1/5 of the weight memory."""
    assert smollm2.model.quantized(), "the GGUF's Q4_1 / Q8_0 weights should stay in blocks"
    assert not smollm2_float32.model.quantized()
    assert smollm2.model.weight_bytes() < smollm2_float32.model.weight_bytes() / 4
    ref = Engine(smollm2_float32.model, smollm2_float32.tokenizer, block_tokens=engine.block_tokens)
    tokens = chat("Explain in one sentence why caching helps a web server.")
    ours = engine.prefill(tokens, all_logits=True)
    theirs = ref.prefill(tokens, all_logits=True)
    diff = (ours.logits - theirs.logits).abs().max().item()
    print("max |logit difference| quantized vs float32:", diff)
    assert diff <= LOGIT_ATOL
    outputs = []
    for e, first in ((engine, ours), (ref, theirs)):
        batch = DecodeBatch(e)
        done = batch.add("s", first, SamplingParams(max_tokens=24, stop_on_eos=False))
        while done is None:
            finished = batch.step()
            done = finished[0] if finished else None
        outputs.append(done.tokens)
    assert outputs[0] == outputs[1]
