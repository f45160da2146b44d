"""The store as a prefill or decode worker sees it: its own node (its DRAM pooled into the
store, the instance's local prefix cache, served to peers by the transfer engine) and a
client for the whole pool."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from mooncake.config import Settings, StoreSettings
from mooncake.namespace import Namespace
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.node import NodeConfig, StoreNode


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
        ClientConfig(
            cluster_secret(s),
            s.transports,
            request_timeout_s=s.request_timeout_s,
            put_renew_s=s.put_timeout_s / 3,  # a prefill's put outlasting the master's timeout
        ),
    )
    try:
        yield LocalStore(node, client)
    finally:
        await client.close()
        await node.stop()
