"""`mooncake bench cpp` end to end at a small size: stage processes, activations over the
store's transports, and the pipeline's logits equal to one worker's (dummy weights, drawn the
same in every process)."""

from __future__ import annotations

import pytest

from mooncake.bench.cpp import CppBenchOptions, run_cpp_bench
from mooncake.config import DummyModel, EngineSettings, Settings

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_pipeline_of_stage_processes_computes_one_workers_logits(transport: str) -> None:
    dummy = DummyModel(layers=4, context=1024)
    settings = Settings(engine=EngineSettings(model="dummy", dummy=dummy), block_tokens=64)
    opts = CppBenchOptions(
        prompt_tokens=640, chunk_tokens=128, threads=1, stages=(2, 4), transport=transport
    )
    out = run_cpp_bench(settings, opts)
    assert out["logits_max_abs_diff"] <= 1e-4, out
    assert out["argmax_same_2"] and out["argmax_same_4"], out
    for n in (2, 4):
        busy = out[f"stage_busy_{n}_s"]
        assert len(busy) == n and all(b > 0 for b in busy), out
        assert out[f"ttft_{n}_s"] > 0 and out[f"speedup_{n}"] > 0
    # A ratio of two timings of millisecond prefills: at this size only its presence says
    # anything (CI saw 5.8 once, beside other work); the full bench measures it.
    assert out["parallel_2"] > 0, out


def test_a_prompt_past_the_context_is_refused() -> None:
    settings = Settings(engine=EngineSettings(model="dummy", dummy=DummyModel(context=256)))
    with pytest.raises(ValueError, match="exceeds the context"):
        run_cpp_bench(settings, CppBenchOptions(prompt_tokens=512))
