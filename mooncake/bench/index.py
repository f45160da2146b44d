"""`mooncake bench index`: how exact the Conductor's KV index stays under faults.

The store runs as in production: a private NATS, `mooncake worker store-master` and three
`mooncake worker store-node` processes, each with a small DRAM segment and an SSD tier so the
workload offloads, promotes and evicts. This process is the workload (puts of prompts' block
chains, hits, deletes) and the Conductor's side: the real `KvIndexSubscriber` /
`KvIndexFollower` into a `ClusterView`'s block index, and Algorithm 1 (`core.conductor.choose`)
over it, one prefill instance per store node.

Three faults, one after another, each while the workload runs:
- `drop`: 1 % of the KV event messages the subscriber receives are dropped at random;
- `master_restart`: the store master is killed (SIGKILL) and started again (it relearns the
  objects from the nodes' re-mounts);
- `node_kill`: a store node is killed (SIGKILL), left dead for 4 s (its blocks must stop
  counting as hits: `silent_detect_s`), then started again (a new life, empty).

A fault *ends* when the drops stop, the master is back, the node is back; the workload then
pauses so that the truth holds still. From then on, every 50 ms for 4 s (and at least until
the index has caught up), the bench reads each node's holdings (its own KV snapshot; a dead
node holds nothing), the master's listing of each node (`node_objects`) and each node's
index state, and makes `per_poll` decisions for prompts of the workload; each block a
decision assumes (its instance's local prefix, the pool's prefix it would fetch) is checked
against what the nodes hold. `resync_s`: from the end until every node is EXACT and the
index holds exactly what the nodes hold; `exact_s`: until every node merely says EXACT (a
loss not yet seen, with no later batch and no tip yet, leaves a node EXACT but behind);
`master_caught_up_s`: until the master lists what the nodes hold (a restarted master
relearns it from their re-mounts). Decisions are counted by when they were made: while a
node was not EXACT (its blocks excluded: `overcounted_decisions_while_resyncing`), while
every node said EXACT before the index caught up (`overcounted_decisions_stale_exact`), and
after it caught up (`overcounted_decisions_after_resync`: the index must not fall behind
again). `unservable_exact`: decisions assuming a block its node holds but the master could
not serve yet. The same decisions over a naive index in the same run (every received batch
applied, no gap detection, snapshots, tips or silence) show that the checks can fail:
`naive_overcounted_decisions`.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from mooncake.aio import cancel_all
from mooncake.bench.store import spawn_store_role, wait_store_ready
from mooncake.core import cluster as cl
from mooncake.core.block_index import BlockIndex
from mooncake.core.conductor import ConductorConfig, ScheduleRequest, choose
from mooncake.core.cost_model import reference_costs
from mooncake.namespace import Namespace
from mooncake.services import EmbeddedNats, ManagedProcess
from mooncake.store import protocol as p
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.kv_follow import KvIndexSubscriber
from mooncake.store.kv_index import IndexState, KvIndexFollower

Log = Callable[[str], None]
KiB, MiB = 1 << 10, 1 << 20
NAMESPACE = "bench_index"
NODES = ("ix-node-0", "ix-node-1", "ix-node-2")
BLOCK_BYTES = 64 * KiB
BLOCK_TOKENS = 16  # the decisions' block size: only the key chains matter here
SHARED, OWN = 4, 4  # blocks of a prompt: a group's shared prefix, then its own
GROUPS = 6
# After a fault ends, decisions are made and checked for this long (at least until the index
# has converged): longer than a tip's interval and the silence window's.
WATCH_S = 4.0


class _LossySubscriber(KvIndexSubscriber):
    """The real subscriber behind a lossy link (`drop_p` of messages lost at random), and
    beside it the naive index: every batch it receives, applied as it comes."""

    def __init__(self, *args: Any, rng: random.Random, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng, self.drop_p, self.dropped = rng, 0.0, 0
        self.naive = BlockIndex()

    async def _on_events(self, msg: Msg) -> None:
        if self.drop_p and self.rng.random() < self.drop_p:
            self.dropped += 1
            return
        try:
            w = p.KvEvents.model_validate_json(msg.data)
        except Exception:
            w = None
        if w is not None and not w.tip:
            self.naive.add(w.node_id, w.stored)
            self.naive.to_ssd(w.node_id, w.ssd)
            self.naive.to_dram(w.node_id, w.dram)
            self.naive.remove(w.node_id, w.removed)
        await super()._on_events(msg)


def _prompts(n: int) -> list[tuple[str, ...]]:
    """Chains of block keys: prompt i shares its group's first blocks."""
    out = []
    for i in range(n):
        g = i % GROUPS
        out.append(tuple([f"g{g}-{j}" for j in range(SHARED)] + [f"p{i}-{j}" for j in range(OWN)]))
    return out


