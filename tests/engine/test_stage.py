"""A chunked-pipeline prefill (engine.stage) against the engine's own single prefill, on the
shipped SmolLM2: the same logits (to float rounding: the same float32 ops over other row
blocks) and, from the stages' KV put together, the same greedy continuation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_prefix import PROMPT, continue_greedy

from mooncake.core.cpp import CppPlan
from mooncake.engine import Engine, EngineError
from mooncake.engine.engine import Prefilled
from mooncake.engine.pool import PagedKV
from mooncake.engine.stage import run_chunk

ATOL = 1e-4  # issue 19's bound for float32 activations


def run_plan(
    engine: Engine, tokens: list[int], plan: CppPlan
) -> tuple[torch.Tensor, list[PagedKV]]:
    """Every chunk through every stage in order (one process: what the stage workers do)."""
    kvs = [engine.new_kv() for _ in plan.layers]
    logits = None
    for k, (a, b) in enumerate(plan.chunks):
        x: list[int] | torch.Tensor = tokens[a:b]
        for s, layers in enumerate(plan.layers):
            last = k == len(plan.chunks) - 1 and s == plan.stages - 1
            x = run_chunk(engine, kvs[s], layers, a, x, logits=last)
        logits = x
    assert isinstance(logits, torch.Tensor)
    return logits, kvs


def merged(engine: Engine, plan: CppPlan, kvs: list[PagedKV]) -> PagedKV:
    """One sequence's KV from the stages' (each holds its own layers), as decode gets it."""
    per_stage = [engine.blocks(kv) for kv in kvs]
    blocks = []
    for j in range(len(per_stage[0])):
        block = per_stage[0][j].clone()
        for (first, end), stage in zip(plan.layers, per_stage, strict=True):
            block[first:end] = stage[j][first:end]
        blocks.append(block)
    return engine.prefix_from_blocks(blocks)


@pytest.mark.parametrize(("stages", "chunk"), [(2, 16), (3, 32), (4, 48)])
def test_cpp_prefill_equals_a_single_prefill(
    engine: Engine, chat: Callable[[str], list[int]], stages: int, chunk: int
) -> None:
    tokens = chat(PROMPT + " " + PROMPT)
    tokens = tokens[: len(tokens) // engine.block_tokens * engine.block_tokens]
    plan = CppPlan.of(len(engine.model.layers), stages, 0, len(tokens), chunk)
    assert plan.stages == stages and len(plan.chunks) >= 2
    single = engine.prefill(tokens)
    logits, kvs = run_plan(engine, tokens, plan)
    assert torch.allclose(logits, single.logits, atol=ATOL, rtol=0), (
        (logits - single.logits).abs().max()
    )
    want = continue_greedy(engine, single)
    got = continue_greedy(engine, Prefilled(tokens, merged(engine, plan, kvs), logits, 0))
    assert got == want


def test_a_stage_refuses_what_does_not_fit_its_place(engine: Engine) -> None:
    kv = engine.new_kv()
    hidden = torch.zeros(1, 4, engine.spec.hidden)
    with pytest.raises(EngineError, match="takes token ids"):
        run_chunk(engine, kv, (0, 2), 0, hidden)
    with pytest.raises(EngineError, match="hidden state"):
        run_chunk(engine, kv, (2, 4), 0, [1, 2, 3])
    with pytest.raises(EngineError, match="does not follow"):
        run_chunk(engine, kv, (0, 2), 8, [1, 2, 3])
    with pytest.raises(EngineError, match="not a range"):
        run_chunk(engine, kv, (0, 99), 0, [1, 2, 3])
    with pytest.raises(EngineError, match="last layer"):
        run_chunk(engine, kv, (0, 2), 0, [1, 2, 3], logits=True)
