"""Algorithm 1 (PAPER.md §3): hand-checked scenarios and the laws the Conductor keeps."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core import cluster as cl
from mooncake.core.conductor import (
    ConductorConfig,
    ScheduleRequest,
    assignment,
    choose,
    decide,
    rejection_detail,
)
from mooncake.core.cost_model import Costs, FittedCostModel, PolyFit, TransferModel
from mooncake.events import RejectReason, RequestAdmitted

from helpers import cluster_view


@dataclass(frozen=True)
class Linear:
    """Round numbers: prefill 1 ms per uncached token; step 10 ms + 1 ms per sequence."""

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        return 0.001 * (prompt_tokens - cached_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.010 + 0.001 * batch + 1e-7 * context_tokens


# 1 token = 1 byte at 1000 B/s -> 1 ms per token, and no latency.
COSTS = Costs(Linear(), Linear(), TransferModel(1000.0, 0.0, 1))
FAST_NET = Costs(Linear(), Linear(), TransferModel(1e6, 0.0, 1))
CFG = ConductorConfig(block_tokens=10, balancing_threshold=2.0, ttft_slo_s=5.0, tbt_slo_s=0.05)
KEYS = tuple(f"k{i}" for i in range(10))


view = cluster_view


def queue(v: cl.ClusterView, instance: str, seconds: float, rid: str, decode: str = "d0") -> None:
    v.apply(cl.Assigned(rid, instance, decode, 0, seconds, seconds), 0.0)


def req(blocks: int = 10, tokens: int = 100) -> ScheduleRequest:
    return ScheduleRequest("r", tokens, KEYS[:blocks])


def test_local_prefix_wins_when_queues_are_equal() -> None:
    v = view()
    v.apply(cl.BlocksStored("p1", KEYS[:6]), 0.0)
    v.apply(cl.BlocksStored("p2", KEYS[:3]), 0.0)
    d = decide(v, req(), CFG, COSTS, 0.0)
    # p1: best 6 / local 6 = 1 <= 2 -> local: TTFT = 0 + 0 + (100 - 60)·1 ms = 0.04 s
    # p2: 6 / 3 = 2, not > 2 -> local: 0.07 s;  p0: 6/0 -> remote 60 tokens: 0.06 + 0.04 = 0.1
    assert d.admitted and d.prefill_instance == "p1"
    assert d.predicted_ttft_s == 0.04 and d.prefix_tokens == 60 and not d.takes_remote
    assert [c[5] for c in d.candidates] == [0.1, 0.04, 0.07]


def test_remote_prefix_is_fetched_and_copied_past_the_threshold() -> None:
    v = view()
    v.apply(cl.BlocksStored("p1", KEYS[:8]), 0.0)
    queue(v, "p1", 1.0, "busy")
    v.apply(cl.BlocksStored("p2", KEYS[:2]), 0.0)
    d = decide(v, req(), CFG, COSTS, 0.0)
    # p1: local 8 blocks, queue 1 s: 1 + 0.02 = 1.02
    # p2: 8/2 = 4 > 2 -> remote: transfer 60 tokens 0.06 + prefill 20 tokens 0.02 = 0.08
    # p0: 8/0 -> remote: transfer 80 tokens 0.08 + 0.02 = 0.10
    assert d.prefill_instance == "p2" and d.predicted_ttft_s == 0.08
    assert d.takes_remote and d.local_prefix_blocks == 2 and d.remote_prefix_blocks == 8
    assert d.copy is not None and d.copy.target_node == "p2"
    assert d.copy.keys == KEYS[2:8] and d.copy.sources == ("p1",)


def test_blocks_of_a_node_whose_index_is_not_exact_count_as_unknown() -> None:
    """While p1's KV index resyncs (a gap in its events), the decision assumes none of its
    blocks: not as its local prefix, not as the pool's to fetch; once exact, it does."""
    v = view()
    v.apply(cl.BlocksStored("p1", KEYS[:6]), 0.0)
    v.apply(cl.BlocksStored("p2", KEYS[:3]), 0.0)
    v.unsure_nodes = frozenset({"p1"})
    d = decide(v, req(), CFG, COSTS, 0.0)
    assert d.remote_prefix_blocks == 3 and d.prefill_instance == "p2"
    assert all(c[1] <= 3 and c[2] <= 3 for c in d.candidates)  # local, prefix per instance
    v.unsure_nodes = frozenset({"p1", "p2"})
    d = decide(v, req(), CFG, COSTS, 0.0)
    assert d.remote_prefix_blocks == 0 and d.prefix_tokens == 0
    v.unsure_nodes = frozenset()
    d = decide(v, req(), CFG, COSTS, 0.0)
    assert d.prefill_instance == "p1" and d.prefix_tokens == 60


