"""Which prefill precision an engine built from settings takes: the dummy model's `auto` is
float32 in every process (its answers are checked token for token across processes); a real
model's `auto` asks for bfloat16 where it measures faster."""

from __future__ import annotations

from mooncake.config import EngineSettings, Settings, resolve_precision
from mooncake.serving.models import build_engine


def test_auto_is_bfloat16_where_faster_except_for_the_exact_dummy_model() -> None:
    assert resolve_precision("auto") == "bfloat16"
    assert resolve_precision("auto", exact=True) == "float32"
    assert resolve_precision("bfloat16", exact=True) == "bfloat16"  # asked for: tried
    assert resolve_precision("float32") == "float32"


def test_a_dummy_engine_prefills_in_float32_under_auto() -> None:
    engine = build_engine(Settings(engine=EngineSettings(model="dummy", prefault_kv=False)))
    assert (engine.attention, engine.gemm) == ("float32", "float32")
    assert engine.prefill_attention in ("native float32", "torch")  # "torch": no C compiler
    assert engine.prefill_gemm == "float32"
