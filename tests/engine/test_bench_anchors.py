"""`bench engine`'s llama.cpp side, against a stand-in with llama-cpp-python's interface (the
real one is an optional extra that CI never installs): prompts evaluated before the clock,
greedy tokens fed back one at a time, and the fields computed from the paired times."""

from __future__ import annotations

import ctypes
import time

import numpy as np
from typer.testing import CliRunner

from mooncake.bench import engine as bench
from mooncake.cli import app
from mooncake.engine import Engine


class FakeContext:
    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def get_logits_ith(self, i: int) -> object:
        assert i == -1
        return self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class FakeLlama:
    """Records what it is asked to evaluate; its last logits favour token (n_tokens * 7) % V."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.n_tokens, self.evals = vocab, 0, []
        self.last = np.zeros(vocab, dtype=np.float32)
        self._ctx = FakeContext(self.last)

    def n_vocab(self) -> int:
        return self.vocab

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.evals.append(list(tokens))
        time.sleep(0.005)  # a time that does not round to nothing against the engine's
        self.n_tokens += len(tokens)
        self.last[:] = 0
        self.last[(self.n_tokens * 7) % self.vocab] = 1


def test_llamacpp_decode_feeds_back_its_greedy_tokens() -> None:
    llm = FakeLlama(vocab=50)
    seconds = bench._llamacpp_decode(llm, list(range(10)), steps=3)()
    assert seconds >= 0
    assert llm.evals == [list(range(10)), [(10 * 7) % 50], [(11 * 7) % 50], [(12 * 7) % 50]]


def test_llamacpp_fields(engine: Engine) -> None:
    llm = FakeLlama(vocab=engine.spec.vocab_size)
    out = bench._bench_llamacpp(engine, llm, 32, 4, b8_tok_s=100.0, reps=1, log=lambda _: None)
    assert out["llamacpp_decode_prompt_tokens"] == bench.LLAMACPP_DECODE_PROMPT
    for key in ("llamacpp_prefill_tok_s", "llamacpp_decode_tok_s_b1", "llamacpp_prefill_ratio",
                "llamacpp_decode_ratio", "decode_tok_s_b1_after_512"):  # fmt: skip
        value = out[key]
        assert isinstance(value, float) and value > 0, key
    theirs = out["llamacpp_decode_tok_s_b1"]
    assert isinstance(theirs, float)
    assert abs(out["b8_over_llamacpp_b1"] - 100.0 / theirs) <= 0.01 * 100.0 / theirs  # type: ignore[operator]


def test_bench_engine_refuses_decode_runs_longer_than_the_context() -> None:
    got = CliRunner().invoke(app, ["bench", "engine", "--decode-prompt", "8150"])
    assert got.exit_code == 2, got.output
    assert "need 8270 positions; the model has 8192" in got.output


def test_bench_engine_refuses_an_attention_it_does_not_have() -> None:
    got = CliRunner().invoke(app, ["bench", "engine", "--attention", "float16"])
    assert got.exit_code == 2, got.output
    assert "float32 or bfloat16" in got.output


def test_bench_engine_refuses_a_gemm_precision_it_does_not_have() -> None:
    got = CliRunner().invoke(app, ["bench", "engine", "--gemm", "int8"])
    assert got.exit_code == 2, got.output
    assert "float32 or bfloat16" in got.output and "--gemm" in got.output
