"""What the prefill worker counts, over a real NATS and a real store (the rig of
test_prefill_worker): every prompt token once, split by where its KV came from (the engine's
own pool, this node's DRAM, another node's DRAM, or computed), and the first token it
generates."""

from __future__ import annotations

from prometheus_client import REGISTRY
from test_prefill_worker import BLOCK, Rig, rig, tokens

from mooncake import events as ev
from mooncake.serving.kvstore import TIERS, block_object, source_tier
from mooncake.serving.local_store import local_store

__all__ = ["rig"]  # the fixture, shared with test_prefill_worker


def counts() -> dict[str, float]:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    out = {tier: value("mc_prefill_kv_tokens_total", tier=tier) for tier in TIERS}
    out["prompt"] = value("mc_prefill_prompt_tokens_total")
    out["first_tokens"] = value("mc_tokens_generated_total", stage="prefill")
    return out


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counts().items() if v != before[k]}


async def prefill(r: Rig, request_id: str, prompt: list[int], cached_blocks: int = 0) -> None:
    await r.submit(request_id, prompt, cached_blocks=cached_blocks)
    await r.wait_event(ev.RequestPrefilled, request_id)
    await r.idle()


async def test_prompt_tokens_by_tier_local_and_computed(rig: Rig) -> None:
    r = rig
    before = counts()
    prompt = tokens(37, 31)  # 2 whole blocks + a tail of 5
    await prefill(r, "m-a", prompt)
    assert delta(before) == {"computed": 37, "prompt": 37, "first_tokens": 1}

    # The same first two blocks again: still cached in this worker's engine pool.
    before = counts()
    await prefill(r, "m-b", prompt[: 2 * BLOCK] + tokens(9, 32), cached_blocks=2)
    assert r.worker.last is not None and r.worker.last.loaded_from == {"engine": 2}
    assert delta(before) == {
        "engine": 2 * BLOCK,
        "computed": 9,
        "prompt": 2 * BLOCK + 9,
        "first_tokens": 1,
    }

    # Once the pool has evicted them, they come from this worker's own DRAM segment.
    r.engine.pool.pages.evict_idle()
    before = counts()
    await prefill(r, "m-c", prompt[: 2 * BLOCK] + tokens(7, 34), cached_blocks=2)
    assert r.worker.last is not None and r.worker.last.loaded_from == {"local_dram": 2}
    assert delta(before) == {
        "local_dram": 2 * BLOCK,
        "computed": 7,
        "prompt": 2 * BLOCK + 7,
        "first_tokens": 1,
    }


async def test_blocks_on_another_node_count_as_remote(rig: Rig) -> None:
    r = rig
    prompt = tokens(40, 33)
    keys = r.engine.block_keys(prompt)
    kv = r.reference.prefill(prompt).kv
    async with local_store(r.nc, r.settings, node_id="other-node") as other:
        items = [(k, block_object(kv, j * BLOCK, BLOCK)) for j, k in enumerate(keys)]
        assert await other.client.put_many(items, preferred_segment=other.dram_segment) == [
            None,
            None,
        ]
        before = counts()
        await prefill(r, "m-r", prompt, cached_blocks=2)
    done = r.worker.last
    assert done is not None and done.load_fallback is None
    assert done.loaded_from == {"remote_dram": 2}
    assert delta(before) == {
        "remote_dram": 2 * BLOCK,
        "computed": 40 - 2 * BLOCK,
        "prompt": 40,
        "first_tokens": 1,
    }


def test_source_tier_of_a_segment() -> None:
    assert source_tier("prefill-0-dram", "prefill-0-dram") == "local_dram"
    assert source_tier("prefill-0-ssd", "prefill-0-dram") == "ssd"
    assert source_tier("node-b-ssd", "prefill-0-dram") == "ssd"
    assert source_tier("node-b-dram", "prefill-0-dram") == "remote_dram"
    assert source_tier("node-b-dram", None) == "remote_dram"
