"""`mooncake bench index`, CI-sized: a real master and three node processes under lost KV
events, a master restart and a killed node; no decision after a resync assumes a block that
is not there, while a naive index (no gaps, snapshots, tips or silence) does."""

from __future__ import annotations

import json
import random

import pytest

from mooncake.bench import schema
from mooncake.bench.index import NODES, _view, overcounted, run_index_bench
from mooncake.core.block_index import BlockIndex

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
async def test_no_decision_after_a_resync_assumes_a_missing_block() -> None:
    out = await run_index_bench(
        prompts=30, fault_s=2.0, per_poll=10, log=lambda m: print(m, flush=True)
    )
    print(json.dumps(out))
    schema.validate("index", json.loads(json.dumps(out)))  # the fields a script reads
    faults = out["faults"]
    assert set(faults) == {"drop", "master_restart", "node_kill"}
    assert faults["drop"]["dropped_messages"] > 0
    assert all(f["assumed_blocks"] > 0 for f in faults.values()), out  # hits were made
    assert out["decisions_after_resync"] > 0, out
    assert out["overcounted_decisions_after_resync"] == 0, out
    assert out["overcounted_decisions_while_resyncing"] == 0, out
    # (`overcounted_decisions_stale_exact`, a loss not seen yet, is a figure of the bench:
    # how often one lands inside a tip's 0.25 s is chance.)
    # The killed node's old blocks: the naive index still counts them, the real one never.
    assert faults["node_kill"]["naive_overcounted"] > 0, out
    assert faults["node_kill"]["silent_detect_s"] is not None, out


def test_a_decision_assuming_a_block_its_node_does_not_hold_is_counted() -> None:
    keys = tuple(f"k{i}" for i in range(4))
    index = BlockIndex()
    index.add(NODES[0], keys)
    truth = {NODES[0]: set(keys), NODES[1]: set(), NODES[2]: set()}
    rng = random.Random(0)
    assert overcounted(_view(None, index), [keys], truth, 5, rng) == (0, 20)
    truth[NODES[0]] = set(keys[:2])  # the index says 4, the node holds 2
    bad, assumed = overcounted(_view(None, index), [keys], truth, 5, rng)
    assert (bad, assumed) == (5, 20)
