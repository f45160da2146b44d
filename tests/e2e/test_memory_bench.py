"""`mooncake bench memory`, CI-sized: the whole stack as `mooncake up` runs it (its own broker
and database), the dummy model with a KV budget of about two contexts per engine worker, and
a replay of 20 requests at 50x whose KV together is many times that budget. Checked: nothing
failed, no worker was killed, every request ended in exactly one terminal event, every
engine role stayed within the memory bound it states (on PSS), and the decode workers
preempted sequences for pages (and resumed them) rather than running out of memory.

The trace is the test's own, in the Mooncake format: the conversation trace's outputs are
~7 % of its prompts, so a small pool holds one of its requests at a time and output growth
never outruns the admission reserve (correctly: nothing to preempt). Here outputs are twice
the prompts, as in long answers, so several requests decode together and outgrow the pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.bench import schema
from mooncake.bench.memory import MemoryOptions, run_memory_bench
from mooncake.config import load_settings
from mooncake.replay_live import LiveReplayOptions, fitted_trace, max_tokens
from mooncake.stack import ENGINE_ROLES, LAYOUT
from mooncake.trace_fit import prompt_tokens

pytestmark = pytest.mark.e2e

BLOCK = 64
CONTEXT = 2048
ENV = {
    "MOONCAKE_ENGINE__MODEL": "dummy",
    "MOONCAKE_ENGINE__DUMMY__CONTEXT": str(CONTEXT),
    "MOONCAKE_BLOCK_TOKENS": str(BLOCK),
    "MOONCAKE_STORE__DRAM_BYTES": str(64 << 20),
    "MOONCAKE_LOG_LEVEL": "WARNING",
}
REQUESTS = 20


def long_answers_trace(path: Path) -> Path:
    """20 arrivals over 10 s: 2,048-token prompts (4 trace blocks, a shared first one) and
    4,096-token answers; scaled to blocks of 64 that is 256 + 512 tokens each."""
    with path.open("w") as f:
        for i in range(REQUESTS):
            row = {"timestamp": 500 * i, "input_length": 2048, "output_length": 4096,
                   "hash_ids": [0, 3 * i + 1, 3 * i + 2, 3 * i + 3]}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


@pytest.mark.timeout(180)
async def test_every_role_stays_within_its_bound_when_the_kv_working_set_exceeds_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The workers are `mooncake up`'s children: they read these too.
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    d = load_settings().engine.dummy
    per_token = 2 * d.layers * d.kv_heads * (d.hidden // d.heads) * 4
    budget = 2 * (CONTEXT + 2 * BLOCK) * per_token  # twice the engine's minimum
    settings = load_settings(kv_cache_bytes=budget)
    # Outputs uncapped; no paged-vs-contiguous decode run: that is the full command's.
    opts = MemoryOptions(
        speed=50.0, limit=REQUESTS, trace=long_answers_trace(tmp_path / "trace.jsonl"),
        max_output_tokens=4096, timeout_s=120.0, ready_timeout_s=120.0, decode_ratio=None,
    )  # fmt: skip

    # The premise: the requests' KV (prompt + output) is several times one worker's pool.
    replay = LiveReplayOptions(
        opts.trace, limit=opts.limit, tokens_per_block=BLOCK,
        max_output_tokens=opts.max_output_tokens, context_tokens=CONTEXT,
    )  # fmt: skip
    trace, _ = fitted_trace(replay)
    working_set = sum(prompt_tokens(r.input_length, BLOCK) + max_tokens(r, replay) for r in trace)
    assert working_set * per_token > 3 * budget

    result = await run_memory_bench(settings, opts, log=lambda m: print(m, flush=True))
    (tmp_path / "memory.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    schema.validate("memory", json.loads(json.dumps(result)))  # the fields a script reads

    assert result["kv_budget_bytes"] == budget
    assert result["requests"] == opts.limit and result["completed"] > 0
    assert result["failed"] == 0, result["failed_by_reason"]
    assert result["oom_kills"] == 0, result["worker_exits"]
    assert result["terminal_exactly_once"], result["terminal_violations"]
    # Each worker's memory as a share of what it maps (PSS) within the bound it states at
    # start (weights + KV + its store segment + 600 MiB). Its RSS also counts its peers'
    # store segments (shm copies map them): reported, not held to issue 15's formula here.
    assert result["within_stated_bounds_pss"], result["roles"]
    engine_roles = [
        r for name, r in result["roles"].items() if name.rsplit("-", 1)[0] in ENGINE_ROLES
    ]
    control = [r for n, r in result["roles"].items() if n.startswith(("conductor", "store-master"))]
    assert control and all(r["bound_mb"] is not None for r in control), result["roles"]
    engines = sum(n for role, n in LAYOUT if role in ENGINE_ROLES)  # `up`'s layout
    assert len(engine_roles) == engines and all(r["peak_rss_mb"] > 0 for r in engine_roles)
    # Preemption instead of OOM: a decode worker takes sequences out of its batch when its
    # pool runs out of pages, and every one of them still completed (above).
    assert result["preemptions"] > 0 and result["rejected"] == 0