def test_blocks_held_only_on_ssd_are_charged_the_ssd_read() -> None:
    """Reading a prefix the node keeps only on SSD costs the SSD's time (in transfer_s), so
    an instance with the same prefix in DRAM wins, and the record says how many blocks came
    from SSD."""
    ssd = Costs(
        Linear(), Linear(), TransferModel(1000.0, 0.0, 1), ssd=TransferModel(2000.0, 0.0, 1)
    )
    v = view()
    v.apply(cl.BlocksStored("p1", KEYS[:6]), 0.0)
    v.apply(cl.BlocksStored("p2", KEYS[:6]), 0.0)
    v.blocks.to_ssd("p1", KEYS[:4])
    d = decide(v, req(), CFG, ssd, 0.0)
    # p1: 40 tokens from SSD at 2000 tok/s = 0.02 s + prefill 40 tokens 0.04 = 0.06
    # p2: all in DRAM: 0.04;  p0: transfer 60 tokens from p2's DRAM 0.06 + 0.04 = 0.10
    assert [c[3] for c in d.candidates] == [0.06, 0.02, 0.0]
    assert d.prefill_instance == "p2" and d.ssd_prefix_blocks == 0
    queue(v, "p2", 1.0, "busy")
    d = decide(v, req(), CFG, ssd, 0.0)
    assert d.prefill_instance == "p1" and d.ssd_prefix_blocks == 4
    assert d.transfer_s == 0.02 and d.predicted_ttft_s == 0.06
    # Pool blocks no node holds in DRAM are read from an SSD before the transfer.
    v.blocks.to_ssd("p2", KEYS[:4])
    d = decide(v, req(), CFG, ssd, 0.0)
    p0 = next(c for c in d.candidates if c[0] == "p0")
    assert p0[3] == 0.06 + 0.02  # 60 tokens' transfer + 40 tokens from SSD
    # Counted as free where the cost model knows no SSD (the reference before profiling).
    assert [c[3] for c in decide(v, req(), CFG, COSTS, 0.0).candidates][1] == 0.0


def test_an_engine_tier_whose_index_is_not_exact_counts_as_unknown() -> None:
    v = view()
    v.engine_blocks.add("p0", KEYS[:5])
    p0 = v.prefill["p0"]
    assert v.local_blocks(KEYS, p0, 0) == 5
    v.unsure_instances = frozenset({"p0"})
    assert v.local_blocks(KEYS, p0, 0) == 0
    v.unsure_instances = frozenset()
    v.blocks.add("p0", KEYS[:7])  # its node's DRAM, followed apart
    v.unsure_nodes = frozenset({"p0"})
    assert v.local_blocks(KEYS, p0, 0) == 5  # the engine tier's, not the unsure node's


def test_no_instance_and_slo_rejections() -> None:
    assert decide(view(0, 1), req(), CFG, COSTS, 0.0).reason is RejectReason.NO_INSTANCE
    assert decide(view(1, 0), req(), CFG, COSTS, 0.0).reason is RejectReason.NO_INSTANCE
    v = view(1, 1)
    queue(v, "p0", 4.95, "busy")  # 4.95 + 0.1 > 5 s
    d = decide(v, req(), CFG, COSTS, 0.0)
    assert not d.admitted and d.reason is RejectReason.TTFT_SLO
    assert d.prefill_instance == "p0"  # the rejected choice is still recorded
    v = view(1, 1)
    v.apply(cl.DecodeLoadReported("d0", 40, 0), 0.0)  # step(41, 100) = 0.05101 > 0.05
    assert decide(v, req(), CFG, COSTS, 0.0).reason is RejectReason.TBT_SLO


