"""A store node process: DRAM (and optionally SSD) segments pooled into the KV store, served
by the transfer engine (rdma where a device exists, shm on the same host, tcp everywhere)."""

from __future__ import annotations

import asyncio
import logging

from mooncake.config import Settings
from mooncake.serving.local_store import node_config
from mooncake.store.node import StoreNode
from workers.runtime import configure_logging, default_instance_id, worker_context

log = logging.getLogger("mooncake.store.node")


async def main(settings: Settings, instance_id: str | None = None) -> None:
    node_id = instance_id or default_instance_id("store")
    config = node_config(settings, node_id)  # a missing secret fails before anything starts
    async with worker_context(settings, "store", node_id) as ctx:
        node = StoreNode(ctx.nc, ctx.ns, config)
        await node.start()
        try:
            await ctx.stop.wait()
        finally:
            await node.stop()


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))
