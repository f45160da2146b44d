"""The KV block pool (Mooncake Store semantics, PAPER.md §2).

- `types`: the values every part shares (segments, replicas, pins, reason codes).
- `allocator`, `master_state`, `kv_index`: pure logic (time is an argument, no I/O).
- `transfer/`: the data plane, one `Transport` contract (tcp, shm, rdma).
- `segment`: a node's memory (DRAM in shared memory, pre-touched; SSD as a mapped file).
- `protocol`, `master`, `node`, `client`: the control plane over NATS request/reply.
"""