def test_an_idle_decode_instance_is_not_judged_on_tbt() -> None:
    """A machine whose lone decode step is over the TBT limit still serves one request at a
    time (rejecting it frees capacity for nobody); with another request on the instance the
    limit binds again. The decision keeps the predicted TBT."""
    slow = ConductorConfig(block_tokens=10, ttft_slo_s=5.0, tbt_slo_s=0.001)
    v = view(1, 1)
    d = decide(v, req(), slow, COSTS, 0.0)
    assert d.admitted and d.predicted_tbt_s is not None and d.predicted_tbt_s > 0.001
    v.apply(cl.DecodeLoadReported("d0", 1, 100), 0.0)
    assert decide(v, req(), slow, COSTS, 0.0).reason is RejectReason.TBT_SLO


def test_every_rejection_says_why_in_numbers() -> None:
    assert rejection_detail(decide(view(0, 1), req(), CFG, COSTS, 0.0)) == (
        "no live instance pair can take a prompt of 100 tokens"
    )
    v = view(1, 1)
    queue(v, "p0", 4.95, "busy")
    assert rejection_detail(decide(v, req(), CFG, COSTS, 0.0)) == (
        "predicted TTFT 5.05 s (queue 4.95 s + transfer 0.00 s + prefill 0.10 s on p0) is "
        "over the SLO of 5 s"
    )
    v = view(1, 1)
    v.apply(cl.DecodeLoadReported("d0", 40, 0), 0.0)
    assert rejection_detail(decide(v, req(), CFG, COSTS, 0.0)) == (
        "predicted TBT 51 ms on d0 is over the SLO of 50 ms"
    )
    overloaded = replace(
        decide(v, req(), CFG, COSTS, 0.0), reason=RejectReason.DECODE_OVERLOADED,
        decode_load=1.02, policy="early",
    )  # fmt: skip
    assert rejection_detail(overloaded) == (
        "decode load 1.02 (predicted TBT 51 ms on d0; SLO 50 ms) under the early policy"
    )


def test_decode_choice_counts_work_routed_but_not_yet_decoding() -> None:
    v = view(1, 2)
    queue(v, "p0", 0.0, "a", decode="d0")  # d0 now has one reserved request
    d = decide(v, req(), CFG, COSTS, 0.0)
    assert d.decode_instance == "d1"
    # The TBT checked is the chosen instance's current batch plus this request.
    assert d.predicted_tbt_s == 0.010 + 0.001 * 1 + 1e-7 * 100


def test_assignment_updates_the_queue_and_the_lifecycle_drains_it() -> None:
    v = view(1, 1)
    d = decide(v, req(), CFG, COSTS, 0.0)
    fact = assignment(d)
    assert fact is not None and fact.predicted_prefill_s == 0.1
    v.apply(fact, 0.0)
    assert v.prefill["p0"].queue_s(0.0) == 0.1
    assert v.decode["d0"].reserved_batch == 1
    v.apply(cl.PrefillStarted("r"), 1.0)
    assert v.prefill["p0"].queue_s(1.05) == pytest.approx(0.05)  # the rest of the running prefill
    v.apply(cl.DecodeStarted("r"), 1.1)
    assert v.prefill["p0"].queue_s(1.1) == 0.0
    assert (v.decode["d0"].batch, v.decode["d0"].reserved_batch) == (1, 0)
    v.apply(cl.DecodeFinished("r"), 2.0)
    assert v.decode["d0"].batch == 0 and not v.inflight


def test_requests_stay_bound_to_a_dead_instance_until_they_end() -> None:
    """What the reaper waits for: an instance that left is still named by requests queued
    elsewhere (a live prefill hands them over to it later) until they end."""
    v = view(2, 2)
    queue(v, "p0", 1.0, "a", decode="d0")
    queue(v, "p1", 1.0, "b", decode="d1")
    v.apply(cl.InstanceLeft("d0"), 0.5)
    assert v.bound_to("d0") == ["a"] and v.bound_to("p1") == ["b"]
    v.apply(cl.DecodeStarted("a"), 1.0)
    assert v.bound_to("d0") == ["a"]  # decoding there: its work is held in d0's consumer
    v.apply(cl.RequestDropped("a"), 2.0)
    assert v.bound_to("d0") == [] and v.bound_to("p0") == []


