"""What the decode worker counts, over a real NATS and a real store (the rig of
test_decode_worker): a completed request once, with the TTFT and TBT it reported, the tokens
it decoded, and the SLO and capacity it runs with."""

from __future__ import annotations

from prometheus_client import REGISTRY
from test_decode_worker import Rig, rig, tokens

from mooncake import events as ev

__all__ = ["rig"]  # the fixture, shared with test_decode_worker


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def counts() -> dict[str, float]:
    return {
        "completed": value(
            "mc_requests_ended_total", type="completed", stage="decode", reason="length"
        ),
        "ttft_count": value("mc_request_ttft_seconds_count"),
        "ttft_sum": value("mc_request_ttft_seconds_sum"),
        "tbt_count": value("mc_request_tbt_seconds_count"),
        "tbt_sum": value("mc_request_tbt_seconds_sum"),
        "tokens": value("mc_tokens_generated_total", stage="decode"),
    }


async def test_a_completed_request_is_counted_once_with_its_latencies(rig: Rig) -> None:
    r = rig
    r.batch.delay_s = 0.005
    before = counts()
    work = await r.prepare("m-d", tokens(20, 41), 6)
    await r.send(work)
    final = await r.wait_final("m-d")
    await r.idle()
    assert final.finish_reason == "length"
    [done] = r.of(ev.RequestCompleted, "m-d")
    assert isinstance(done, ev.RequestCompleted)
    assert done.ttft_s is not None and done.tbt_s is not None
    d = {k: v - before[k] for k, v in counts().items()}
    assert d["completed"] == d["ttft_count"] == d["tbt_count"] == 1
    assert abs(d["ttft_sum"] - done.ttft_s) < 1e-9
    assert abs(d["tbt_sum"] - done.tbt_s) < 1e-9
    assert d["tokens"] == 5  # index 0 was prefill's; decode generated indexes 1..5

    s = r.settings
    assert value("mc_slo_seconds", slo="ttft") == s.slo.ttft_s
    assert value("mc_slo_seconds", slo="tbt") == s.slo.tbt_s
    assert value("mc_decode_kv_capacity_tokens") == r.worker.engine.pool.capacity_tokens
