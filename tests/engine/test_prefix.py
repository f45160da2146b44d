"""Prefill that starts from cached whole blocks, per-layer hooks, and KV blocks as bytes.

Tolerance: a prefix prefill runs the same float32 ops on fewer rows, so only matmul blocking
changes; observed differences are ~1e-5 on logits of O(10), and 1e-3 absolute still catches
any positional error (a prefix at the wrong position or a missing block moves logits by O(1)).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mooncake.engine import (
    DecodeBatch,
    Engine,
    SamplingParams,
    block_from_bytes,
    block_to_bytes,
    gemm,
    native,
    paged,
)
from mooncake.engine.engine import Prefilled
from tests.engine.bf16 import bf16_engine

ATOL = 1e-3
PROMPT = (
    "Write one sentence about the moon and the tides, then one about the sea, "
    "and finally a short line about sailors who read the stars at night."
)


def continue_greedy(engine: Engine, prefilled: Prefilled, n: int = 8) -> list[int]:
    batch = DecodeBatch(engine)
    params = SamplingParams(max_tokens=n, stop_on_eos=False)
    done = batch.add("s", prefilled, params)
    while done is None:
        finished = batch.step()
        done = finished[0] if finished else None
    return done.tokens


def test_prefill_from_cached_blocks_matches_full(
    engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    tokens = chat(PROMPT)
    full = engine.prefill(tokens, all_logits=True)
    blocks = engine.blocks(full.kv)
    assert len(blocks) == len(tokens) // engine.block_tokens >= 3
    assert len(engine.block_keys(tokens)) == len(blocks)
    for k in (1, len(blocks) - 1, engine.usable_cached_blocks(len(tokens), len(blocks))):
        prefix = engine.prefix_from_blocks(blocks[:k])
        part = engine.prefill(tokens, prefix=prefix, all_logits=True)
        assert part.cached_tokens == k * engine.block_tokens
        assert part.logits.shape[0] == len(tokens) - part.cached_tokens
        diff = (part.logits - full.logits[part.cached_tokens :]).abs().max().item()
        assert diff < ATOL, (k, diff)
        assert torch.equal(part.logits.argmax(-1), full.logits[part.cached_tokens :].argmax(-1))
    again = engine.prefill(tokens)
    prefix = engine.prefix_from_blocks(blocks[:2])
    assert continue_greedy(engine, engine.prefill(tokens, prefix=prefix)) == continue_greedy(
        engine, again
    )


def test_native_prefill_attention_gives_the_torch_paths_logits(
    engine: Engine, chat: Callable[[str], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native prefill kernel (pages read in place) against torch's attention (fused
    causal with nothing cached, the merged flash calls over a cached prefix): the same
    logits at every position, cold and with 1 or 2 cached blocks."""
    if native.load_prefill(engine.spec.head_dim, engine.pool.page_tokens) is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    tokens = chat(PROMPT)
    blocks = engine.blocks(engine.prefill(tokens).kv)
    runs: dict[bool, list[torch.Tensor]] = {}
    for on in (True, False):
        monkeypatch.setattr(paged, "NATIVE_PREFILL", on)
        runs[on] = [engine.prefill(tokens, all_logits=True).logits]
        for k in (1, 2):
            prefix = engine.prefix_from_blocks(blocks[:k])
            runs[on].append(engine.prefill(tokens, prefix=prefix, all_logits=True).logits)
    for native_logits, torch_logits in zip(runs[True], runs[False], strict=True):
        assert native_logits.shape == torch_logits.shape
        assert (native_logits - torch_logits).abs().max().item() < ATOL


