"""A store node process: DRAM (and optionally SSD) segments pooled into the KV store, served
by the transfer engine (rdma where a device exists, shm on the same host, tcp everywhere)."""

from __future__ import annotations

import asyncio
import logging

from mooncake.config import Settings, StoreSettings
from mooncake.store.node import NodeConfig, StoreNode
from workers.runtime import configure_logging, default_instance_id, worker_context

log = logging.getLogger("mooncake.store.node")


class MissingSecret(ValueError):
    pass


def cluster_secret(store: StoreSettings) -> bytes:
    if store.secret is None or not store.secret.get_secret_value():
        raise MissingSecret(
            "the store needs a cluster secret: set MOONCAKE_STORE__SECRET "
            "(`mooncake up` generates one into .mooncake/runtime.env)"
        )
    return store.secret.get_secret_value().encode()


def node_config(settings: Settings, node_id: str) -> NodeConfig:
    s = settings.store
    return NodeConfig(
        node_id=node_id,
        secret=cluster_secret(s),
        dram_bytes=s.dram_bytes,
        ssd_bytes=s.ssd_bytes,
        ssd_dir=s.ssd_dir or settings.data_dir / "ssd",
        transports=s.transports,
        tcp_host=s.tcp_host,
        tcp_port=s.tcp_port,
        heartbeat_s=s.heartbeat_s,
        request_timeout_s=s.request_timeout_s,
    )


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