def test_decision_is_json_serialisable_into_the_event() -> None:
    v = view()
    v.apply(cl.BlocksStored("p2", KEYS[:2]), 0.0)
    d = decide(v, req(), CFG, COSTS, 0.0)
    inputs = json.loads(json.dumps(d.to_dict()))
    assert inputs["prefill_instance"] == d.prefill_instance and len(inputs["candidates"]) == 3
    event = RequestAdmitted(request_id="r", policy=d.policy, inputs=inputs)
    assert event.inputs["config"]["balancing_threshold"] == 2.0


def test_decision_dict_has_every_field_as_asdict_would() -> None:
    v = view()
    v.apply(cl.BlocksStored("p2", KEYS[:2]), 0.0)
    d = decide(v, req(), CFG, COSTS, 0.0)
    fast, deep = d.to_dict(), asdict(d)
    assert set(fast) == set(deep)
    for name in ("request_id", "prefill_instance", "decode_instance", "predicted_ttft_s"):
        assert fast[name] == deep[name]
    assert fast["config"] == deep["config"]
    fast["config"]["ttft_slo_s"] = -1.0  # one decision's dict never changes another's
    assert d.to_dict()["config"]["ttft_slo_s"] == CFG.ttft_slo_s


# --- laws ----------------------------------------------------------------------------------------

blocks = st.integers(min_value=0, max_value=10)
queues = st.lists(st.floats(min_value=0, max_value=3), min_size=3, max_size=3)


def scenario(locals_: list[int], qs: list[float], pool: int) -> cl.ClusterView:
    v = view(3, 2)
    for i, n in enumerate(locals_):
        v.apply(cl.BlocksStored(f"p{i}", KEYS[:n]), 0.0)
        if qs[i] > 0:
            queue(v, f"p{i}", qs[i], f"q{i}")
    v.apply(cl.BlocksStored("store", KEYS[:pool]), 0.0)  # a node with no prefill instance
    return v


def ttft_of(v: cl.ClusterView, instance: str, cfg: ConductorConfig, costs: Costs) -> float:
    choice = choose(v, req(), cfg, costs, 0.0)
    assert choice is not None
    return next(c[5] for c in choice.candidates if c[0] == instance)


# Transfer at 2 ms per token (prefill is 1 ms): past the threshold an instance still fetches
# (the paper's hot-block replication) although recomputing would be faster.
SLOW_NET = Costs(Linear(), Linear(), TransferModel(500.0, 0.0, 1))
WITH_LATENCY = Costs(Linear(), Linear(), TransferModel(1e6, 0.005, 1))


def loading(*coef: float) -> Costs:
    """A fitted engine whose loading of a cached token costs time (the last coefficient,
    `cost_model.prefill_features`: 1, n, n², L² - P², P); a fast network."""
    model = FittedCostModel(PolyFit(coef, 0.0, 1), PolyFit((0.01, 0.001, 1e-7), 0.0, 1))
    return Costs(model, Linear(), TransferModel(1e6, 0.0, 1))


# Loading a token 1.5 ms, computing it 1 ms: no prefix is worth loading.
DEAR_LOAD = loading(0.0, 0.001, 0.0, 0.0, 0.0015)
# 1 ms + 20 µs x n per new token, 2 ms per loaded one: of 100 tokens, loading the first 75
# and computing 25 is the least (0.1875 s; all 100 loaded 0.2 s, none 0.3 s).
SOME_LOAD = loading(0.0, 0.001, 2e-5, 0.0, 0.002)


@settings(max_examples=300, deadline=None)
@given(st.lists(blocks, min_size=3, max_size=3), queues, blocks, blocks,
       st.sampled_from([float("inf"), 0.5, 1.0, 2.0, 3.5]),
       st.sampled_from([COSTS, FAST_NET, SLOW_NET, WITH_LATENCY, DEAR_LOAD, SOME_LOAD]),
       st.booleans())  # fmt: skip
def test_longer_local_prefix_never_looks_slower(
    locals_: list[int], qs: list[float], pool: int, more: int, thr: float, costs: Costs,
    pool_fetch: bool,
) -> None:  # fmt: skip
    cfg = ConductorConfig(
        block_tokens=10, balancing_threshold=thr, ttft_slo_s=5, tbt_slo_s=1, pool_fetch=pool_fetch
    )
    longer = [*locals_]
    longer[0] = min(locals_[0] + more, 10)
    before = ttft_of(scenario(locals_, qs, pool), "p0", cfg, costs)
    after = ttft_of(scenario(longer, qs, pool), "p0", cfg, costs)
    assert after <= before + 1e-12


