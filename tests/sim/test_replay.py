"""Trace slices through the simulator: determinism, the global pool, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli import app
from mooncake.sim import SimConfig, run_simulation
from mooncake.sim.paper import TRACES
from mooncake.trace import TraceRequest, load_trace

CONV = TRACES / "conversation_trace.jsonl"
pytestmark = pytest.mark.skipif(not CONV.exists(), reason="shared traces not present")


@pytest.fixture(scope="module")
def conv() -> list[TraceRequest]:
    return load_trace(CONV, limit=400)


def _fingerprint(cfg: SimConfig, trace: list[TraceRequest]) -> tuple[object, ...]:
    res = run_simulation(trace, cfg)
    metrics = {k: v for k, v in res.metrics.items() if k != "wall_s"}
    return metrics, [(r.ttft, r.finished_at, r.rejected) for r in res.requests]


@pytest.mark.parametrize(
    "cfg",
    [
        SimConfig(speed=4.0, policy="predicted"),
        SimConfig(speed=4.0, scheduler="random", seed=7),
        SimConfig(system="vllm-chunked", speed=2.0),
    ],
)
def test_same_seed_same_numbers(conv: list[TraceRequest], cfg: SimConfig) -> None:
    assert _fingerprint(cfg, conv) == _fingerprint(cfg, conv)


def test_the_seed_drives_the_random_scheduler(conv: list[TraceRequest]) -> None:
    cfg = SimConfig(speed=4.0, scheduler="random", policy="none")
    a = _fingerprint(cfg, conv)
    b = _fingerprint(dataclasses.replace(cfg, seed=1), conv)
    assert a != b


def test_global_pool_hits_at_least_as_often_as_local_caches(conv: list[TraceRequest]) -> None:
    base = SimConfig(prefill_instances=10, decode_instances=4, cache_blocks_per_node=300)
    glob = run_simulation(conv, base).metrics
    local_lb = run_simulation(
        conv, dataclasses.replace(base, cache_scope="local", scheduler="load-balance")
    ).metrics
    local_aware = run_simulation(conv, dataclasses.replace(base, cache_scope="local")).metrics
    assert glob["hit_rate"] >= local_aware["hit_rate"] >= local_lb["hit_rate"] > 0
    assert glob["prefill_compute_s"] <= local_lb["prefill_compute_s"]
    assert glob["took_remote_prefix"] > 0


def test_baseline_rejects_at_the_decode_stage_after_a_wasted_prefill(
    conv: list[TraceRequest],
) -> None:
    cfg = SimConfig(policy="baseline", speed=4.0, decode_instances=1, tbt_slo_s=0.025)
    m = run_simulation(conv, cfg).metrics
    assert m["rejections_by_stage"].get("decode", 0) == m["wasted_prefills"] > 0


def test_cli_simulate_run_json() -> None:
    args = ["simulate", "run", "--trace", str(CONV), "--system", "vllm-prefix", "--limit", "60"]
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["requests"] == 60 and doc["system"] == "vllm-prefix"
    assert set(doc["effective_capacity"]) == {"100", "200", "300"}


def test_cli_rejects_an_unknown_system() -> None:
    args = ["simulate", "run", "--trace", str(CONV), "--system", "sglang", "--limit", "5"]
    assert CliRunner().invoke(app, args).exit_code == 2


def test_report_writes_markdown(tmp_path: Path) -> None:
    from mooncake.sim.report import write_report

    fake = json.loads((Path(__file__).parent / "paper_sample.json").read_text())
    written = write_report(fake, {"x": [(0.0, 0.1, 0.2)]}, tmp_path)
    text = written[0].read_text()
    assert "Global pool vs local caches" in text and "| mooncake |" in text
    assert (tmp_path / "load_x.csv").read_text().startswith("t_s,prefill_load,decode_load")
