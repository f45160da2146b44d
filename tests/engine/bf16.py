"""A bfloat16 engine for the tests that compare its prefills with float32's or the torch
path's (tests/engine/test_prefix.py, test_prefill_rows.py)."""

from __future__ import annotations

import pytest

from mooncake.engine import Engine, gemm, paged


def bf16_engine(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """`engine`'s model with bfloat16 prefill GEMMs and torch's bfloat16 attention taken
    wherever the CPU has the instructions (their speed probes answered: faster), or skip.
    It switches the shared model's GEMMs to bfloat16: the caller switches them back
    (`engine.model.use_bf16_gemms(False)`)."""
    import mooncake.engine.model as model_module

    monkeypatch.setattr(model_module, "bf16_gemms_fast", gemm.bf16_instructions)
    monkeypatch.setattr(paged, "torch_bf16_attention_speedup", lambda dim, page, kv=False: 2.0)
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: 0.0)
    bf16 = Engine(engine.model, engine.tokenizer, block_tokens=engine.block_tokens,
                  gemm="bfloat16", attention="bfloat16")  # fmt: skip
    if bf16.prefill_gemm != "bfloat16" or bf16.prefill_attention != "torch bfloat16":
        pytest.skip("no bfloat16 matrix instructions here (AMX, AVX512_BF16)")
    return bf16