class _Workload:
    """Puts prompts' blocks (hot prompts more often), reads some back (promotions from SSD)
    and deletes some prompts' own blocks, as fast as the store takes them, until paused."""

    def __init__(self, client: StoreClient, prompts: list[tuple[str, ...]], seed: int) -> None:
        self.client, self.prompts, self.rng = client, prompts, random.Random(seed)
        self.ops = self.errors = 0
        self._go = asyncio.Event()
        self._parked = asyncio.Event()
        self._payload = bytes(BLOCK_BYTES)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._go.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def pause(self) -> None:
        """Stop issuing and wait out the op in flight: the store then holds still."""
        self._go.clear()
        await asyncio.wait_for(self._parked.wait(), 30)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])

    def _pick(self) -> tuple[str, ...]:
        # Zipf-like: a few hot prompts, a long tail.
        i = min(int(self.rng.paretovariate(1.2)) - 1, len(self.prompts) - 1)
        return self.prompts[(i * 7919) % len(self.prompts)]

    async def _loop(self) -> None:
        while True:
            if not self._go.is_set():
                self._parked.set()
                await self._go.wait()
                self._parked.clear()
            keys = self._pick()
            try:
                r = self.rng.random()
                if r < 0.05:
                    await self.client.remove_many(list(keys[SHARED:]), force=True)
                elif r < 0.25:
                    await self.client.get_many(list(keys))
                else:
                    await self.client.put_many([(k, self._payload) for k in keys])
                self.ops += 1
            except Exception:
                self.errors += 1
                await asyncio.sleep(0.05)
            await asyncio.sleep(0)


async def _held(nc: NATS, ns: Namespace, nodes: tuple[str, ...]) -> dict[str, set[str]]:
    """What each node holds, as it says itself (its KV snapshot: the set its events
    describe); a node that does not answer (dead) holds nothing reachable."""
    subjects = p.Subjects(ns)
    out: dict[str, set[str]] = {}
    for node in nodes:
        try:
            resp = await nc.request(subjects.kv_snapshot(node), b"", timeout=0.5)
            out[node] = set(p.KvSnapshotWire.model_validate_json(resp.data).keys)
        except Exception:
            out[node] = set()
    return out


async def _truth(nc: NATS, ns: Namespace, nodes: tuple[str, ...]) -> dict[str, set[str]]:
    """What each node holds, as the master lists it (what a reader can be served)."""
    subjects = p.Subjects(ns)
    out: dict[str, set[str]] = {}
    for node in nodes:
        req = p.NodeObjectsRequest(node_id=node).model_dump_json().encode()
        resp = await nc.request(subjects.master("node_objects"), req, timeout=5)
        listing = p.NodeObjects.model_validate_json(resp.data)
        out[node] = {o.key for o in listing.objects}
    return out


def _indexed(index: BlockIndex, keys: set[str], node: str) -> set[str]:
    return {k for k in keys if node in index.holders(k)}


def _view(index_follower: KvIndexFollower | None, index: BlockIndex) -> cl.ClusterView:
    view = cl.ClusterView()
    view.blocks = index
    for i, node in enumerate(NODES):
        view.apply(cl.InstanceJoined(f"prefill-{i}", "prefill", node), 0.0)
    view.apply(cl.InstanceJoined("decode-0", "decode", "decode-node", 1 << 30), 0.0)
    if index_follower is not None:
        view.unsure_nodes = index_follower.unsure()
    return view


def overcounted(
    view: cl.ClusterView,
    prompts: list[tuple[str, ...]],
    truth: dict[str, set[str]],
    n: int,
    rng: random.Random,
) -> tuple[int, int]:
    """(decisions that assumed a block not there, blocks assumed) over `n` decisions."""
    cfg = ConductorConfig(block_tokens=BLOCK_TOKENS)
    costs = reference_costs()
    anywhere = set().union(*truth.values())
    bad = assumed = 0
    for i in range(n):
        keys = rng.choice(prompts)
        req = ScheduleRequest(f"check-{i}", len(keys) * BLOCK_TOKENS, keys)
        c = choose(view, req, cfg, costs, 0.0)
        if c is None:
            continue
        local = keys[: c.local_blocks]
        fetched = keys[c.local_blocks : c.prefix_blocks]
        sources = c.copy.sources if c.copy is not None else ()
        ok = all(k in truth.get(c.prefill.node, set()) for k in local)
        if sources:
            ok &= all(k in truth.get(s, set()) for s in sources for k in fetched)
        else:
            ok &= all(k in anywhere for k in fetched)
        assumed += len(local) + len(fetched)
        bad += not ok
    return bad, assumed


