"""The store client: put / get / exists / remove, their batch forms, and zero-copy variants.

put = `put_start` (the master allocates replicas, invisible to readers) -> the bytes are
written straight into the nodes' segments by the transfer engine -> `put_end` (the object
becomes visible atomically). A replica that fails to write revokes the put; a client that
dies mid-put leaves a pending allocation the master reclaims after `put_timeout_s`.

get = `lookup` (complete replicas only, with a read lease that blocks eviction and removal
while the bytes are read) -> a read from the nearest replica (same host over shm, DRAM before
SSD), falling back to the next replica if a node does not answer; no replica = a clean miss.

Every op is one master round trip for the whole batch, and the transfers of a batch are
grouped per endpoint (one vectored transfer each) and run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from pydantic import BaseModel

from mooncake import metrics
from mooncake.namespace import Namespace
from mooncake.store import protocol as p
from mooncake.store.transfer.base import Transport, as_memoryview, available, make_client
from mooncake.store.types import Pin, Placement, Reason, Region, Tier

log = logging.getLogger("mooncake.store.client")

M = TypeVar("M", bound=BaseModel)


# How often a request is asked again while no master is subscribed (`StoreClient._call`).
MASTER_POLL_S = 0.2


class StoreError(Exception):
    """The master could not be reached or answered with an error (not a refusal)."""


@dataclass(frozen=True)
class ClientConfig:
    secret: bytes
    transports: tuple[str, ...] = ("rdma", "shm", "tcp")
    request_timeout_s: float = 5.0
    # How long a put keeps retrying while the master makes room (an SSD offload in flight).
    retry_later_s: float = 2.0
    # A streaming put (`start_put`) tells the master it is still being written this often
    # (`PutHandle.renew`), until it is committed or aborted, for at most `put_renew_max_s`:
    # a long prefill writes its blocks as it computes them and can outlast the master's
    # `put_timeout_s` (it then reclaims the put as a dead writer's). None: never.
    put_renew_s: float | None = None
    put_renew_max_s: float = 3600.0


@dataclass(frozen=True)
class _PutOptions:
    """What every item of one put asks of the master (`protocol.PutItem` less key and size)."""

    replicas: int = 1
    pin: Pin = Pin.NONE
    preferred_segment: str | None = None
    placement: Placement = Placement.MOST_FREE
    owner: str | None = None

    def item(self, key: str, size: int) -> p.PutItem:
        return p.PutItem(
            key=key,
            size=size,
            replicas=self.replicas,
            pin=self.pin,
            preferred_segment=self.preferred_segment,
            placement=self.placement,
            owner=self.owner,
        )


@dataclass
class _Op:
    index: int
    key: str
    buf: memoryview
    candidates: list[tuple[str, str, Region]]  # (transport, endpoint, region), best first


class StoreClient:
    def __init__(self, nc: NATS, ns: Namespace, config: ClientConfig) -> None:
        self.nc, self.config = nc, config
        self.subjects = p.Subjects(ns)
        self._transports: dict[str, Transport] = {}
        self._usable = [n for n in config.transports if available(n)[0]]
        self._reach: dict[tuple[str, str], bool] = {}
        if not self._usable:
            raise ValueError(f"no transport of {config.transports} is available here")

    async def close(self) -> None:
        for t in self._transports.values():
            with contextlib.suppress(Exception):
                await t.close()
        self._transports.clear()

    def _transport(self, name: str) -> Transport:
        t = self._transports.get(name)
        if t is None:
            opts: dict[str, Any] = {"secret": self.config.secret}
            if name == "rdma":
                opts |= {"nc": self.nc, "subject_prefix": self.subjects.ns.prefix}
            t = self._transports[name] = make_client(name, **opts)
        return t

    def route(self, endpoints: dict[str, str]) -> tuple[Transport, str] | None:
        """The transport (this client's, opened once) and endpoint this process reaches a
        segment by, the preferred one first; None if none reaches it."""
        routes = self._route(endpoints)
        if not routes:
            return None
        name, endpoint = routes[0]
        return self._transport(name), endpoint

    def _route(self, endpoints: dict[str, str]) -> list[tuple[str, str]]:
        """(transport, endpoint) pairs that reach a segment, in preference order."""
        out = []
        for name in self._usable:
            ep = endpoints.get(name)
            if ep is not None and self._reaches(name, ep):
                out.append((name, ep))
        return out

    def _reaches(self, name: str, endpoint: str) -> bool:
        """`Transport.reaches`, remembered (it parses the endpoint; a batch asks per object,
        and the answer for an endpoint does not change)."""
        key = (name, endpoint)
        known = self._reach.get(key)
        if known is None:
            if len(self._reach) >= 4096:
                self._reach.clear()
            known = self._reach[key] = self._transport(name).reaches(endpoint)
        return known

    async def _call(self, op: str, req: p.Wire, reply: type[M]) -> M:
        """One request to the master. Where no master is subscribed (it is restarting: NATS
        says so at once) it is asked again every MASTER_POLL_S within the same
        `request_timeout_s` a slow master gets, so a master's restart costs its callers a
        wait, not a failed attempt of their work."""
        body = req.model_dump_json().encode()
        deadline = time.monotonic() + self.config.request_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                resp = await self.nc.request(self.subjects.master(op), body, timeout=left)
                break
            except NoRespondersError as e:
                if left > MASTER_POLL_S:
                    await asyncio.sleep(MASTER_POLL_S)
                    continue
                failed: Exception = e
            except Exception as e:
                failed = e
            why = type(failed).__name__
            raise StoreError(f"store master did not answer {op}: {why}") from failed
        data = resp.data
        if data.startswith(b'{"error"'):
            raise StoreError(p.ErrorReply.model_validate_json(data).error)
        return reply.model_validate_json(data)

    # --- transfers --------------------------------------------------------------------------

    async def _run(self, ops: list[_Op], direction: str) -> list[bool]:
        """Run each op on its first candidate, grouped per endpoint; ops whose transfer
        failed move on to their next candidate. Returns success per op (in order)."""
        ok = [False] * len(ops)
        pending = list(range(len(ops)))
        while pending:
            groups: dict[tuple[str, str], list[int]] = defaultdict(list)
            for i in pending:
                if ops[i].candidates:
                    name, ep, _ = ops[i].candidates[0]
                    groups[(name, ep)].append(i)
            if not groups:
                break
            results = await asyncio.gather(
                *(
                    self._transfer(name, ep, [ops[i] for i in idx], direction)
                    for (name, ep), idx in groups.items()
                ),
                return_exceptions=True,
            )
            pending = []
            for ((name, ep), idx), res in zip(groups.items(), results, strict=True):
                if res is None:
                    for i in idx:
                        ok[i] = True
                    continue
                log.warning("%s %s via %s failed: %s", direction, ep, name, res)
                for i in idx:
                    ops[i].candidates.pop(0)
                    pending.append(i)
        return ok

    async def _transfer(self, name: str, ep: str, ops: list[_Op], direction: str) -> None:
        t = self._transport(name)
        pairs = [(o.candidates[0][2], o.buf) for o in ops]
        start = time.perf_counter()
        if direction == "write":
            await t.write_many(ep, pairs)
        else:
            await t.read_many(ep, pairs)
        metrics.STORE_TRANSFER_SECONDS.labels(name, direction).observe(time.perf_counter() - start)
        metrics.STORE_TRANSFER_BYTES.labels(name, direction).inc(sum(len(o.buf) for o in ops))

    def _candidates(
        self, replicas: list[p.ReplicaWire], segments: dict[str, dict[str, str]]
    ) -> list[tuple[str, str, Region]]:
        ranked: list[tuple[int, int, str, str, Region]] = []
        for r in replicas:
            region = Region(r.segment_id, r.offset, r.size)
            for rank, (name, ep) in enumerate(self._route(segments.get(r.segment_id, {}))):
                local = 0 if name != "tcp" else 1  # shm / rdma before tcp
                tier = 0 if r.tier is Tier.DRAM else 1
                ranked.append((local * 10 + tier, rank, name, ep, region))
        ranked.sort(key=lambda x: (x[0], x[1]))
        return [(name, ep, region) for _, _, name, ep, region in ranked]

    # --- put --------------------------------------------------------------------------------

    async def put(self, key: str, data: Any, **opts: Any) -> p.Refused | None:
        return (await self.put_many([(key, data)], **opts))[0]

    async def put_many(
        self,
        items: Sequence[tuple[str, Any]],
        *,
        replicas: int = 1,
        pin: Pin = Pin.NONE,
        preferred_segment: str | None = None,
        placement: Placement = Placement.MOST_FREE,
        owner: str | None = None,
    ) -> list[p.Refused | None]:
        """Store each (key, buffer); None = stored, else why not. Buffers are read in place
        (bytes, bytearray, memoryview, numpy array, CPU torch tensor), never copied.
        `owner`: the cache namespace whose quota the objects count against (None: the default
        tenant's); a full quota whose owner's own objects cannot make room refuses with
        `Reason.QUOTA`."""
        if not items:
            return []
        opts = _PutOptions(replicas, pin, preferred_segment, placement, owner)
        bufs = [as_memoryview(data, writable=False) for _, data in items]
        results: list[p.Refused | None] = [None] * len(items)
        todo = list(range(len(items)))
        deadline = time.monotonic() + self.config.retry_later_s
        delay = 0.005
        while todo:
            retry = await self._put_round(items, bufs, todo, results, opts)
            if not retry or time.monotonic() > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            todo = retry
        outcomes = Counter("ok" if r is None else r.reason.value for r in results)
        for outcome, n in outcomes.items():
            metrics.STORE_OPS.labels("put", outcome).inc(n)
        return results

    async def _put_round(
        self,
        items: Sequence[tuple[str, Any]],
        bufs: list[memoryview],
        todo: list[int],
        results: list[p.Refused | None],
        opts: _PutOptions,
    ) -> list[int]:
        req = p.PutStartRequest(items=[opts.item(items[i][0], len(bufs[i])) for i in todo])
        started = await self._call("put_start", req, p.PutStartReply)
        ops: list[_Op] = []
        op_item: list[int] = []
        retry: list[int] = []
        for i, res in zip(todo, started.results, strict=True):
            if isinstance(res, p.Refused):
                results[i] = res
                if res.reason is Reason.RETRY_LATER:
                    retry.append(i)
                continue
            for r in res.replicas:
                route = self._route(started.segments.get(r.segment_id, {}))
                region = Region(r.segment_id, r.offset, r.size)
                ops.append(_Op(i, items[i][0], bufs[i], [(n, ep, region) for n, ep in route]))
                op_item.append(i)
        written = await self._run(ops, "write") if ops else []
        failed = {op_item[j] for j, ok in enumerate(written) if not ok}
        done = sorted({i for i in op_item if i not in failed})
        for i in failed:
            results[i] = p.Refused(reason=Reason.NO_SPACE, detail="a replica could not be written")
        if failed:
            await self._call(
                "put_revoke", p.KeysRequest(keys=[items[i][0] for i in failed]), p.ResultsReply
            )
        if done:
            ended = await self._call(
                "put_end", p.KeysRequest(keys=[items[i][0] for i in done]), p.ResultsReply
            )
            for i, outcome in zip(done, ended.results, strict=True):
                results[i] = outcome
        return retry

    # --- get --------------------------------------------------------------------------------

    async def get(self, key: str) -> bytearray | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[str]) -> list[bytearray | None]:
        """The objects' bytes (None = miss)."""
        out: list[bytearray | None] = [None] * len(keys)

        def alloc(i: int, size: int) -> memoryview:
            buf = out[i] = bytearray(size)
            return memoryview(buf)

        sizes = await self._get(keys, alloc)
        return [b if s is not None else None for b, s in zip(out, sizes, strict=True)]

    async def get_into(self, key: str, out: Any) -> int | None:
        return (await self.get_many_into([key], [out]))[0]

    async def get_many_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[int | None]:
        """Read each object into the caller's buffer (zero-copy: the transport writes straight
        into it). Returns the object's size per key, None for a miss. A buffer smaller than
        its object is a ValueError (nothing is read)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} buffers")
        views = [as_memoryview(o, writable=True) for o in outs]

        def into(i: int, size: int) -> memoryview:
            if len(views[i]) < size:
                raise ValueError(
                    f"buffer for {keys[i]!r} holds {len(views[i])} bytes, the object {size}"
                )
            return views[i][:size]

        return await self._get(keys, into)

    async def _get(
        self, keys: Sequence[str], buffer_for: Callable[[int, int], memoryview]
    ) -> list[int | None]:
        if not keys:
            return []
        found = await self._call("lookup", p.KeysRequest(keys=list(keys)), p.LookupReply)
        ops: list[_Op] = []
        sizes: list[int | None] = [None] * len(keys)
        for i, res in enumerate(found.results):
            if isinstance(res, p.Refused) or not res.replicas:
                continue
            size = res.replicas[0].size
            cands = self._candidates(res.replicas, found.segments)
            ops.append(_Op(i, keys[i], buffer_for(i, size), cands))
            sizes[i] = size
        read = await self._run(ops, "read") if ops else []
        for op, ok in zip(ops, read, strict=True):
            if not ok:
                sizes[op.index] = None
        hits = sum(s is not None for s in sizes)
        metrics.STORE_OPS.labels("get", "hit").inc(hits)
        metrics.STORE_OPS.labels("get", "miss").inc(len(keys) - hits)
        return sizes

    # --- streaming --------------------------------------------------------------------------

    async def start_put(
        self,
        items: Sequence[tuple[str, int]],
        *,
        replicas: int = 1,
        pin: Pin = Pin.NONE,
        preferred_segment: str | None = None,
        owner: str | None = None,
    ) -> PutHandle:
        """Allocate (key, size) objects to be written piece by piece (see `PutHandle`).
        Keys the master refused (already stored, no space, quota) are in `handle.refused`;
        `owner` as `put_many` takes it."""
        refused: dict[str, p.Refused] = {}
        plans: dict[str, p.Plan] = {}
        segments: dict[str, dict[str, str]] = {}
        if items:
            opts = _PutOptions(replicas, pin, preferred_segment, owner=owner)
            req = p.PutStartRequest(items=[opts.item(k, n) for k, n in items])
            started = await self._call("put_start", req, p.PutStartReply)
            segments = started.segments
            for (key, _), res in zip(items, started.results, strict=True):
                if isinstance(res, p.Refused):
                    refused[key] = res
                else:
                    plans[key] = res
        shared = p.SharedPut(plans=plans, segments=segments)
        handle = PutHandle(self, self._routes_of(shared), refused, shared)
        if plans and self.config.put_renew_s is not None:
            handle.renew_every(self.config.put_renew_s, self.config.put_renew_max_s)
        return handle

    def join_put(self, shared: p.SharedPut) -> PutHandle:
        """A handle on a put another process started (`PutHandle.share`): it writes pieces
        of the objects; the starter counts them in (`PutHandle.credit`) and commits."""
        return PutHandle(self, self._routes_of(shared), {}, None)

    def _routes_of(self, shared: p.SharedPut) -> dict[str, list[list[tuple[str, str, Region]]]]:
        """Per object, per replica: the (transport, endpoint, region) this client can use."""
        return {
            key: [
                [
                    (n, ep, Region(r.segment_id, r.offset, r.size))
                    for n, ep in self._route(shared.segments.get(r.segment_id, {}))
                ]
                for r in plan.replicas
            ]
            for key, plan in shared.plans.items()
        }

    async def start_get(self, keys: Sequence[str]) -> GetHandle:
        """Look objects up (leasing them) to read piece by piece (see `GetHandle`)."""
        found: dict[str, tuple[int, list[tuple[str, str, Region]]]] = {}
        if keys:
            reply = await self._call("lookup", p.KeysRequest(keys=list(keys)), p.LookupReply)
            for key, res in zip(keys, reply.results, strict=True):
                if isinstance(res, p.Found) and res.replicas:
                    found[key] = (
                        res.replicas[0].size,
                        self._candidates(res.replicas, reply.segments),
                    )
        return GetHandle(self, found)

    # --- exists / remove --------------------------------------------------------------------

    async def exists(self, key: str) -> bool:
        return (await self.exists_many([key]))[0]

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        reply = await self._call("exists", p.KeysRequest(keys=list(keys)), p.ExistsReply)
        return reply.results

    async def remove(self, key: str, *, force: bool = False) -> p.Refused | None:
        return (await self.remove_many([key], force=force))[0]

    async def remove_many(
        self, keys: Sequence[str], *, force: bool = False
    ) -> list[p.Refused | None]:
        if not keys:
            return []
        req = p.KeysRequest(keys=list(keys), force=force)
        return (await self._call("remove", req, p.ResultsReply)).results


# --- streaming handles: a put written piece by piece, a get read piece by piece ---------------


class PutHandle:
    """A batch of puts whose bytes arrive in pieces (a prefill writes each new KV block layer
    by layer while it computes): `start_put` allocates, `write` sends ranges, `commit` makes
    every fully-written object visible at once, `abort` revokes. Readers never see a partial
    object: until `commit`, the objects are pending."""

    def __init__(
        self,
        client: StoreClient,
        routes: dict[str, list[list[tuple[str, str, Region]]]],
        refused: dict[str, p.Refused],
        shared: p.SharedPut | None = None,
    ) -> None:
        self._client = client
        self._routes = routes  # key -> per replica: candidates (transport, endpoint, region)
        self.refused = refused
        # What another process needs to write into this put; None: this handle joined a put
        # started elsewhere (it writes, the starter commits).
        self._shared = shared
        self._failed: set[str] = set()
        self._written: dict[str, int] = dict.fromkeys(routes, 0)
        self._done = False
        self._renewing: asyncio.Task[None] | None = None

    @property
    def keys(self) -> list[str]:
        return list(self._routes)

    @property
    def started_here(self) -> bool:
        return self._shared is not None

    def share(self) -> p.SharedPut:
        """The put's objects and where they live, for `StoreClient.join_put` elsewhere."""
        if self._shared is None:
            raise ValueError("only the process that started a put can share it")
        return self._shared

    def written(self) -> tuple[dict[str, int], set[str]]:
        """(bytes written per object, objects a piece of which failed) by this handle: what a
        joined handle reports to the starter."""
        return dict(self._written), set(self._failed)

    def credit(self, written: Mapping[str, int], failed: Iterable[str] = ()) -> None:
        """Count pieces a joined handle wrote (its `written()`), so `commit` publishes an
        object whose bytes came from several processes."""
        for key, n in written.items():
            if key not in self._routes:
                raise KeyError(f"{key!r} is not part of this put")
            if n < 0:
                raise ValueError("a negative byte count")
            self._written[key] += n
        self._failed.update(k for k in failed if k in self._routes)

    async def write(self, parts: Sequence[tuple[str, int, Any]]) -> None:
        """Write (key, offset inside the object, buffer) pieces, all replicas, in parallel.
        A piece that cannot be written marks its object failed (commit leaves it out)."""
        ops: list[_Op] = []
        for key, offset, data in parts:
            if key not in self._routes:
                raise KeyError(f"{key!r} is not part of this put")
            view = as_memoryview(data, writable=False)
            for cands in self._routes[key]:
                size = cands[0][2].length if cands else 0
                if offset < 0 or offset + len(view) > size:
                    raise ValueError(f"piece {offset}+{len(view)} outside {key!r} ({size} bytes)")
                sub = [
                    (n, ep, Region(r.segment_id, r.offset + offset, len(view)))
                    for n, ep, r in cands
                ]
                ops.append(_Op(len(ops), key, view, sub))
            self._written[key] += len(view)
        ok = await self._client._run(ops, "write") if ops else []
        self._failed.update(op.key for op, good in zip(ops, ok, strict=True) if not good)

    def renew_every(self, every_s: float, for_at_most_s: float) -> None:
        """Renew the put every `every_s` until it is committed or aborted (or
        `for_at_most_s` passed); a renewal that fails is tried at the next one."""

        async def loop() -> None:
            deadline = time.monotonic() + for_at_most_s
            # `_done` too: a cancel its request swallowed leaves it to end here.
            while time.monotonic() < deadline and not self._done:
                await asyncio.sleep(every_s)
                try:
                    await self.renew()
                except Exception as exc:  # the commit says what came of it
                    log.warning("put renewal failed: %s", exc)

        self._renewing = asyncio.get_running_loop().create_task(loop())

    def _stop_renewing(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None

    async def renew(self) -> None:
        """Tell the master the put is still being written: its objects' `put_timeout_s`
        counts from now (a prefill that writes its blocks as it computes them can outlast
        it). Only the handle that started the put renews it."""
        if self._shared is None:
            raise ValueError("only the process that started a put renews it")
        if not self._done and self._routes:
            await self._client._call(
                "put_renew", p.KeysRequest(keys=list(self._routes)), p.ResultsReply
            )

    async def commit(self) -> dict[str, p.Refused | None]:
        """Publish every object whose bytes were all written without error; revoke the
        others (a piece failed, or fewer bytes were written than the object holds). Only
        the handle that started the put commits it (or aborts it)."""
        if self._shared is None:
            raise ValueError("only the process that started a put commits it")
        self._done = True
        self._stop_renewing()
        out: dict[str, p.Refused | None] = dict(self.refused)
        bad: dict[str, str] = {}
        for key, cands in self._routes.items():
            size = cands[0][0][2].length if cands and cands[0] else 0
            if key in self._failed:
                bad[key] = "a piece could not be written"
            elif self._written[key] < size:
                bad[key] = f"{self._written[key]} of {size} bytes written"
        good = [k for k in self._routes if k not in bad]
        if bad:
            await self._client._call("put_revoke", p.KeysRequest(keys=list(bad)), p.ResultsReply)
            for k, why in bad.items():
                out[k] = p.Refused(reason=Reason.INVALID, detail=why)
        if good:
            ended = await self._client._call("put_end", p.KeysRequest(keys=good), p.ResultsReply)
            out.update(zip(good, ended.results, strict=True))
        return out

    async def abort(self) -> None:
        if self._shared is None:
            raise ValueError("only the process that started a put aborts it")
        self._stop_renewing()
        if self._done or not self._routes:
            return
        self._done = True
        with contextlib.suppress(Exception):
            await self._client._call(
                "put_revoke", p.KeysRequest(keys=list(self._routes)), p.ResultsReply
            )


class GetHandle:
    """Objects found by one lookup (leased for `lease_s`), read piece by piece: a prefill
    loads each cached block layer by layer, just ahead of the layer that needs it."""

    def __init__(
        self, client: StoreClient, found: dict[str, tuple[int, list[tuple[str, str, Region]]]]
    ) -> None:
        self._client = client
        self._found = found  # key -> (size, candidates best first)

    def size(self, key: str) -> int | None:
        hit = self._found.get(key)
        return None if hit is None else hit[0]

    async def read(self, parts: Sequence[tuple[str, int, Any]]) -> list[bool]:
        """Read (key, offset, buffer) pieces; False for a piece no replica could serve."""
        ops: list[_Op] = []
        for key, offset, out in parts:
            view = as_memoryview(out, writable=True)
            size, cands = self._found.get(key, (0, []))
            if offset < 0 or offset + len(view) > size:
                raise ValueError(f"piece {offset}+{len(view)} outside {key!r} ({size} bytes)")
            sub = [
                (n, ep, Region(r.segment_id, r.offset + offset, len(view))) for n, ep, r in cands
            ]
            ops.append(_Op(len(ops), key, view, sub))
        return await self._client._run(ops, "read") if ops else []
