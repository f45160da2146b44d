"""The store master process: metadata of the KV block pool, served over NATS request/reply
(`mc.store.<op>`), journaled to JetStream (`kv.object.*` events -> `kv_objects`)."""

from __future__ import annotations

import asyncio
import logging

from mooncake import metrics
from mooncake.config import Settings
from mooncake.store.master import StoreMaster, new_state
from workers.runtime import configure_logging, worker_context

log = logging.getLogger("mooncake.store.master")


async def main(settings: Settings, instance_id: str | None = None) -> None:
    async with worker_context(settings, "store_master", instance_id) as ctx:
        labels = metrics.TenantLabels(settings.store.namespace_quotas, settings.metrics_tenants)
        master = StoreMaster(
            ctx.nc, ctx.ns, new_state(settings.store), publisher=ctx.publisher,
            namespace_labels=labels, journal_max=settings.store.journal_max,
        )  # fmt: skip
        await master.start()
        try:
            await ctx.stop.wait()
        finally:
            await master.stop()


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))