async def run_index_bench(
    *,
    prompts: int = 120,
    drop_p: float = 0.01,
    fault_s: float = 10.0,
    per_poll: int = 20,
    seed: int = 0,
    log: Log = print,
) -> dict[str, Any]:
    if prompts < GROUPS or not 0 < drop_p < 1 or fault_s < 2 or per_poll < 1:
        raise ValueError("prompts >= 6, 0 < drop-p < 1, fault-s >= 2 and per-poll >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-index-"))
    secret = secrets.token_hex(16)
    ns = Namespace(NAMESPACE)
    node_env = {
        "MOONCAKE_STORE__DRAM_BYTES": str(8 * MiB),
        "MOONCAKE_STORE__SSD_BYTES": str(16 * MiB),
    }
    broker: EmbeddedNats | None = None
    master: ManagedProcess | None = None
    nodes: dict[str, ManagedProcess] = {}
    chains = _prompts(prompts)
    result: dict[str, Any] = {
        "nodes": len(NODES), "prompts": prompts, "block_bytes": BLOCK_BYTES,
        "drop_p": drop_p, "fault_s": fault_s, "decisions_per_poll": per_poll,
    }  # fmt: skip

    def spawn_master() -> ManagedProcess:
        return spawn_store_role("store-master", "ix-master", url, secret, tmp, namespace=NAMESPACE)

    def spawn_node(name: str) -> ManagedProcess:
        return spawn_store_role(
            "store-node", name, url, secret, tmp, namespace=NAMESPACE, env=node_env
        )

    try:
        broker = await asyncio.to_thread(lambda: EmbeddedNats.create(tmp).start())
        url = broker.url
        master = spawn_master()
        for name in NODES:
            nodes[name] = spawn_node(name)
        nc = await nats.connect(url)
        index = BlockIndex()
        follower = KvIndexFollower(index)
        sub = _LossySubscriber(nc, ns, follower, rng=random.Random(seed + 1))
        await sub.start()
        # Short timeouts: ops meeting a dead master fail fast, so the workload pauses fast.
        client = StoreClient(nc, ns, ClientConfig(secret.encode(), ("tcp",), 1.0))
        work = _Workload(client, chains, seed + 2)
        try:
            await wait_store_ready(client)
            work.start()
            log(f"warming up: {fault_s:.0f} s of workload")
            await asyncio.sleep(fault_s)
            faults: dict[str, dict[str, Any]] = {}

            async def settle(name: str, ended: float) -> None:
                """With the workload paused (the truth holds still), from the fault's end:
                every 50 ms the master's listing, each node's index state, and `per_poll`
                decisions checked against that listing (and the naive index's, the same
                way), for `WATCH_S` and at least until the index holds exactly the
                listing. `resync_s`: until every node is EXACT again; decisions made while
                they all are must assume no missing block (the target), the others exclude
                the unsure nodes."""
                rngs = [random.Random(seed) for _ in range(3)]
                # Decisions by when they were made: while a node was not EXACT; while every
                # node said EXACT but the index had not caught up yet (a loss not yet seen:
                # no later batch, no tip yet); after the index caught up (`resync_s`).
                tally = dict.fromkeys(
                    ("decisions_resyncing", "overcounted_resyncing", "decisions_stale_exact",
                     "overcounted_stale_exact", "decisions_after_resync",
                     "overcounted_after_resync", "naive_overcounted", "assumed_blocks",
                     "unservable_exact"), 0,
                )  # fmt: skip
                exact_at: float | None = None
                converged: float | None = None  # the index holds what the nodes hold
                master_at: float | None = None  # the master lists what the nodes hold
                while True:
                    # The nodes' own holdings are the index's truth; the master's listing,
                    # what a reader can be served (a restarted master relearns it from the
                    # nodes' re-mounts).
                    held = await _held(nc, ns, NODES)
                    truth = await _truth(nc, ns, NODES)
                    now = time.monotonic() - ended
                    exact = all(follower.state(n) is IndexState.EXACT for n in NODES)
                    if exact and exact_at is None:
                        exact_at = now
                    keys = set().union(*held.values(), *truth.values()) | set(index.keys())
                    caught_up = all(_indexed(index, keys, n) == held[n] for n in NODES)
                    if exact and caught_up and converged is None:
                        converged = now
                    if master_at is None and all(held[n] == truth[n] for n in NODES):
                        master_at = now
                    view = _view(follower, index)
                    bad, assumed = overcounted(view, chains, held, per_poll, rngs[0])
                    kind = (
                        "resyncing" if not exact
                        else "after_resync" if converged is not None else "stale_exact"
                    )  # fmt: skip
                    tally[f"decisions_{kind}"] += per_poll
                    tally[f"overcounted_{kind}"] += bad
                    tally["assumed_blocks"] += assumed
                    if exact:
                        tally["unservable_exact"] += overcounted(
                            view, chains, truth, per_poll, rngs[1]
                        )[0]
                    naive = _view(None, sub.naive)
                    tally["naive_overcounted"] += overcounted(
                        naive, chains, held, per_poll, rngs[2]
                    )[0]
                    if converged is not None and master_at is not None and now >= WATCH_S:
                        break
                    if now > 30.0:
                        diff = {
                            n: (sorted(_indexed(index, keys, n) - truth[n])[:5],
                                sorted(truth[n] - _indexed(index, keys, n))[:5])
                            for n in NODES
                        }  # fmt: skip
                        raise RuntimeError(
                            f"{name}: the index did not converge in 30 s: states "
                            f"{follower.states()}, (indexed not held, held not indexed) {diff}; "
                            f"logs in {tmp / 'logs'}"
                        )
                    await asyncio.sleep(0.05)
                listed = set().union(*truth.values())
                faults[name].update(
                    resync_s=round(converged, 3),
                    exact_s=round(exact_at if exact_at is not None else now, 3),
                    master_caught_up_s=round(master_at, 3), **tally,
                    blocks_held=sum(len(t) for t in truth.values()),
                    ssd_only_blocks_indexed=sum(1 for k in listed if index.ssd_holders(k)),
                )  # fmt: skip
                log(f"{name}: {faults[name]}")
                work.start()
                await asyncio.sleep(fault_s / 2)  # the workload again before the next fault

            # 1. lost KV events: 1 % dropped while the workload runs; the fault ends when
            # the link is whole again.
            faults["drop"] = {}
            sub.drop_p = drop_p
            await asyncio.sleep(fault_s)
            await work.pause()
            sub.drop_p = 0.0
            faults["drop"]["dropped_messages"] = sub.dropped
            await settle("drop", time.monotonic())

            # 2. the store master killed (the workload meets no master for a while) and
            # started again; the fault ends when it answers.
            faults["master_restart"] = {}
            await asyncio.to_thread(master.kill)
            await asyncio.sleep(1.0)
            await work.pause()
            master = spawn_master()
            await _answers(
                nc,
                p.Subjects(ns).master("node_objects"),
                p.NodeObjectsRequest(node_id=NODES[0]).model_dump_json().encode(),
            )
            await settle("master_restart", time.monotonic())

            # 3. a store node killed; its blocks must stop counting as hits (silence);
            # started again after 4 s, the fault ends when it answers on the bus.
            faults["node_kill"] = {}
            victim = NODES[0]
            await asyncio.to_thread(nodes[victim].kill)
            killed = time.monotonic()
            silent_at = None
            while time.monotonic() - killed < 4.0:
                if silent_at is None and victim in follower.unsure():
                    silent_at = time.monotonic()
                await asyncio.sleep(0.02)
            faults["node_kill"]["silent_detect_s"] = (
                round(silent_at - killed, 3) if silent_at is not None else None
            )
            await work.pause()
            nodes[victim] = spawn_node(victim)
            await _answers(nc, p.Subjects(ns).kv_snapshot(victim), b"")
            await settle("node_kill", time.monotonic())

            result["faults"] = faults
            result["workload_ops"], result["workload_errors"] = work.ops, work.errors
            result["snapshots"] = sub.snapshots
            result["follower"] = dict(follower.stats)
            result["resync_s_max"] = max(f["resync_s"] for f in faults.values())
            for key, of in (
                ("decisions_after_resync", "decisions_after_resync"),
                ("overcounted_decisions_after_resync", "overcounted_after_resync"),
                ("overcounted_decisions_stale_exact", "overcounted_stale_exact"),
                ("overcounted_decisions_while_resyncing", "overcounted_resyncing"),
                ("naive_overcounted_decisions", "naive_overcounted"),
            ):
                result[key] = sum(f[of] for f in faults.values())
            return result
        finally:
            # Each within a bound: a step stuck on a dead peer must not hold the run (or its
            # processes, which are stopped below) forever.
            steps = (("workload", work.stop()), ("subscriber", sub.stop()),
                     ("client", client.close()), ("broker connection", nc.drain()))  # fmt: skip
            for what, step in steps:
                try:
                    await asyncio.wait_for(step, 10)
                except Exception as exc:
                    log(f"stopping the {what}: {type(exc).__name__} {exc}")
    finally:
        for proc in (*nodes.values(), *([master] if master else [])):
            await asyncio.to_thread(proc.stop)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        if "resync_s_max" in result:  # a failed run keeps its logs (named in its error)
            await asyncio.to_thread(shutil.rmtree, tmp, True)


async def _answers(nc: NATS, subject: str, payload: bytes, within_s: float = 60.0) -> None:
    """Until a request on `subject` gets a reply (a restarted process is up on the bus)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await nc.request(subject, payload, timeout=0.5)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answers on {subject} (see the logs)") from None
            await asyncio.sleep(0.05)