def test_bfloat16_prefill_attention_is_float32s_within_its_rounding(
    engine: Engine, chat: Callable[[str], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.attention = bfloat16 (where the CPU has AVX512_BF16; measured faster or not,
    which this test does not ask: see test_speed): a cached prefix gives
    what the same bfloat16 prefill gives cold (each row's products are the same, so only
    the GEMMs' blocking differs: ATOL, the same argmax), and the logits stay near float32's:
    the same next token, and the gaps no larger than what SmolLM2 showed on random prompts
    (0.6 at worst; a key at the wrong position moves them by several)."""
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: 2.0)
    bf16 = Engine(engine.model, engine.tokenizer, block_tokens=engine.block_tokens,
                  attention="bfloat16")  # fmt: skip
    if bf16.prefill_attention != "native bfloat16":
        pytest.skip(f"prefill attention here: {bf16.prefill_attention}, not bfloat16")
    assert engine.prefill_attention == "native float32"  # the default
    tokens = chat(PROMPT)
    cold = bf16.prefill(tokens, all_logits=True)
    blocks = bf16.blocks(cold.kv)
    for k in (1, len(blocks) - 1):
        part = bf16.prefill(tokens, prefix=bf16.prefix_from_blocks(blocks[:k]), all_logits=True)
        want = cold.logits[part.cached_tokens :]
        assert (part.logits - want).abs().max().item() < ATOL, k
        assert torch.equal(part.logits.argmax(-1), want.argmax(-1))
    reference = engine.prefill(tokens, all_logits=True).logits
    assert cold.logits[-1].argmax() == reference[-1].argmax()
    assert (cold.logits - reference).abs().max().item() < 1.0
    assert 0 < (cold.logits - reference).abs().max().item()  # it did round


BF16_GEMM_LOGIT_GAP = 1.5  # SmolLM2, this prompt: 0.61 cold, 0.39 cached on a Xeon with AMX


def test_bfloat16_prefill_gemms_stay_near_float32(
    engine: Engine, chat: Callable[[str], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.gemm = bfloat16 (where the CPU has AMX or AVX512_BF16; measured faster or not,
    which this test does not ask: see test_speed): prefills' GEMMs over
    the quantized weights multiply in bfloat16. The logits stay near float32's (the same
    next token, gaps of bfloat16's rounding: BF16_GEMM_LOGIT_GAP), cold or over a cached
    prefix; a GEMM's rows change oneDNN's order of sums, so a cached prefill is not
    bit-equal to a cold one as in float32, only as near. The model's choice is put back."""
    import mooncake.engine.model as model_module

    monkeypatch.setattr(model_module, "bf16_gemms_fast", gemm.bf16_instructions)
    tokens = chat(PROMPT)
    reference = engine.prefill(tokens, all_logits=True).logits
    try:
        bf16 = Engine(engine.model, engine.tokenizer, block_tokens=engine.block_tokens,
                      gemm="bfloat16")  # fmt: skip
        if bf16.prefill_gemm != "bfloat16":
            pytest.skip("no bfloat16 matrix instructions here (AMX, AVX512_BF16)")
        assert engine.prefill_gemm == "bfloat16"  # one model: the choice is the model's
        cold = bf16.prefill(tokens, all_logits=True)
        gap = (cold.logits - reference).abs().max().item()
        assert 0 < gap < BF16_GEMM_LOGIT_GAP  # it did round, and not far
        assert cold.logits[-1].argmax() == reference[-1].argmax()
        blocks = bf16.blocks(cold.kv)
        for k in (1, len(blocks) - 1):
            part = bf16.prefill(tokens, prefix=bf16.prefix_from_blocks(blocks[:k]),
                                all_logits=True)  # fmt: skip
            want = reference[part.cached_tokens :]
            assert (part.logits - want).abs().max().item() < BF16_GEMM_LOGIT_GAP, k
            assert part.logits[-1].argmax() == want[-1].argmax(), k
    finally:
        engine.model.use_bf16_gemms(False)
    assert engine.prefill_gemm == "float32"
    assert torch.equal(engine.prefill(tokens, all_logits=True).logits, reference)


@pytest.mark.parametrize("repeats", [6, 45], ids=["one-pass", "row-chunks"])
def test_bfloat16_activations_between_bfloat16_gemms_stay_as_near(
    engine: Engine,
    chat: Callable[[str], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    repeats: int,
) -> None:
    """With bfloat16 GEMMs and torch's bfloat16 attention, a prefill keeps the GEMMs' and
    attention's inputs and outputs in bfloat16 (model.Block._prefill_dtypes): the attention
    backend is handed bfloat16 q, k, v. The logits stay as near float32's as the float32
    copies between them did (BF16_GEMM_LOGIT_GAP), with the same next token, in one pass
    and over ROW_CHUNK's row chunks; cold and over a cached prefix alike."""
    import mooncake.engine.model as model_module

    tokens = chat(" ".join([PROMPT] * repeats))
    assert (len(tokens) > model_module.ROW_CHUNK) == (repeats > 10)
    reference = engine.prefill(tokens, all_logits=True).logits
    seen: list[torch.dtype] = []
    attend = paged.PagedPrefill.__call__

    def spy(self: paged.PagedPrefill, layer: int, q: torch.Tensor, *kv: torch.Tensor) -> object:
        seen.append(q.dtype)
        return attend(self, layer, q, *kv)

    try:
        bf16 = bf16_engine(engine, monkeypatch)
        copies = model_module.Block._prefill_dtypes
        monkeypatch.setattr(model_module.Block, "_prefill_dtypes",
                            lambda self, x, backend: (x.dtype, x.dtype))  # fmt: skip
        with_copies = bf16.prefill(tokens, all_logits=True).logits
        monkeypatch.setattr(model_module.Block, "_prefill_dtypes", copies)
        monkeypatch.setattr(paged.PagedPrefill, "__call__", spy)
        cold = bf16.prefill(tokens, all_logits=True)
        assert set(seen) == {torch.bfloat16}
        for got in (with_copies, cold.logits):
            assert 0 < (got - reference).abs().max().item() < BF16_GEMM_LOGIT_GAP
            assert got[-1].argmax() == reference[-1].argmax()
        blocks = bf16.blocks(cold.kv)
        part = bf16.prefill(tokens, prefix=bf16.prefix_from_blocks(blocks[:1]), all_logits=True)
        want = reference[part.cached_tokens :]
        assert (part.logits - want).abs().max().item() < BF16_GEMM_LOGIT_GAP
        assert part.logits[-1].argmax() == want[-1].argmax()
    finally:
        engine.model.use_bf16_gemms(False)
    assert engine.prefill_gemm == "float32"


def test_bfloat16_gemms_fall_back_to_float32_where_the_cpu_lacks_them(
    engine: Engine, chat: Callable[[str], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for where the CPU has no bfloat16 matrix instructions, or where they measured
    slower than float32 (gemm.bf16_gemms_fast): float32, the same logits as the default."""
    import mooncake.engine.model as model_module

    monkeypatch.setattr(model_module, "bf16_gemms_fast", lambda: False)
    tokens = chat(PROMPT)
    reference = engine.prefill(tokens, all_logits=True).logits
    try:
        asked = Engine(engine.model, engine.tokenizer, block_tokens=engine.block_tokens,
                       gemm="bfloat16")  # fmt: skip
        assert asked.gemm == "bfloat16" and asked.prefill_gemm == "float32"
        assert torch.equal(asked.prefill(tokens, all_logits=True).logits, reference)
    finally:
        engine.model.use_bf16_gemms(False)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_prefix_prefill_in_query_runs_matches_one_run(
    engine: Engine, chat: Callable[[str], list[int]], monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """The masked attention over a cached prefix (where torch lacks the merged CPU path), in
    runs of `rows` query rows (the last one shorter), gives what the full prefill gives:
    every run sees the whole prefix, the runs before it, and itself causally."""
    tokens = chat(PROMPT)
    full = engine.prefill(tokens, all_logits=True)
    blocks = engine.blocks(full.kv)
    monkeypatch.setattr(paged, "NATIVE_PREFILL", False)
    monkeypatch.setattr(paged, "MERGED_ON_CPU", False)
    monkeypatch.setattr(paged, "PREFIX_QUERY_ROWS", rows)
    prefix = engine.prefix_from_blocks(blocks[:2])
    part = engine.prefill(tokens, prefix=prefix, all_logits=True)
    assert part.logits.shape[0] == len(tokens) - 2 * engine.block_tokens > rows
    diff = (part.logits - full.logits[part.cached_tokens :]).abs().max().item()
    assert diff < ATOL, diff


def test_hooks_run_around_every_layer_with_new_kv(
    engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    tokens = chat(PROMPT)
    blocks = engine.blocks(engine.prefill(tokens).kv)
    events: list[tuple[str, int, int]] = []
    # Layer-wise loading: the prefix starts empty and each layer is filled just in time.
    prefix = engine.new_kv()
    assert prefix.reserve(len(tokens))
    prefix.length = 2 * engine.block_tokens

    class Streaming:
        def before_layer(self, layer: int) -> None:
            for j, block in enumerate(blocks[:2]):
                prefix.load_layer(layer, j * engine.block_tokens, block[layer])
            events.append(("before", layer, 0))

        def after_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            events.append(("after", layer, k.shape[2]))

    streamed = engine.prefill(tokens, prefix=prefix, hooks=Streaming())
    new = len(tokens) - 2 * engine.block_tokens
    want = [e for i in range(engine.spec.layers) for e in (("before", i, 0), ("after", i, new))]
    assert events == want
    plain = engine.prefill(tokens)
    assert (streamed.logits - plain.logits).abs().max().item() < ATOL


def test_block_bytes_reproduce_the_continuation(
    engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    tokens = chat(PROMPT)
    full = engine.prefill(tokens)
    blobs = [block_to_bytes(b) for b in engine.blocks(full.kv)]
    expected = engine.spec.kv_bytes_per_token(4) * engine.block_tokens + 32
    assert all(len(b) == expected for b in blobs)
    loaded = [block_from_bytes(b) for b in blobs]
    k = engine.usable_cached_blocks(len(tokens), len(loaded))
    resumed = engine.prefill(tokens, prefix=engine.prefix_from_blocks(loaded[:k]))
    assert continue_greedy(engine, resumed) == continue_greedy(engine, engine.prefill(tokens))


def test_a_workers_attention_setting_reaches_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOONCAKE_ENGINE__ATTENTION goes through the settings to the engine a worker builds
    (auto by default); a precision it does not have is refused, naming the choices."""
    from pydantic import ValidationError

    from mooncake.config import load_settings
    from mooncake.serving.models import build_engine

    small = {"MOONCAKE_ENGINE__MODEL": "dummy", "MOONCAKE_ENGINE__DUMMY__LAYERS": "1",
             "MOONCAKE_ENGINE__DUMMY__CONTEXT": "64"}  # fmt: skip
    for key, value in small.items():
        monkeypatch.setenv(key, value)
    # auto by default: float32 for the dummy model (config.resolve_precision, exact).
    assert build_engine(load_settings()).attention == "float32"
    monkeypatch.setenv("MOONCAKE_ENGINE__ATTENTION", "float32")
    assert build_engine(load_settings()).attention == "float32"
    monkeypatch.setenv("MOONCAKE_ENGINE__ATTENTION", "bfloat16")
    engine = build_engine(load_settings())
    assert engine.attention == "bfloat16"
    assert engine.prefill(list(range(3, 40))).logits.isfinite().all()
    monkeypatch.setenv("MOONCAKE_ENGINE__ATTENTION", "float16")
    with pytest.raises(ValidationError, match="'auto', 'float32' or 'bfloat16'"):
        load_settings()


def test_a_worker_asked_for_bfloat16_that_measures_slower_runs_float32_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """engine.attention = bfloat16 where the bfloat16 kernel measured slower (as on a Xeon
    whose VM hides AMX): the worker runs float32 attention and its warning gives the ratio."""
    import logging

    from mooncake.config import load_settings
    from mooncake.serving.models import build_engine

    small = {"MOONCAKE_ENGINE__MODEL": "dummy", "MOONCAKE_ENGINE__DUMMY__LAYERS": "1",
             "MOONCAKE_ENGINE__DUMMY__CONTEXT": "64",
             "MOONCAKE_ENGINE__ATTENTION": "bfloat16"}  # fmt: skip
    for key, value in small.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: 0.65)
    monkeypatch.setattr(paged, "torch_bf16_attention_speedup", lambda dim, page, kv=False: 0.6)
    with caplog.at_level(logging.WARNING):
        engine = build_engine(load_settings())
    assert engine.attention == "bfloat16"
    if engine.prefill_attention == "torch":
        pytest.skip("no native prefill kernel here")
    assert engine.prefill_attention == "native float32"
    assert "ran at best 0.65x as fast as float32's here" in caplog.text
