"""`mooncake profile engine` on a tiny dummy model: the JSON it writes is one the
Conductor's cost model fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli import app
from mooncake.core.cost_model import PROFILE_SCHEMA, parse_profile
from mooncake.engine import Engine, ModelSpec, dummy_model, native, paged
from mooncake.engine.profile import profile_engine

SPEC = ModelSpec(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, context=256)


def test_small_grid_profile_fits() -> None:
    engine = Engine(dummy_model(SPEC), block_tokens=16)
    doc = profile_engine(
        engine,
        model_name="tiny",
        prompts=(32, 64),
        cached=(0, 16, 32, 48, 70),  # 48 and 70 skipped where not < prompt or not whole blocks
        batches=(1, 3),
        contexts=(16, 40),
        reps=2,
    )
    assert doc["schema"] == PROFILE_SCHEMA and set(doc) == {
        "schema",
        "model",
        "device",
        "prefill",
        "decode",
    }
    pre = {(r["prompt_tokens"], r["cached_tokens"]) for r in doc["prefill"]}
    assert pre == {(32, 0), (32, 16), (64, 0), (64, 16), (64, 32), (64, 48)}
    assert {(r["batch"], r["context_tokens"]) for r in doc["decode"]} == {
        (1, 16),
        (3, 48),
        (1, 40),
        (3, 120),
    }
    assert all(r["seconds"] > 0 for r in doc["prefill"] + doc["decode"])
    model = parse_profile(json.loads(json.dumps(doc)))
    assert model.prefill_s(64, 0) > 0 and model.decode_step_s(3, 120) > 0


# A one-layer dummy model with a 128-token context, blocks of 16, one repetition.
TINY = [
    "profile", "engine", "--dummy", "--layers", "1", "--hidden", "32", "--heads", "4",
    "--kv-heads", "2", "--ffn", "64", "--vocab", "64", "--context", "128",
    "--block-tokens", "16", "--reps", "1",
]  # fmt: skip


def test_cli_writes_the_profile(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = [*TINY, "--prompts", "32", "--cached", "0,16", "--batches", "1,2", "--contexts", "16",
            "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["prefill"]) == 2 and len(doc["decode"]) == 2
    parse_profile(doc)
    bad = CliRunner().invoke(app, [*args[:-2], "--prompts", "500", "--out", str(out)])
    assert bad.exit_code == 2  # longer than the context: a clear error, no traceback


def test_cli_sizes_the_pool_for_a_grid_larger_than_the_default(tmp_path: Path) -> None:
    """A batch x context beyond the default pool (4 contexts of 128 + 2 blocks = 640 tokens
    here): the command sizes the pool for its grid instead of failing mid-profile."""
    out = tmp_path / "profile.json"
    args = [*TINY, "--prompts", "32", "--cached", "0", "--batches", "1,8", "--contexts", "64,100",
            "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert {(r["batch"], r["context_tokens"]) for r in doc["decode"]} == {
        (1, 64), (8, 512), (1, 100), (8, 800),
    }  # fmt: skip


def test_pool_tokens_cover_the_largest_point() -> None:
    from mooncake.engine.profile import pool_tokens_for

    tokens = pool_tokens_for([2048], [16], [4096], block_tokens=256, reps=3)
    assert tokens >= 17 * (4096 + 4)  # 16 copies and the base, each a few steps longer


def test_calibration_times_what_the_role_runs_and_leaves_the_pool_as_it_was() -> None:
    from mooncake.engine.profile import CALIBRATION_BATCHES, calibrate

    engine = Engine(dummy_model(SPEC), block_tokens=16)  # context 256: 512 cannot be timed
    free = engine.pool.pages.available
    pre = calibrate(engine, "prefill")
    assert [(x, z) for x, z, _ in pre] == [(64, 0)] and pre[0][2] > 0
    dec = calibrate(engine, "decode")
    context = min(256, engine.pool.capacity_tokens // (4 * (max(CALIBRATION_BATCHES) + 1)))
    assert [(x, z) for x, z, _ in dec] == [(b, b * context) for b in CALIBRATION_BATCHES]
    assert all(s > 0 for *_, s in dec)
    assert engine.pool.pages.available == free  # every page it took is back


def test_calibration_on_a_pool_too_small_times_what_fits_and_never_raises() -> None:
    from mooncake.engine.engine import min_pool_tokens
    from mooncake.engine.profile import calibrate

    tiny = ModelSpec(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, context=32)
    model = dummy_model(tiny)
    least = min_pool_tokens(tiny.context, 16) * tiny.kv_bytes_per_token(model.dtype.itemsize)
    engine = Engine(model, block_tokens=16, kv_budget_bytes=least)  # one context, no more
    assert calibrate(engine, "prefill") == []  # 64 and 512 tokens: over the 32-token context
    assert calibrate(engine, "decode") == []  # 4 x 256 tokens: no room, not tried


def test_cli_profiles_the_engine_a_worker_would_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile's engine takes the engine.attention / engine.gemm settings (a worker's),
    unless --attention / --gemm say otherwise, and its document names what ran; a value
    that is no precision is a usage error (exit 2) naming the choices."""
    out = tmp_path / "profile.json"
    head_dim_32 = [*TINY, "--hidden", "64", "--heads", "2", "--kv-heads", "1"]  # last wins
    args = [*head_dim_32, "--prompts", "32", "--cached", "0", "--batches", "1", "--contexts",
            "16", "--out", str(out)]  # fmt: skip
    monkeypatch.setenv("MOONCAKE_ENGINE__ATTENTION", "bfloat16")
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: 2.0)
    bf16 = native.load_prefill(32, 16, bf16=True)
    f32 = "native float32" if native.load_prefill(32, 16) is not None else "torch"
    want = "native bfloat16" if bf16 is not None and bf16.bf16 else f32
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (
        f"{want} prefill attention, float32 prefill GEMMs" in json.loads(out.read_text())["device"]
    )
    result = CliRunner().invoke(app, [*args, "--attention", "float32"])
    assert result.exit_code == 0, result.output
    assert f"{f32} prefill attention" in json.loads(out.read_text())["device"]
    bad = CliRunner().invoke(app, [*args, "--gemm", "int8"])
    assert bad.exit_code == 2 and "float32 or bfloat16" in bad.output
