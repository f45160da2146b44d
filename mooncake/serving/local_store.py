"""The store as a prefill or decode worker sees it: its own node (its DRAM pooled into the
store, the instance's local prefix cache, served to peers by the transfer engine) and a
client for the whole pool."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from mooncake.config import Settings
from mooncake.namespace import Namespace
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.node import StoreNode
from workers.store_node import cluster_secret, node_config


@dataclass
class LocalStore:
    node: StoreNode
    client: StoreClient

    @property
    def node_id(self) -> str:
        return self.node.config.node_id

    @property
    def dram_segment(self) -> str:
        """Where this instance's new blocks go first (`preferred_segment` of a put)."""
        return f"{self.node_id}-dram"


@contextlib.asynccontextmanager
async def local_store(nc: NATS, settings: Settings, node_id: str) -> AsyncIterator[LocalStore]:
    ns = Namespace(settings.namespace)
    node = StoreNode(nc, ns, node_config(settings, node_id))
    await node.start()
    s = settings.store
    client = StoreClient(
        nc,
        ns,
        ClientConfig(cluster_secret(s), s.transports, request_timeout_s=s.request_timeout_s),
    )
    try:
        yield LocalStore(node, client)
    finally:
        await client.close()
        await node.stop()
