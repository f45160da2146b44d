"""`mooncake bench cpp` end to end at a small size: stage processes, activations over the
store's transports, and the pipeline's logits equal to one worker's (dummy weights, drawn the
same in every process)."""

from __future__ import annotations

import json

import pytest

from mooncake.bench import schema
from mooncake.bench.cpp import CppBenchOptions, run_cpp_bench
from mooncake.config import DummyModel, EngineSettings, Settings
from mooncake.cpus import available

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_pipeline_of_stage_processes_computes_one_workers_logits(transport: str) -> None:
    dummy = DummyModel(layers=4, context=1024)
    # float32 in every process: under `auto` each process measures for itself whether
    # bfloat16 pays, and stages that chose otherwise than the single worker differ by
    # bfloat16's rounding, not by the pipeline.
    engine = EngineSettings(model="dummy", dummy=dummy, gemm="float32", attention="float32")
    settings = Settings(engine=engine, block_tokens=64)
    opts = CppBenchOptions(
        prompt_tokens=640, chunk_tokens=128, threads=1, stages=(2, 4), transport=transport,
        reps=2,
    )  # fmt: skip
    out = run_cpp_bench(settings, opts)
    schema.validate("cpp", json.loads(json.dumps(out | {"busy_at_start": []})))
    assert out["logits_max_abs_diff"] <= 1e-4, out
    assert out["reps"] == 2 and len(out["speedup_2_each"]) == 2, out
    # Pinned where the workers fit on CPUs of their own (`cpus.spread`).
    fits = [n for n in (1, 2, 4) if n <= len(available())]
    assert out["pinned"] == fits, out
    assert out["argmax_same_2"] and out["argmax_same_4"], out
    for n in (2, 4):
        busy = out[f"stage_busy_{n}_s"]
        assert len(busy) == n and all(b > 0 for b in busy), out
        assert out[f"ttft_{n}_s"] > 0 and out[f"speedup_{n}"] > 0
    # A ratio of two timings of millisecond prefills: at this size only its presence says
    # anything (CI saw 5.8 once, beside other work); the full bench measures it.
    assert out["parallel_2"] > 0, out


def test_a_prompt_past_the_context_or_no_repetition_is_refused() -> None:
    settings = Settings(engine=EngineSettings(model="dummy", dummy=DummyModel(context=256)))
    with pytest.raises(ValueError, match="exceeds the context"):
        run_cpp_bench(settings, CppBenchOptions(prompt_tokens=512))
    with pytest.raises(ValueError, match="reps is at least 1"):
        run_cpp_bench(settings, CppBenchOptions(prompt_tokens=128, reps=0))


def test_the_live_bench_groups_the_second_ask_and_gets_the_same_answer() -> None:
    """`bench cpp --live` at a small size: its own stack, the Conductor restarted with
    groups of two between the asks, the second ask prefilled by both prefill instances,
    the same answer (mooncake/bench/cpp_live.py)."""
    import asyncio

    from mooncake.bench.cpp_live import LiveCppOptions, run_live_cpp_bench

    dummy = DummyModel(hidden=512, layers=4, heads=8, kv_heads=4, ffn=2048, context=4096)
    # float32: the same answer must not hang on two processes' own bfloat16 measurements.
    engine = EngineSettings(model="dummy", dummy=dummy, gemm="float32", attention="float32")
    settings = Settings(engine=engine, block_tokens=64)
    # Groups wherever they pay at all: this model's chunks are milliseconds, the costs the
    # Conductor fits from them carry its per-call overheads.
    opts = LiveCppOptions(prompt_tokens=2048, chunk_tokens=256, min_efficiency=0.3, min_gain=1.0)
    out = asyncio.run(run_live_cpp_bench(settings, opts, log=lambda _: None))
    assert out["stages_1"] == [] and sorted(out["stages_2"]) == ["prefill-0", "prefill-1"], out
    assert out["same_answer"] and out["checks_passed"], out
    assert out["live_ttft_1_s"] > 0 and out["live_ttft_2_s"] > 0 and out["live_speedup_2"] > 0


def test_the_live_bench_refuses_a_prompt_of_one_chunk() -> None:
    import asyncio

    from mooncake.bench.cpp_live import LiveCppOptions, run_live_cpp_bench

    settings = Settings(engine=EngineSettings(model="dummy"))
    with pytest.raises(ValueError, match="one chunk"):
        asyncio.run(run_live_cpp_bench(settings, LiveCppOptions(prompt_tokens=100)))
