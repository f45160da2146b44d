"""KV block layout, cross-process reuse, and the GGUF q/k row permutation, on a small
random ("dummy") model so these run in milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from mooncake.engine import (
    DecodeBatch,
    Engine,
    ModelSpec,
    SamplingParams,
    block_from_bytes,
    block_to_bytes,
    dummy_model,
)
from mooncake.engine.gguf_loader import unpermute_rows
from mooncake.engine.kv import HEADER
from mooncake.engine.paged import PagedDecode

SPEC = ModelSpec(vocab_size=97, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, context=256)
BLOCK = 8
# Run in a child process: load block bytes from a file and continue greedily from them.
CHILD = """
import json, sys
from pathlib import Path
import torch
from mooncake.engine import Engine, ModelSpec, block_from_bytes, dummy_model
sys.path.insert(0, {here!r})
from test_kv_dummy import SPEC, BLOCK, greedy
engine = Engine(dummy_model(SPEC, seed=5, std=0.2), block_tokens=BLOCK, model_id="dummy")
tokens = json.loads(Path({dir!r}, "tokens.json").read_text())
blocks = [block_from_bytes(p.read_bytes()) for p in sorted(Path({dir!r}).glob("*.kv"))]
prefix = engine.prefix_from_blocks(blocks)
print(json.dumps(greedy(engine, engine.prefill(tokens, prefix=prefix))))
"""


def greedy(engine: Engine, prefilled: object, n: int = 10) -> list[int]:
    batch = DecodeBatch(engine)
    done = batch.add("s", prefilled, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
    while done is None:
        finished = batch.step()
        done = finished[0] if finished else None
    return done.tokens


def make_engine() -> Engine:
    # std 0.2 gives peaked logits, so greedy paths are far from ties.
    return Engine(dummy_model(SPEC, seed=5, std=0.2), block_tokens=BLOCK, model_id="dummy")


def test_block_layout_is_layer_major_k_then_v() -> None:
    engine = make_engine()
    tokens = list(range(3, 3 + 2 * BLOCK + 3))
    kv = engine.prefill(tokens).kv
    data = block_to_bytes(engine.blocks(kv)[1])
    magic, version, code, _, layers, heads, n, dim = HEADER.unpack_from(data)
    assert (magic, version, code) == (b"MCKV", 1, 0)
    assert (layers, heads, n, dim) == (SPEC.layers, SPEC.kv_heads, BLOCK, SPEC.head_dim)
    payload = np.frombuffer(data[HEADER.size :], dtype="<f4").reshape(layers, 2, heads, n, dim)
    for layer in range(SPEC.layers):
        k, v = kv.read(layer, 0, kv.length)
        assert np.array_equal(payload[layer, 0], k[:, BLOCK : 2 * BLOCK].numpy())
        assert np.array_equal(payload[layer, 1], v[:, BLOCK : 2 * BLOCK].numpy())
    assert torch.equal(block_from_bytes(data), engine.blocks(kv)[1])


def test_block_bytes_continue_in_another_process(tmp_path: Path) -> None:
    engine = make_engine()
    tokens = [int(t) for t in torch.randint(0, SPEC.vocab_size, (3 * BLOCK + 5,))]
    full = engine.prefill(tokens)
    for i, block in enumerate(engine.blocks(full.kv)):
        (tmp_path / f"{i:04d}.kv").write_bytes(block_to_bytes(block))
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    here = str(Path(__file__).parent)
    code = CHILD.format(here=here, dir=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == greedy(engine, full)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's permutation, written from its definition: within each head, row
    c*D/2 + i (rotate-half layout) moves to row 2i + c (interleaved layout)."""
    rows = w.shape[0]
    d = rows // heads
    out = np.empty_like(w)
    for h in range(heads):
        for c in range(2):
            for i in range(d // 2):
                out[h * d + 2 * i + c] = w[h * d + c * d // 2 + i]
    return out


def test_unpermute_inverts_the_gguf_permutation() -> None:
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 4), 4), w)


def test_prefill_rows_equal_decode_steps() -> None:
    """Batched one-token steps reproduce the logits of a full prefill of the same tokens."""
    engine = make_engine()
    tokens = [int(t) for t in torch.randint(0, SPEC.vocab_size, (20,))]
    full = engine.prefill(tokens, all_logits=True).logits
    short = engine.prefill(tokens[:5])
    batch = DecodeBatch(engine)
    batch.add("s", short, SamplingParams(max_tokens=100, stop_on_eos=False))
    seq = batch.running["s"]
    for pos in range(5, 20):
        seq.output[-1] = tokens[pos]  # teacher forcing: feed the prompt's next token
        ids, positions = torch.tensor([[tokens[pos]]]), torch.tensor([[pos]])
        with torch.inference_mode():
            assert seq.kv.reserve(pos + 1)
            backend = PagedDecode(engine.pool, [seq.kv])
            logits = engine.model(ids, positions, backend)
        seq.kv.length += 1
        assert torch.allclose(logits[0], full[pos], atol=1e-4)
