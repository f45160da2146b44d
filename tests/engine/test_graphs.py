"""The CUDA-graph decode step's logic on the CPU: bucketing, padding rows, the static inputs
and the capture-once-per-bucket rule, with an eager stand-in for the graph (no GPU here:
the capture and replay of real CUDA graphs run only in `bench engine --device cuda`).
Also the shapes `bench engine --shape` builds, and the mask-free attention over a cached
prefix that CUDA prefills use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mooncake.engine import DecodeBatch, Engine, ModelSpec, SamplingParams, dummy_model, generate
from mooncake.engine.graphs import (
    BATCH_BUCKETS,
    MAX_GATHER_TOKENS,
    GraphDecode,
    Step,
    batch_bucket,
    width_bucket,
)
from mooncake.engine.model import attention, causal_suffix_attention, merged_suffix_attention

SPEC = ModelSpec(vocab_size=50, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, context=700)


class EagerCapture:
    """Stands in for a CUDA graph: runs the step once when "captured" (as the real capture
    does to record it) and again at every replay, reading the same static inputs."""

    def __init__(self) -> None:
        self.captured = 0

    def __call__(self, step: Step) -> Step:
        self.captured += 1
        step()
        return step


def _prompts(lengths: tuple[int, ...], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[int(t) for t in torch.randint(0, 50, (n,), generator=g)] for n in lengths]


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 9, 256)] == [1, 2, 4, 4, 8, 16, 256]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [width_bucket(p) for p in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_steps_decode_what_eager_steps_decode(dtype: torch.dtype) -> None:
    """Batches of 1 to 5 sequences of different lengths (padded to buckets 1, 2, 4, 8),
    joining and leaving, crossing pages and width buckets: the same tokens as eager steps.
    bfloat16 runs the portable gathered attention, the path CUDA takes."""
    model = dummy_model(SPEC, std=0.3, dtype=dtype)
    eager = Engine(model, decode="eager")
    graphed = Engine(model, decode="eager")
    capture = EagerCapture()
    graphed.graphs = GraphDecode(model, graphed.pool, capture)
    page = graphed.pool.page_tokens
    prompts = _prompts((4 * page - 3, 7, 2 * page, 90, 16 * page - 2))  # the last: 2 widths
    params = [SamplingParams(max_tokens=m, stop_on_eos=False) for m in (12, 3, 9, 5, 6)]
    want = generate(eager, prompts, params)
    got = generate(graphed, prompts, params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    buckets = set(graphed.graphs.buckets)
    assert {b for b, _ in buckets} >= {8, 4, 2}  # 5 rows, then fewer as they leave
    assert {w for _, w in buckets} == {16, 32}
    assert capture.captured == len(buckets) == graphed.graphs.captured  # once per bucket
    # Only the scratch page stays held: padding rows never took a sequence's page.
    assert graphed.pool.pages.used == 1


def test_padding_rows_write_only_the_scratch_page() -> None:
    """A step of 3 sequences runs in the bucket of 4: the padding row writes its k, v into
    the scratch page alone; every other page holds what the eager step wrote."""
    model = dummy_model(SPEC, std=0.3)
    a, b = Engine(model, decode="eager"), Engine(model, decode="eager")
    b.graphs = GraphDecode(model, b.pool, EagerCapture())
    prompts = _prompts((5, 20, 33))
    params = SamplingParams(max_tokens=4, stop_on_eos=False)
    batches = []
    for engine in (a, b):
        batch = DecodeBatch(engine)
        for i, p in enumerate(prompts):
            batch.add(str(i), engine.prefill(p), params)
        batch.step()
        batches.append(batch)
    assert (3 in {n for n, _ in b.graphs.buckets}) is False
    scratch = b.graphs.scratch
    for seq_a, seq_b in zip(batches[0].slots, batches[1].slots, strict=True):
        for layer in range(SPEC.layers):
            ka, va = seq_a.kv.read(layer, 0, seq_a.kv.length)
            kb, vb = seq_b.kv.read(layer, 0, seq_b.kv.length)
            assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
        assert scratch not in seq_b.kv.pages
    assert b.pool.k(0)[scratch].abs().sum() > 0  # the padding row did write there


def test_a_bucket_past_the_gather_limit_runs_eagerly() -> None:
    model = dummy_model(SPEC)
    engine = Engine(model, decode="eager")
    graphs = GraphDecode(model, engine.pool, EagerCapture())
    page = engine.pool.page_tokens
    assert graphs.applies(1, 40)
    assert not graphs.applies(256, MAX_GATHER_TOKENS // (256 * page) + 1)
    assert not graphs.applies(BATCH_BUCKETS[-1] + 1, 1)


def test_warm_captures_the_listed_buckets_once() -> None:
    model = dummy_model(SPEC)
    engine = Engine(model, decode="eager")
    capture = EagerCapture()
    graphs = GraphDecode(model, engine.pool, capture)
    said: list[str] = []
    assert graphs.warm([1, 2, 3, 4], pages=20, say=said.append) == 3  # 1, 2, 4 at width 32
    assert graphs.warm([4], pages=20, say=said.append) == 0
    assert set(graphs.buckets) == {(1, 32), (2, 32), (4, 32)} and capture.captured == 3
    assert said[0].startswith("decode graphs: 3 captured")


def test_no_graphs_off_cuda() -> None:
    engine = Engine(dummy_model(SPEC))
    assert engine.graphs is None and engine.decode_path == "eager"


@pytest.mark.parametrize("new,total", [(1, 9), (5, 12), (7, 7), (64, 300)])
def test_causal_suffix_attention_is_the_masked_one(new: int, total: int) -> None:
    """The last `new` of `total` positions attending causally, GQA: the mask-free kernel
    equals attention with the explicit bottom-right causal mask."""
    g = torch.Generator().manual_seed(new)
    q = torch.randn(2, 8, new, 16, generator=g)
    k, v = torch.randn(2, 2, total, 16, generator=g), torch.randn(2, 2, total, 16, generator=g)
    mask = torch.ones((new, total), dtype=torch.bool)
    mask[:, total - new :].tril_()
    want = attention(q, k, v, mask[None, None])
    assert torch.allclose(causal_suffix_attention(q, k, v), want, atol=1e-5)


@pytest.mark.parametrize("new,total", [(1, 9), (5, 12), (64, 300), (100, 1124)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_suffix_attention_is_the_masked_one(
    new: int, total: int, dtype: torch.dtype
) -> None:
    """The CPU's two flash calls merged by log-sum-exp equal the explicitly masked attention
    (GQA, batch 2): the cached keys seen by every row, the new ones causally."""
    g = torch.Generator().manual_seed(total)
    q = torch.randn(2, 8, new, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, total, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, total, 16, generator=g).to(dtype)
    mask = torch.ones((new, total), dtype=torch.bool)
    mask[:, total - new :].tril_()
    want = attention(q.float(), k.float(), v.float(), mask[None, None])
    got = merged_suffix_attention(q, k, v)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, atol=tol), (got.float() - want).abs().max()


def test_shapes_are_the_published_configs() -> None:
    """The smollm2-135m shape is the shipped GGUF's own spec (the others are typed from
    their config.json the same way)."""
    from mooncake.engine.dummy import SHAPES
    from mooncake.engine.gguf_meta import open_gguf, smollm2_path, spec_from_gguf

    shipped = spec_from_gguf(open_gguf(smollm2_path()).fields, has_output=False)  # tied
    ours = SHAPES["smollm2-135m"]
    fields: Callable[[ModelSpec], tuple[object, ...]] = lambda s: (  # noqa: E731
        s.vocab_size, s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.rope_base,
        s.tied_embeddings,
    )  # fmt: skip
    assert fields(ours) == fields(shipped)
    assert SHAPES["llama-8b"].head_dim == 128 and SHAPES["llama-1b"].head_dim == 64


def test_shape_reference_holds_the_same_weights() -> None:
    """transformers' model built for `--shape` computes our model's logits (float32, a small
    shape): the benchmark compares like with like."""
    pytest.importorskip("transformers")
    from mooncake.bench.engine import _shape_reference

    spec = ModelSpec(
        vocab_size=64, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, context=128,
        rope_base=500000.0, tied_embeddings=False,
    )  # fmt: skip
    model = dummy_model(spec, std=0.1)
    ref = _shape_reference(model)
    tokens = _prompts((30,))[0]
    ours = Engine(model, block_tokens=16).prefill(tokens, all_logits=True).logits
    with torch.inference_mode():
        theirs = ref(torch.tensor([tokens])).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_a_decode_worker_warms_every_batch_bucket_up_to_its_max() -> None:
    from mooncake.serving.models import warm_decode

    model = dummy_model(SPEC)
    engine = Engine(model, decode="eager")
    assert warm_decode(engine, 12) == 0  # no graphs off CUDA: nothing to warm
    capture = EagerCapture()
    engine.graphs = GraphDecode(model, engine.pool, capture)
    assert warm_decode(engine, 12) == 5  # 1, 2, 4, 8 and 16 (for 9 to 12)
    assert sorted(b for b, _ in engine.graphs.buckets) == [1, 2, 4, 8, 16]
