"""Joining a decode batch with a first token chosen elsewhere (disaggregated prefill), on a
small random model: decode after `resume` gives exactly the tokens of `generate()`."""

from __future__ import annotations

import pytest
import torch

from mooncake.engine import (
    Completion,
    DecodeBatch,
    Engine,
    EngineError,
    ModelSpec,
    PagedKV,
    SamplingParams,
    block_from_bytes,
    block_to_bytes,
    dummy_model,
    generate,
)

SPEC = ModelSpec(vocab_size=211, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, context=512)
BLOCK = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(dummy_model(SPEC, seed=3, std=0.2), block_tokens=BLOCK, model_id="dummy")


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def handed_over(engine: Engine, tokens: list[int]) -> tuple[PagedKV, int]:
    """What a prefill instance hands a decode instance: the prompt's KV as block bytes (whole
    blocks and a partial tail) and the first token it sampled (greedy)."""
    pf = engine.prefill(tokens)
    whole = len(tokens) // BLOCK * BLOCK
    parts = [block_to_bytes(b) for b in engine.blocks(pf.kv)]
    if whole < len(tokens):
        parts.append(block_to_bytes(pf.kv.piece(whole, len(tokens) - whole)))
    pf.kv.release()  # the prefill instance is done with it
    blocks = [block_from_bytes(p) for p in parts]
    kv = engine.prefix_from_blocks(blocks)
    return kv, int(torch.argmax(pf.logits))


def run(batch: DecodeBatch, done: dict[str, Completion]) -> None:
    while len(batch):
        done.update((c.id, c) for c in batch.step())


def test_resume_then_decode_equals_generate(engine: Engine) -> None:
    prompts = [prompt(n, i) for i, n in enumerate((3, 8, 21, 40))]
    limits = [10, 4, 16, 7]
    want = [
        generate(engine, [p], [SamplingParams(max_tokens=m)])[0]
        for p, m in zip(prompts, limits, strict=True)
    ]
    batch = DecodeBatch(engine)
    done: dict[str, Completion] = {}
    # Sequences join at different steps (continuous batching) and leave when they finish.
    for i, (p, m) in enumerate(zip(prompts, limits, strict=True)):
        kv, first = handed_over(engine, p)
        assert batch.resume(str(i), kv, p, first, SamplingParams(max_tokens=m)) is None
        done.update((c.id, c) for c in batch.step())
    run(batch, done)
    for i, w in enumerate(want):
        got = done[str(i)]
        assert got.tokens == w.tokens, i
        assert got.finish_reason == w.finish_reason == "length"
        assert got.prompt_tokens == len(prompts[i])


def test_first_token_meets_stop_and_max_tokens(engine: Engine) -> None:
    p = prompt(13, 9)
    kv, first = handed_over(engine, p)
    batch = DecodeBatch(engine)
    one = batch.resume("one", kv, p, first, SamplingParams(max_tokens=1))
    assert one is not None and one.tokens == [first] and one.finish_reason == "length"
    kv, first = handed_over(engine, p)
    stop = batch.resume("stop", kv, p, first, SamplingParams(stop_token_ids=(first,)))
    assert stop is not None and stop.tokens == [] and stop.finish_reason == "stop"
    assert not len(batch)


def test_cancel_leaves_the_others_running(engine: Engine) -> None:
    a, b = prompt(10, 1), prompt(27, 2)
    want = generate(engine, [b], [SamplingParams(max_tokens=12)])[0].tokens
    batch = DecodeBatch(engine)
    for name, p in (("a", a), ("b", b)):
        kv, first = handed_over(engine, p)
        batch.resume(name, kv, p, first, SamplingParams(max_tokens=12))
    batch.step()
    gone = batch.cancel("a")
    assert gone is not None and gone.finish_reason == "cancelled" and len(gone.tokens) == 2
    assert batch.cancel("a") is None
    done: dict[str, Completion] = {}
    run(batch, done)
    assert list(done) == ["b"] and done["b"].tokens == want


def test_resume_checks_its_inputs(engine: Engine) -> None:
    p = prompt(9, 4)
    kv, first = handed_over(engine, p)
    batch = DecodeBatch(engine)
    with pytest.raises(EngineError):
        batch.resume("x", kv, [*p, 1], first, SamplingParams())  # KV of another length
    with pytest.raises(EngineError):
        batch.resume("x", kv, p, SPEC.vocab_size, SamplingParams())  # no such token
    with pytest.raises(EngineError):
        batch.resume("x", kv, p, first, SamplingParams(stop=("a",)))  # no tokenizer
    batch.resume("x", kv, p, first, SamplingParams())
    with pytest.raises(EngineError):
        batch.resume("x", kv, p, first, SamplingParams())  # already decoding
