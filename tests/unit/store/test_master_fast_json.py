"""The master's hot replies (put_start, lookup) are built as JSON from plain dicts, not
through the reply models: they must parse as those models and say the same thing."""

from __future__ import annotations

from typing import Any

from mooncake import events as ev
from mooncake.config import StoreSettings
from mooncake.store import protocol as p
from mooncake.store.master import StoreMaster, new_state, replica_json
from mooncake.store.types import Replica, ReplicaState, SegmentInfo, Tier

MiB = 1 << 20


def _master() -> StoreMaster:
    state = new_state(StoreSettings(high_watermark=1.0), seed=1)
    eps = {"shm": "shm://host/dev/shm/x", "tcp": "tcp://127.0.0.1:1"}
    for node in ("n1", "n2"):
        state.restore(node, [SegmentInfo(f"{node}:0", node, Tier.DRAM, 8 * MiB, eps)], [], 0.0)
    return StoreMaster(None, ev.Namespace("mc"), state)  # type: ignore[arg-type]


def _req(model: Any) -> bytes:
    return bytes(model.model_dump_json().encode())


def test_replica_json_is_what_the_wire_model_serialises() -> None:
    for state in ReplicaState:
        r = Replica("n1:0", "n1", Tier.SSD, 4096, 100, state)
        assert p.ReplicaWire.model_validate(replica_json(r)) == p.ReplicaWire.of(r)
        assert replica_json(r) == p.ReplicaWire.of(r).model_dump(mode="json")


def test_put_start_and_lookup_replies_parse_as_their_models() -> None:
    m = _master()
    items = [
        p.PutItem(key="a", size=MiB, replicas=2),
        p.PutItem(key='b"quoted\\', size=100),
        p.PutItem(key="too-big", size=64 * MiB),  # refused: no segment that large
        p.PutItem(key="a", size=MiB),  # refused: exists
    ]
    raw = m._put_start(_req(p.PutStartRequest(items=items)))
    started = p.PutStartReply.model_validate_json(raw)
    plans = [r for r in started.results if isinstance(r, p.Plan)]
    refused = [r for r in started.results if isinstance(r, p.Refused)]
    assert [len(pl.replicas) for pl in plans] == [2, 1]
    assert {r.node_id for r in plans[0].replicas} == {"n1", "n2"}
    assert all(r.state is ReplicaState.PENDING for pl in plans for r in pl.replicas)
    assert [r.reason.value for r in refused] == ["no_space", "exists"]
    assert set(started.segments) == {r.segment_id for pl in plans for r in pl.replicas}
    assert started.segments["n1:0"]["tcp"] == "tcp://127.0.0.1:1"

    m._put_end(_req(p.KeysRequest(keys=["a", 'b"quoted\\'])))
    found = p.LookupReply.model_validate_json(
        m._lookup(_req(p.KeysRequest(keys=["a", "missing", 'b"quoted\\'])))
    )
    a, missing, b = found.results
    assert isinstance(a, p.Found) and isinstance(b, p.Found)
    assert isinstance(missing, p.Refused) and missing.reason.value == "not_found"
    assert a.lease_s > 0 and all(r.state is ReplicaState.COMPLETE for r in a.replicas)
    assert [(r.offset, r.size) for r in b.replicas] == [
        (r.offset, r.size) for r in plans[1].replicas
    ]
