"""The store's data plane: one `Transport` contract, three transports (tcp, shm, rdma).

Transports are looked up by name (`make_server`, `make_client`, `available`) and imported on
first use, so nothing here pulls pyverbs in unless rdma is asked for.
"""

from mooncake.store.transfer.base import (
    NAMES,
    REASONS,
    Buffer,
    SegmentTable,
    TransferError,
    Transport,
    TransportServer,
    as_memoryview,
    available,
    make_client,
    make_server,
)

__all__ = [
    "NAMES",
    "REASONS",
    "Buffer",
    "SegmentTable",
    "TransferError",
    "Transport",
    "TransportServer",
    "as_memoryview",
    "available",
    "make_client",
    "make_server",
]