def test_crossing_the_balancing_threshold_no_longer_makes_a_longer_prefix_look_slower() -> None:
    # Algorithm 1 taken literally (the counterexample that used to be pinned here): pool
    # holds 10 blocks; with 2 local blocks 10/2 > 2 -> fetch 80 tokens (8e-5 s on FAST_NET);
    # with 6 local blocks 10/6 < 2 -> recompute 40 tokens (0.04 s): longer looked slower.
    # Now the instance below the threshold fetches the missing 4 blocks because it is faster.
    short = ttft_of(scenario([2, 0, 0], [0, 0, 0], 10), "p0", CFG, FAST_NET)
    long = ttft_of(scenario([6, 0, 0], [0, 0, 0], 10), "p0", CFG, FAST_NET)
    assert short == pytest.approx(80 / 1e6) and long == pytest.approx(40 / 1e6)
    d = decide(scenario([6, 0, 0], [0, 0, 0], 10), req(), CFG, FAST_NET, 0.0)
    assert d.prefill_instance == "p0" and d.takes_remote and d.prefix_tokens == 100
    assert d.copy is not None and d.copy.keys == KEYS[6:10]


def test_below_the_threshold_a_slower_fetch_is_not_taken_past_it_it_is() -> None:
    # SLOW_NET: fetching a block (20 ms) costs more than recomputing it (10 ms).
    below = decide(scenario([6, 0, 0], [0, 0, 0], 10), req(), CFG, SLOW_NET, 0.0)
    p0 = next(c for c in below.candidates if c[0] == "p0")
    assert p0[2] == 6 and p0[3] == 0.0 and p0[5] == pytest.approx(0.04)  # recompute 40 tokens
    # Past the threshold (10 > 2 x 2) the paper's rule fetches anyway: 80 tokens at 2 ms.
    past = decide(scenario([2, 0, 0], [0, 0, 0], 10), req(), CFG, SLOW_NET, 0.0)
    p0 = next(c for c in past.candidates if c[0] == "p0")
    assert p0[2] == 10 and p0[3] == pytest.approx(0.16) and p0[5] == pytest.approx(0.16)


def test_a_prefix_dearer_to_load_than_to_compute_is_recomputed() -> None:
    d = decide(scenario([6, 0, 0], [0, 0, 0], 10), req(), CFG, DEAR_LOAD, 0.0)
    assert d.admitted and d.prefix_tokens == 0 and not d.takes_remote and d.copy is None
    assert d.prefill_s == pytest.approx(0.1)  # 100 tokens computed, none loaded
    # Every instance could reuse 6 or 10 blocks: none is worth loading, and the prefill is
    # told so (it would otherwise load whatever the store holds).
    assert [c[2] for c in d.candidates] == [0, 0, 0] and d.load_limit_blocks == 0
    work_limit = json.loads(json.dumps(d.to_dict()))["load_limit_blocks"]
    assert work_limit == 0


def test_only_the_blocks_worth_loading_are_loaded_or_fetched() -> None:
    # p0 holds all 10 blocks: loading 8 (75 tokens, rounded up to whole blocks) and
    # computing 20 is faster than loading all 10 or none.
    d = decide(scenario([10, 0, 0], [0, 0, 0], 10), req(), CFG, SOME_LOAD, 0.0)
    assert d.prefill_instance == "p0" and d.prefix_tokens == 80 and d.load_limit_blocks == 8
    # The prediction is the model's best reuse (75 tokens); 8 whole blocks take 0.188 s.
    assert d.prefill_s == pytest.approx(0.1875)
    # An instance holding 2 of the pool's 10 fetches 6 blocks, not 8: the rest are computed.
    d = decide(scenario([2, 0, 0], [0, 1, 1], 10), req(), CFG, SOME_LOAD, 0.0)
    assert d.prefill_instance == "p0" and d.prefix_tokens == 80 and d.takes_remote
    assert d.copy is not None and d.copy.keys == KEYS[2:8] and d.load_limit_blocks == 8


def test_a_prefix_worth_loading_whole_sets_no_limit() -> None:
    d = decide(scenario([6, 0, 0], [0, 0, 0], 10), req(), CFG, FAST_NET, 0.0)
    assert d.load_limit_blocks is None and d.prefix_tokens == 100


