"""Bad input gives an EngineError with a clear message, never a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake.engine import Engine, EngineError, SamplingParams, block_from_bytes
from mooncake.engine.gguf_loader import load_gguf, smollm2_path


def test_empty_prompt(engine: Engine) -> None:
    with pytest.raises(EngineError, match="empty prompt"):
        engine.prefill([])


def test_prompt_longer_than_context(engine: Engine) -> None:
    with pytest.raises(EngineError, match="exceeds the context"):
        engine.prefill([1] * (engine.spec.context + 1))


@pytest.mark.parametrize("bad", [-1, 49152, 10**12])
def test_unknown_token_ids(engine: Engine, bad: int) -> None:
    with pytest.raises(EngineError, match="unknown token ids"):
        engine.prefill([1, 2, bad])


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}],
)
def test_bad_sampling_params(kwargs: dict[str, float]) -> None:
    with pytest.raises(EngineError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_prefix_must_be_shorter_than_prompt(engine: Engine) -> None:
    tokens = list(range(100, 100 + 2 * engine.block_tokens))
    blocks = engine.blocks(engine.prefill(tokens).kv)
    with pytest.raises(EngineError, match="shorter than the prompt"):
        engine.prefill(tokens, prefix=engine.prefix_from_blocks(blocks))


def test_a_partial_block_only_at_the_end(engine: Engine) -> None:
    tokens = list(range(100, 100 + 2 * engine.block_tokens))
    kv = engine.prefill(tokens).kv
    whole, part = engine.blocks(kv)[0], kv.piece(0, 3)
    with pytest.raises(EngineError, match="must hold"):
        engine.prefix_from_blocks([part, whole])
    assert engine.prefix_from_blocks([whole, part]).length == engine.block_tokens + 3


def test_corrupt_kv_bytes() -> None:
    for data in (b"", b"XXXX" + bytes(40), b"MCKV" + bytes(28) + b"extra"):
        with pytest.raises(EngineError):
            block_from_bytes(data)


def test_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no GGUF file"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("keep", [0, 7, 4096, 2_000_000])
def test_truncated_gguf(tmp_path: Path, keep: int) -> None:
    try:
        source = smollm2_path()
    except EngineError as e:
        pytest.skip(str(e))
    bad = tmp_path / "truncated.gguf"
    with source.open("rb") as f:
        bad.write_bytes(f.read(keep))
    with pytest.raises(EngineError):
        load_gguf(bad)


def test_garbage_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(EngineError):
        load_gguf(bad)
