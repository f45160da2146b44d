"""The native RoPE of a prefill's rows (native/prefill_rows.c, model._row_kernels): bit for
bit what the torch path computes, for every dtype pair a prefill uses, partial rotary
dims, a last-position-only q and row offsets; and whole prefills with it give the torch
path's logits exactly, in one pass and in row chunks, cold and over a cached prefix."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mooncake.engine.model as model_module
from mooncake.engine import Engine, native
from mooncake.engine.model import apply_rope
from tests.engine.bf16 import bf16_engine

ROWS = native.load_rows()
needs_kernel = pytest.mark.skipif(ROWS is None, reason="no C compiler here: the torch path runs")


def tables(rows: int, rot: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, rot] float32 as Decoder.rope makes them (positions start..)."""
    pos = torch.arange(start, start + rows, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = pos[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
    dim: int, out: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The torch path's q, k, v [heads, rows, dim] (model.apply_rope on the GEMM's result)."""
    rows = qkv.shape[0]
    split = qkv.view(rows, heads + 2 * kv_heads, dim).transpose(0, 1)[None]
    qk = apply_rope(split[:, : heads + kv_heads], cos[None, None], sin[None, None])
    v = split[:, heads + kv_heads :]
    return qk[0, :heads].to(out), qk[0, heads:].to(out), v[0].to(out)


@needs_kernel
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("rot", [64, 32], ids=["full-rotary", "partial-rotary"])
def test_rope_qkv_is_the_torch_paths_result_bit_for_bit(
    src: torch.dtype, dst: torch.dtype, rot: int
) -> None:
    assert ROWS is not None
    heads, kv_heads, dim, rows = 9, 3, 64, 37
    gen = torch.Generator().manual_seed(rot)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(src)
    cos, sin = tables(rows, rot, start=100)
    want_q, want_k, want_v = reference(qkv, cos, sin, heads, kv_heads, dim, dst)
    q = torch.full((heads, rows, dim), float("nan"), dtype=dst)
    k, v = torch.full_like(q[:kv_heads], float("nan")), torch.full_like(q[:kv_heads], 7.0)
    ROWS.rope_qkv(qkv, cos, sin, q, k, v, 0, 0, 0)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)


@needs_kernel
def test_rope_qkv_writes_at_row_offsets_and_only_the_asked_for_q_rows() -> None:
    """A row chunk's rows land at their positions in k and v; q takes rows q_from.. at
    q_row0.. and nothing else of q is written (a last-position-only q, a chunked prefill)."""
    assert ROWS is not None
    heads, kv_heads, dim, total, a, z = 4, 2, 64, 50, 20, 35
    qkv = torch.randn(z - a, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    cos, sin = tables(z - a, dim, start=a)
    want_q, want_k, want_v = reference(qkv, cos, sin, heads, kv_heads, dim, torch.bfloat16)
    q = torch.zeros(heads, 1, dim, dtype=torch.bfloat16)
    k = torch.zeros(kv_heads, total, dim, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    ROWS.rope_qkv(qkv, cos, sin, q, k, v, a, z - a - 1, 0)  # q: the chunk's last row only
    assert torch.equal(q[:, 0], want_q[:, -1])
    assert torch.equal(k[:, a:z], want_k) and torch.equal(v[:, a:z], want_v)
    assert not k[:, :a].any() and not k[:, z:].any()
    assert not v[:, :a].any() and not v[:, z:].any()
    q_all = torch.zeros(heads, total, dim, dtype=torch.bfloat16)
    ROWS.rope_qkv(qkv, cos, sin, q_all, k, v, a, 0, a)
    assert torch.equal(q_all[:, a:z], want_q) and not q_all[:, :a].any()
    with pytest.raises(RuntimeError, match="shapes"):  # k too short for the offset
        ROWS.rope_qkv(qkv, cos, sin, q_all, k[:, :30], v[:, :30], a, 0, a)
    with pytest.raises(RuntimeError, match="shapes"):  # float64 tables
        ROWS.rope_qkv(qkv, cos.double(), sin.double(), q_all, k, v, a, 0, a)


@needs_kernel
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("repeats", [6, 45], ids=["one-pass", "row-chunks"])
def test_prefills_with_the_native_rope_give_the_torch_paths_logits(
    engine: Engine,
    chat: Callable[[str], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    repeats: int,
    precision: str,
) -> None:
    """float32: the engine's float32 path; bfloat16: bfloat16 GEMMs and attention, so the
    kernel reads bfloat16 rows and writes bfloat16 q, k, v (model.Block._prefill_dtypes)."""
    from tests.engine.test_prefix import PROMPT

    try:
        check_prefills(engine, chat, monkeypatch, repeats, precision, PROMPT)
    finally:
        engine.model.use_bf16_gemms(False)  # the shared model as the other tests want it


def check_prefills(
    engine: Engine,
    chat: Callable[[str], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    repeats: int,
    precision: str,
    prompt: str,
) -> None:
    if precision == "bfloat16":
        engine = bf16_engine(engine, monkeypatch)
    else:
        engine = Engine(engine.model, engine.tokenizer, block_tokens=engine.block_tokens,
                        gemm="float32", attention="float32")  # fmt: skip
    tokens = chat(" ".join([prompt] * repeats))
    assert (len(tokens) > model_module.ROW_CHUNK) == (repeats > 10)
    used: list[tuple[bool, torch.dtype]] = []  # (the kernel applies, q, k, v's dtype)
    kernels = model_module._row_kernels

    def spy(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, att: torch.dtype
    ) -> native.RowKernels | None:
        got = kernels(x, cos, sin, att)
        used.append((got is not None, att))
        return got

    monkeypatch.setattr(model_module, "_row_kernels", spy)
    cold = engine.prefill(tokens, all_logits=True)
    last = engine.prefill(tokens).logits
    cached = engine.prefill(tokens, prefix=engine.prefix_from_blocks(engine.blocks(cold.kv)[:1]))
    want_att = torch.bfloat16 if precision == "bfloat16" else torch.float32
    assert used and all(applies and att == want_att for applies, att in used)
    monkeypatch.setattr(model_module, "_row_kernels", lambda *args: None)  # the torch path
    want = engine.prefill(tokens, all_logits=True)
    assert torch.equal(cold.logits, want.logits)
    assert torch.equal(last, engine.prefill(tokens).logits)  # the last position's q only
    assert torch.equal(engine.blocks(cold.kv)[0], engine.blocks(want.kv)[0])  # the KV too
    want_cached = engine.prefill(
        tokens, prefix=engine.prefix_from_blocks(engine.blocks(want.kv)[:1])
    )
    assert torch.equal(cached.logits, want_cached.logits)