def test_without_the_pool_an_instance_reuses_only_its_own_blocks() -> None:
    cfg = ConductorConfig(block_tokens=10, ttft_slo_s=5.0, tbt_slo_s=0.05, pool_fetch=False)
    d = decide(scenario([2, 0, 0], [0, 0, 0], 10), req(), cfg, FAST_NET, 0.0)
    assert not d.takes_remote and d.copy is None
    assert [c[2] for c in d.candidates] == [2, 0, 0]


@settings(max_examples=150, deadline=None)
@given(st.lists(blocks, min_size=3, max_size=3), queues, blocks,
       st.integers(0, 2), st.floats(min_value=0.001, max_value=5))  # fmt: skip
def test_longer_queue_never_looks_faster(
    locals_: list[int], qs: list[float], pool: int, who: int, extra: float
) -> None:
    v = scenario(locals_, qs, pool)
    before = choose(v, req(), CFG, COSTS, 0.0)
    queue(v, f"p{who}", extra, "extra")
    after = choose(v, req(), CFG, COSTS, 0.0)
    assert before is not None and after is not None
    assert after.candidates[who][5] > before.candidates[who][5]
    if before.prefill.id != f"p{who}":  # a slower instance never becomes the choice
        assert after.prefill.id == before.prefill.id


@settings(max_examples=150, deadline=None)
@given(st.lists(blocks, min_size=3, max_size=3), queues, blocks,
       st.integers(0, 60), st.floats(min_value=0.01, max_value=0.2))  # fmt: skip
def test_nothing_admitted_breaks_the_slo_and_same_inputs_same_decision(
    locals_: list[int], qs: list[float], pool: int, batch: int, tbt_slo: float
) -> None:
    cfg = ConductorConfig(block_tokens=10, ttft_slo_s=2.0, tbt_slo_s=tbt_slo)
    v = scenario(locals_, qs, pool)
    v.apply(cl.DecodeLoadReported("d0", batch, 1000), 0.0)
    v.apply(cl.DecodeLoadReported("d1", batch // 2, 500), 0.0)
    d = decide(v, req(), cfg, COSTS, 0.0)
    if d.admitted:
        assert d.predicted_ttft_s is not None and d.predicted_ttft_s <= cfg.ttft_slo_s
        assert d.predicted_tbt_s is not None
        # Over the TBT limit only on an idle decode instance (nothing to shed there).
        assert d.predicted_tbt_s <= cfg.tbt_slo_s or v.decode[d.decode_instance].batch == 0
    else:
        assert d.reason in (RejectReason.TTFT_SLO, RejectReason.TBT_SLO)
    # Deterministic: the same view and request decide the same, and so does a view rebuilt
    # from the same facts.
    again = scenario(locals_, qs, pool)
    again.apply(cl.DecodeLoadReported("d0", batch, 1000), 0.0)
    again.apply(cl.DecodeLoadReported("d1", batch // 2, 500), 0.0)
    assert decide(v, req(), cfg, COSTS, 0.0) == d == decide(again, req(), cfg, COSTS, 0.0)


def test_an_engine_tier_hit_needs_no_transfer_and_is_nobody_elses() -> None:
    """Blocks an instance's own engine pool caches count as its local prefix (alone, or
    continuing what its node's DRAM holds); no other instance can fetch them."""
    v = view()
    v.engine_blocks.add("p1", KEYS[:6])
    c = choose(v, req(), CFG, COSTS, 0.0)
    assert c is not None and c.prefill.id == "p1"
    assert (c.local_blocks, c.prefix_blocks, c.transfer_s) == (6, 6, 0.0)
    assert c.best_blocks == 0  # the pool (store) holds none of them
    others = {row[0]: row[1:3] for row in c.candidates}
    assert others["p0"] == (0, 0) and others["p2"] == (0, 0)
    # DRAM on p2's node holds blocks 0-1, its engine pool 2-4: 5 in a row, all local.
    v.blocks.add("p2", KEYS[:2])
    v.engine_blocks.add("p2", KEYS[2:5])
    assert v.local_blocks(KEYS, v.prefill["p2"], 2) == 5
    # An instance that leaves takes its engine tier with it.
    v.apply(cl.InstanceLeft("p1"), 0.0)
    assert not v.engine_blocks.holders(KEYS[0])
