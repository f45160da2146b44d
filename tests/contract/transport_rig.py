"""The contract rig: a server over a table of two DRAM segments, and a client, per transport.

Every transport runs the same contract suite. `rdma-fake` runs the real rdma transport code
over the in-memory verbs fake and the in-process rendezvous; `rdma` is the real thing and is
skipped, with the reason `available("rdma")` gives, where no device exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from mooncake.store.segment import Segment
from mooncake.store.transfer import (
    SegmentTable,
    Transport,
    TransportServer,
    available,
)
from mooncake.store.transfer.rdma import LocalRendezvous
from mooncake.store.transfer.verbs import FakeFabric

SECRET = b"contract-suite-cluster-secret"
BIG = "seg-big"  # 20 MiB: room for a 16 MiB transfer at an offset
SMALL = "seg-small"  # 256 KiB
TRANSPORTS = ["tcp", "shm", "rdma-fake", "rdma"]


@dataclass
class Rig:
    name: str
    table: SegmentTable
    server: TransportServer
    client: Transport
    segments: dict[str, Segment]

    def ep(self, segment_id: str = BIG) -> str:
        return self.server.endpoint(segment_id)


def options(name: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    if name == "rdma-fake":
        fabric, rendezvous = FakeFabric(), LocalRendezvous()
        common = {"rendezvous": rendezvous}
        return (
            "rdma",
            {**common, "node_id": "node-a", "verbs": fabric.context},
            {**common, "verbs": fabric.context, "staging_bytes": 4 << 20},
        )
    if name == "rdma":
        ok, why = available("rdma")
        if not ok:
            pytest.skip(f"rdma: {why}")
        rendezvous = LocalRendezvous()
        return "rdma", {"rendezvous": rendezvous, "node_id": "node-a"}, {"rendezvous": rendezvous}
    return name, {}, {}
