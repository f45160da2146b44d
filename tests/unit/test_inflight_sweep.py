"""The Conductor's sweep of requests whose end it never heard (serving/conductor_sweep.py):
which requests it asks about, how often, and what it takes out of the view."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from nats.js.errors import KeyNotFoundError

from mooncake.bus import terminal
from mooncake.core import cluster as cl
from mooncake.serving import conductor_sweep
from mooncake.serving.conductor_sweep import InflightSweep


def view_with(*admitted: tuple[str, float]) -> cl.ClusterView:
    v = cl.ClusterView()
    v.apply(cl.InstanceJoined("p1", "prefill", "n1", None), 0.0)
    v.apply(cl.InstanceJoined("d1", "decode", "n2", 100_000), 0.0)
    for rid, at in admitted:
        v.apply(cl.Assigned(rid, "p1", "d1", 512, 0.5, 1.0), at)
    return v


def test_the_longest_unheard_are_asked_first_and_a_running_one_not_again_for_a_period() -> None:
    v = view_with(("old", 0.0), ("older", -5.0), ("young", 50.0))
    assert v.unchecked(before=40.0, limit=10) == ["older", "old"]
    assert v.unchecked(before=40.0, limit=1) == ["older"]
    v.still_running(["older"], now=45.0)
    assert v.unchecked(before=41.0, limit=10) == ["old"]  # "older" was seen at 45
    assert v.unchecked(before=60.0, limit=10) == ["old", "older", "young"]
    v.still_running(["gone"], now=60.0)  # not in flight (any more): nothing to mark


@dataclass
class Entry:
    value: bytes | None


class Slots:
    """The terminal bucket's `get`, as the sweep reads it."""

    def __init__(self, ended: dict[str, str]) -> None:
        self.values = {terminal._key(rid): f"{how}:ev-{rid}".encode() for rid, how in ended.items()}
        self.asked: list[str] = []

    async def get(self, key: str) -> Entry:
        self.asked.append(key)
        if key not in self.values:
            raise KeyNotFoundError
        return Entry(self.values[key])


async def test_an_ended_request_leaves_the_view_and_a_running_one_stays() -> None:
    now = [100.0]
    v = view_with(("done", 0.0), ("running", 0.0), ("recent", 95.0))
    v.apply(cl.DecodeStarted("done"), 1.0)
    busy = v.decode["d1"].batch
    slots = Slots({"done": "completed", "recent": "completed"})
    released: list[str] = []

    def release(rid: str) -> None:
        released.append(rid)
        v.apply(cl.RequestDropped(rid), now[0])

    sweep = InflightSweep(v, slots, 60.0, release, clock=lambda: now[0])  # type: ignore[arg-type]
    assert await sweep.sweep_once() == [("done", "completed")]
    assert released == ["done"] and set(v.inflight) == {"running", "recent"}
    assert v.decode["d1"].batch == busy - 1  # its decode seat is free again
    assert len(slots.asked) == 2  # "recent" is not asked: heard of 5 s ago
    slots.asked.clear()
    now[0] = 130.0
    assert await sweep.sweep_once() == []  # "running" was seen at 100; "recent" at 95
    assert slots.asked == []
    now[0] = 161.0
    assert await sweep.sweep_once() == [("recent", "completed")]
    assert set(v.inflight) == {"running"}


async def test_one_sweep_reads_at_most_a_batch_of_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conductor_sweep, "SWEEP_BATCH", 3)
    v = view_with(*((f"r{i}", float(i)) for i in range(5)))
    slots = Slots({})
    sweep = InflightSweep(v, slots, 10.0, lambda rid: None, clock=lambda: 100.0)  # type: ignore[arg-type]
    assert await sweep.sweep_once() == []
    assert slots.asked == [terminal._key(f"r{i}") for i in range(3)]
    with pytest.raises(ValueError, match="above 0"):
        InflightSweep(v, slots, 0.0, lambda rid: None)  # type: ignore[arg-type]
