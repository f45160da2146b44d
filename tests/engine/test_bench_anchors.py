"""`bench engine`'s llama.cpp side, against a stand-in with llama-cpp-python's interface (the
real one is an optional extra that CI never installs): prompts evaluated before the clock,
greedy tokens fed back one at a time, and the fields computed from the paired times. The
stand-in runs in a child process as llama.cpp does, and one that dies (SIGILL, as llama.cpp
did on a VM with AMX), hangs or is not installed costs its own fields only."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from anchor_standins import FakeLlama, dying, fake_runner, not_installed
from typer.testing import CliRunner

from mooncake.bench import engine as bench
from mooncake.bench.child import AnchorFailed, Child, exit_reason
from mooncake.bench.llamacpp import Runner
from mooncake.cli import app
from mooncake.engine import Engine


def test_llamacpp_decode_feeds_back_its_greedy_tokens() -> None:
    llm = FakeLlama(vocab=50)
    seconds = Runner(llm).decode(list(range(10)), steps=3)
    assert seconds >= 0
    assert llm.evals == [list(range(10)), [(10 * 7) % 50], [(11 * 7) % 50], [(12 * 7) % 50]]


def _fields(engine: Engine, factory: Any, *args: Any, timeout_s: float = 60) -> dict[str, Any]:
    return bench._llamacpp_fields(engine, 32, 4, 100.0, 1, lambda _: None, factory=factory,
                                  args=args, call_timeout_s=timeout_s)  # fmt: skip


def test_llamacpp_fields(engine: Engine) -> None:
    out = _fields(engine, fake_runner, engine.spec.vocab_size)
    assert out["llamacpp"] == {"error": None}
    assert out["llamacpp_decode_prompt_tokens"] == bench.LLAMACPP_DECODE_PROMPT
    for key in ("llamacpp_prefill_tok_s", "llamacpp_decode_tok_s_b1", "llamacpp_prefill_ratio",
                "llamacpp_decode_ratio", "decode_tok_s_b1_after_512"):  # fmt: skip
        value = out[key]
        assert isinstance(value, float) and value > 0, key
    theirs = out["llamacpp_decode_tok_s_b1"]
    assert isinstance(theirs, float)
    assert abs(out["b8_over_llamacpp_b1"] - 100.0 / theirs) <= 0.01 * 100.0 / theirs


def test_an_anchor_that_dies_is_a_field_saying_how(engine: Engine) -> None:
    assert _fields(engine, dying, "sigill") == {"llamacpp": {"error": "SIGILL"}}
    assert _fields(engine, dying, "exit") == {"llamacpp": {"error": "exit 3"}}


def test_an_anchor_that_hangs_is_killed_and_named(engine: Engine) -> None:
    t0 = time.monotonic()
    assert _fields(engine, dying, "hang", timeout_s=2) == {
        "llamacpp": {"error": "no answer within 2 s"}
    }
    assert time.monotonic() - t0 < 30


def test_an_anchor_that_cannot_start_says_why() -> None:
    with pytest.raises(AnchorFailed, match="No module named 'llama_cpp_not_here'"):
        Child(not_installed)


def test_exit_reasons() -> None:
    assert exit_reason(-signal.SIGKILL) == "SIGKILL"
    assert exit_reason(2) == "exit 2"
    assert exit_reason(None) == "its pipe closed while it ran"


def test_a_missing_llama_cpp_is_a_field(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    out = bench._llamacpp_fields(engine, 32, 4, 100.0, 1, lambda _: None)
    assert out == {
        "llamacpp": {"error": "llama-cpp-python is not installed (pip install '.[anchors]')"}
    }


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
