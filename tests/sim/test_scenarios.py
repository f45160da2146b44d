"""Tiny simulations whose numbers are worked out by hand from the reference cost model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mooncake.core.cost_model import reference_costs
from mooncake.sim import SYSTEMS, SimConfig, run_simulation
from mooncake.sim.cache import LRUBlocks
from mooncake.sim.request import tbt_score
from mooncake.sim.runner import System
from mooncake.trace import TraceRequest

COSTS = reference_costs()
ONE = SimConfig(prefill_instances=1, decode_instances=1, instances=1, policy="none")


def req(i: int, at: float, tokens: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(i, at, tokens, out, ids)


def blocks(first: int, n: int) -> tuple[int, ...]:
    return tuple(range(first, first + n))


@pytest.mark.parametrize("system", SYSTEMS)
def test_one_request_ttft_is_the_prefill_time(system: System) -> None:
    res = run_simulation([req(0, 0.0, 4096, 1, blocks(0, 8))], replace(ONE, system=system))
    (r,) = res.requests
    assert r.ttft == pytest.approx(COSTS.prefill.prefill_s(4096, 0), rel=1e-9)
    assert r.done and r.reused_tokens == 0


def test_one_request_decodes_one_step_per_token() -> None:
    res = run_simulation([req(0, 0.0, 1000, 3, blocks(0, 2))], ONE)
    (r,) = res.requests
    assert len(r.gaps) == 2  # tokens 2 and 3 come from decode steps
    # Second gap: exactly one decode step of a batch of 1 with context 1000 + 2 tokens.
    assert r.gaps[1] == pytest.approx(COSTS.decode.decode_step_s(1, 1002))


def test_a_cached_prefix_shortens_the_prefill_mooncake() -> None:
    first = req(0, 0.0, 4096, 1, blocks(0, 8))
    again = req(1, 100.0, 5000, 1, (*blocks(0, 8), 99, 100))  # 8 shared blocks = 4096 tokens
    res = run_simulation([first, again], ONE)
    r = res.requests[1]
    assert r.reused_tokens == 4096
    assert r.ttft == pytest.approx(COSTS.prefill.prefill_s(5000, 4096))
    assert r.ttft is not None and r.ttft < COSTS.prefill.prefill_s(5000, 0)


def test_a_cached_prefix_shortens_the_prefill_vllm_prefix() -> None:
    first = req(0, 0.0, 4096, 1, blocks(0, 8))
    again = req(1, 100.0, 5000, 1, (*blocks(0, 8), 99, 100))
    plain = run_simulation([first, again], replace(ONE, system="vllm")).requests[1]
    cached = run_simulation([first, again], replace(ONE, system="vllm-prefix")).requests[1]
    f = COSTS.prefill.prefill_s
    assert plain.ttft == pytest.approx(f(5000, 0))
    assert cached.ttft == pytest.approx(f(5000, 0) - f(4096, 0))  # the new tokens' FLOPs


def _decoding_then_long_prompt(system: System) -> list[float]:
    talker = req(0, 0.0, 1000, 200, blocks(0, 2))
    long_prompt = req(1, 0.5, 20_000, 1, blocks(10, 40))
    res = run_simulation([talker, long_prompt], replace(ONE, system=system))
    return res.requests[0].gaps


def test_chunked_prefill_interleaves_decode_steps() -> None:
    stalled = _decoding_then_long_prompt("vllm")
    chunked = _decoding_then_long_prompt("vllm-chunked")
    whole = COSTS.prefill.prefill_s(20_000, 0)
    # vllm: one gap holds the whole 20k-token prefill (the decode stalls behind it).
    assert max(stalled) >= whole
    # chunked: every gap is one decode step plus at most one 511-token chunk.
    f = COSTS.prefill.prefill_s
    worst_chunk = f(20_000, 0) - f(20_000 - 511, 0)
    assert max(chunked) <= COSTS.decode.decode_step_s(1, 1200) + worst_chunk + 1e-9
    assert max(chunked) < whole / 10


def test_tbt_score_is_the_mean_of_the_slowest_tenth() -> None:
    assert tbt_score([float(g) for g in range(1, 21)]) == pytest.approx(19.5)  # (20 + 19) / 2
    assert tbt_score([0.02, 0.5, 0.02]) == pytest.approx(0.5)  # ceil: at least one gap
    assert tbt_score([]) == 0.0


def test_lru_blocks_evict_least_recently_used() -> None:
    c = LRUBlocks(3)
    assert c.insert(["a", "b", "c"]) == []
    c.insert(["a"])  # refresh a
    assert c.insert(["d"]) == ["b"]
    assert c.prefix_blocks(["a", "b", "c"]) == 1


def test_rejected_requests_count_against_capacity() -> None:
    # A 110k-token prompt needs > 30 s of prefill: `early` rejects it on arrival.
    huge = req(0, 0.0, 110_000, 5, blocks(0, 215))
    small = req(1, 0.0, 1000, 5, blocks(500, 2))
    res = run_simulation([huge, small], replace(ONE, policy="early"))
    assert res.requests[0].rejected == "admission:ttft_slo"
    assert res.metrics["rejected"] == 1
    assert res.metrics["effective_capacity"]["100"] == 0.5
