"""A 3-node NATS JetStream cluster (deploy/nats/cluster.conf, as compose's `cluster` profile
runs it) with every stream at 3 replicas: losing a broker node, the stream leader itself,
loses nothing and stops nothing.

The servers are real `nats-server` processes on free ports with their own store dirs and
routes between them, authenticating with the project's per-role users. Two tests: the bus
(the project's Publisher and PullConsumer, as the conductor and the recorder run them) with
exact accounting of every event, and the live pipeline (store master, Conductor, a prefill
and a decode worker with the dummy model, as processes) answering requests through the loss.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ClusterInfo

from mooncake import events as ev
from mooncake.bus import terminal
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.consume import ACK, Delivery, Outcome, PullConsumer, per_message
from mooncake.bus.publish import Publisher
from mooncake.client import Outcome as Answer
from mooncake.client import ask
from mooncake.config import BusSettings, EngineSettings, Settings
from mooncake.engine import generate
from mooncake.engine.sampling import SamplingParams as EngineParams
from mooncake.services import ManagedProcess, free_port, nats_server_binary, tcp_reachable
from mooncake.serving.models import build_engine
from mooncake.serving.streaming import resume_tokens
from workers.recorder import EVENT_CONSUMERS

from helpers import NATS_DEPLOY as DEPLOY
from helpers import NATS_ROLES as ROLES
from helpers import Worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PASSWORDS = {role: f"cluster-{role}-{uuid.uuid4().hex[:8]}" for role in ROLES}
ROUTE_PASSWORD = "cluster-route-" + uuid.uuid4().hex[:8]
NS = ev.Namespace()  # auth.conf is written for the default namespace
REPLICAS = 3


@dataclass
class Node:
    name: str
    process: ManagedProcess
    url: str


@dataclass
class Cluster:
    nodes: list[Node]

    @property
    def url(self) -> str:
        """What a client is given: every node (it also learns them from the servers)."""
        return ",".join(n.url for n in self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def settings(self, role: str, **kw: Any) -> Settings:
        values: dict[str, Any] = {
            "nats_url": self.url,
            "nats_user": role,
            "nats_password": PASSWORDS[role],
            "nats_password_file": None,
            "nats_token": None,
            "nats_creds": None,
            "nats_inbox_prefix": None,
            "nats_tls_ca": None,
            "nats_tls_cert": None,
            "nats_tls_key": None,
            "namespace": NS.prefix,
            # Short ack wait: an ack lost with a dying node is redelivered soon.
            "bus": BusSettings(replicas=REPLICAS, ack_wait_s=2.0),
        }
        return Settings(_env_file=None, **(values | kw))


def _env(name: str) -> dict[str, str]:
    env = {f"NATS_{r.upper().replace('-', '_')}_PASSWORD": p for r, p in PASSWORDS.items()}
    return env | {
        "PATH": os.environ.get("PATH", ""),
        "NATS_SERVER_NAME": name,
        "NATS_ROUTE_PASSWORD": ROUTE_PASSWORD,
    }


def start_cluster(tmp: Path) -> Cluster:
    names = [f"n{i}" for i in range(1, 4)]
    ports = {n: (free_port(), free_port(), free_port()) for n in names}  # client, monitor, route
    routes = ",".join(f"nats-route://route:{ROUTE_PASSWORD}@127.0.0.1:{ports[n][2]}" for n in names)
    nodes = []
    for name in names:
        client, monitor, route = ports[name]
        argv = [nats_server_binary(), "-c", str(DEPLOY / "cluster.conf")]
        argv += ["-a", "127.0.0.1", "-p", str(client), "-m", str(monitor)]
        argv += ["-sd", str(tmp / name), "--cluster", f"nats://127.0.0.1:{route}"]
        argv += ["--routes", routes]
        proc = ManagedProcess(name, argv, tmp / f"{name}.log", client, env=_env(name))
        proc.spawn()
        nodes.append(Node(name, proc, f"nats://127.0.0.1:{client}"))
    deadline = time.monotonic() + 20
    for node in nodes:
        while not tcp_reachable("127.0.0.1", node.process.port):
            assert node.process.running, node.process.log_path.read_text()
            assert time.monotonic() < deadline, f"{node.name} did not start"
            time.sleep(0.05)
    return Cluster(nodes)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path)
    try:
        yield c
    finally:
        for node in c.nodes:
            node.process.stop()


async def until_jetstream_ready(cluster: Cluster, nc: NATS, within_s: float = 30) -> None:
    """Streams can be made once the cluster has elected its JetStream meta leader."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await ensure_streams(nc.jetstream(), cluster.settings("admin"))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


@pytest_asyncio.fixture
async def admin(cluster: Cluster) -> AsyncIterator[NATS]:
    nc = await connect(cluster.settings("admin"), "test-admin")
    await until_jetstream_ready(cluster, nc)
    try:
        yield nc
    finally:
        await nc.close()


async def placement(js: JetStreamContext, stream: str) -> ClusterInfo:
    """Where a stream's replicas are: its leader and the other peers."""
    info = (await js.stream_info(stream)).cluster
    assert info is not None, f"{stream} is not clustered"
    return info


def admissions(prefix: str, n: int) -> list[ev.RequestAdmitted]:
    return [
        ev.RequestAdmitted(request_id=f"{prefix}-{i}", policy="none", prefill_instance="p0")
        for i in range(n)
    ]


async def test_streams_survive_losing_the_leader_node(cluster: Cluster, admin: NATS) -> None:
    js = admin.jetstream()
    stream = NS.stream("MC_REQ")
    # every stream and the terminal-claims bucket: 3 replicas, one per node
    for stream_spec in NS.streams():
        info = await js.stream_info(stream_spec.name)
        assert info.config.num_replicas == REPLICAS, stream_spec.name
    bucket = await js.stream_info("KV_" + NS.stream(terminal.BUCKET))
    assert bucket.config.num_replicas == REPLICAS

    conductor = await connect(cluster.settings("conductor"), "conductor")
    recorder = await connect(cluster.settings("recorder"), "recorder")
    try:
        publisher = Publisher(conductor, conductor.jetstream(), NS, timeout_s=2.0)
        seen: dict[str, int] = {}
        stop = asyncio.Event()

        async def record(d: Delivery) -> Outcome:
            event = ev.parse_event(d.data)
            assert isinstance(event, ev.RequestAdmitted), event
            seen[event.event_id] = seen.get(event.event_id, 0) + 1
            return ACK

        bus = cluster.settings("recorder").bus
        # the recorder's own durable consumer of MC_REQ
        spec = EVENT_CONSUMERS[0]
        consumer = PullConsumer(recorder, recorder.jetstream(), spec, bus, NS, expires_s=1.0)
        # Made before the fault (as a worker does at start); reading goes on through it.
        await consumer.ensure()
        reading = asyncio.create_task(consumer.run(per_message(record, "recorder"), stop))

        before = admissions("before", 40)
        await publisher.publish_many(before)

        # kill -9 the node that leads MC_REQ: a leader election must follow
        leader = (await placement(js, stream)).leader
        assert leader is not None
        killed = cluster.node(leader)
        killed.process.kill()
        started = time.monotonic()

        after = admissions("after", 40)
        for event in after:  # one by one, through the election (Publisher retries)
            await publisher.publish(event)
        publish_recovery_s = time.monotonic() - started

        published = {e.event_id for e in before + after}

        async def all_read() -> bool:
            return set(seen) >= published

        await wait_for(all_read, 60, "the consumer to read every event")
        stop.set()
        await asyncio.wait_for(reading, 10)

        info = await js.stream_info(stream)
        assert (await placement(js, stream)).leader not in (None, leader)  # a new leader took over
        # nothing lost, nothing stored twice (publish retries are deduplicated by event id)
        assert set(seen) == published
        assert info.state.messages == len(published)
        # the terminal claim (KV, 3 replicas) works on the two survivors
        kv = await terminal.open_bucket(conductor.jetstream(), NS, REPLICAS)
        assert await terminal.claim(kv, "after-0", "completed", "e-after-0")
        assert await terminal.ended(kv, "after-0") == "completed"

        # the killed node comes back with its store and catches up
        killed.process.spawn()

        async def caught_up() -> bool:
            replicas = (await placement(js, stream)).replicas or []
            peer = next((r for r in replicas if r.name == leader), None)
            return bool(peer and peer.current and not peer.offline)

        await wait_for(caught_up, 60, f"{leader} to catch up")
        print(f"publishing resumed {publish_recovery_s:.1f}s after the leader was killed")
    finally:
        await conductor.close()
        await recorder.close()


PIPELINE = (
    ("store-master", "store-master-0"),
    ("conductor", "conductor-0"),
    ("prefill", "prefill-0"),
    ("decode", "decode-0"),
)


def pipeline_env(cluster: Cluster, role: str) -> dict[str, str]:
    return {
        "MOONCAKE_NATS_USER": role,
        "MOONCAKE_NATS_PASSWORD": PASSWORDS[role],
        "MOONCAKE_BUS__REPLICAS": str(REPLICAS),
        "MOONCAKE_BUS__ACK_WAIT_S": "3",
        "MOONCAKE_BLOCK_TOKENS": "16",
        "MOONCAKE_ENGINE__MODEL": "dummy",
        "MOONCAKE_ENGINE__THREADS": "1",
        "MOONCAKE_STORE__SECRET": "e2e-cluster",
        "MOONCAKE_STORE__DRAM_BYTES": str(32 << 20),
        "MOONCAKE_STORE__TRANSPORTS": '["shm", "tcp"]',
    }


async def ask_all(
    nc: NATS, prompts: list[list[int]], tag: str, timeout_s: float = 30
) -> list[Answer]:
    return list(
        await asyncio.gather(
            *(
                ask(
                    nc,
                    token_ids=p,
                    ns=NS,
                    request_id=f"{tag}-{i}-{uuid.uuid4().hex[:6]}",
                    params=ev.SamplingParams(max_tokens=6),
                    timeout_s=timeout_s,
                )
                for i, p in enumerate(prompts)
            )
        )
    )


async def stored_copy(js: JetStreamContext, request_id: str) -> tuple[dict[int, int], bool]:
    """A request's replayable copy on MC_TOKENS: its tokens by index, and whether it holds
    the final chunk."""
    tokens: dict[int, int] = {}
    done = False
    async for chunk in resume_tokens(js, NS, request_id, 0, idle_timeout_s=5):
        done = done or chunk.done
        for k, token in enumerate(chunk.token_ids):
            tokens.setdefault(chunk.index + k, token)
    return tokens, done


def copy_broken(
    want: list[int], live: dict[int, int], copy: dict[int, int], done: bool
) -> list[str]:
    """What breaks the promise for one request's tokens: a token its client holds live or
    its copy holds that is not the engine's, a token the copy lacks, a copy without its
    final chunk."""
    found = []
    for what, held in (("live", live), ("copied", copy)):
        for i, t in sorted(held.items()):
            if i >= len(want) or want[i] != t:
                found.append(f"{what} token {i} is {t}, not {want[i] if i < len(want) else '-'}")
    if lacks := sorted(set(range(len(want))) - set(copy)):
        found.append(f"the copy lacks tokens {lacks}")
    if not done:
        found.append("the copy has no final chunk")
    return found


def test_the_copy_check_goes_red_for_a_dropped_token_and_a_lost_ending() -> None:
    """The companion of the test below: a whole copy passes, and a token dropped from it,
    its final chunk lost, or a wrong token (live or copied) each fails it."""
    want = [5, 9, 2, 7]
    whole = dict(enumerate(want))
    assert copy_broken(want, {0: 5, 2: 2}, whole, True) == []
    assert copy_broken(want, {}, {0: 5, 1: 9, 3: 7}, True) == ["the copy lacks tokens [2]"]
    assert copy_broken(want, {}, whole, False) == ["the copy has no final chunk"]
    assert copy_broken(want, {1: 8}, {**whole, 4: 1}, True) == [
        "live token 1 is 8, not 9",
        "copied token 4 is 1, not -",
    ]


async def terminal_events(js: JetStreamContext) -> dict[str, list[ev.Event]]:
    """Every request's terminal events, as the durable record (MC_REQ) holds them."""
    ended: dict[str, list[ev.Event]] = {}
    # Creating the consumer is a JetStream API call: right after a node was killed it can
    # time out while the cluster elects a new meta leader (seen once in CI, under load).
    deadline = time.monotonic() + 60
    while True:
        try:
            sub = await js.subscribe(NS.subject("mc.req.>"), ordered_consumer=True)
            break
        except nats.errors.TimeoutError:
            assert time.monotonic() < deadline, "no consumer on MC_REQ within 60 s"
            await asyncio.sleep(1.0)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                return ended
            event = ev.parse_event(msg.data)
            if isinstance(event, ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled):
                ended.setdefault(event.request_id, []).append(event)
    finally:
        await sub.unsubscribe()


@pytest.mark.timeout(240)
async def test_pipeline_serves_through_losing_a_broker_node(
    cluster: Cluster, admin: NATS, tmp_path: Path
) -> None:
    settings = cluster.settings(
        "admin", block_tokens=16, engine=EngineSettings(model="dummy"), data_dir=tmp_path / "d"
    )
    workers = [
        Worker(role, settings, tmp_path / "logs", name=name, env=pipeline_env(cluster, role))
        for role, name in PIPELINE
    ]
    for w in workers:
        w.start()
    client = await connect(cluster.settings("gateway"), "test-gateway")
    try:
        deadline = time.monotonic() + 120
        while not (await ask(client, token_ids=[1, 2, 3], ns=NS, timeout_s=4)).finished:
            assert time.monotonic() < deadline, "the pipeline never answered"
            await asyncio.sleep(0.5)

        engine = build_engine(settings)

        def expected(tokens: list[int]) -> list[int]:
            return generate(engine, [tokens], [EngineParams(max_tokens=6)])[0].tokens

        prompts = [[(11 * i + k) % 500 for k in range(20 + i)] for i in range(8)]
        first = await ask_all(client, prompts[:3], "before")
        # kill -9 the node that leads the work queue, with requests in flight
        leader = (await placement(admin.jetstream(), NS.stream("MC_WORK"))).leader
        assert leader is not None
        in_flight = asyncio.create_task(ask_all(client, prompts[3:], "during"))
        await asyncio.sleep(0.2)
        cluster.node(leader).process.kill()
        rest = await in_flight
        for prompt, out in zip(prompts[:3], first, strict=True):
            assert out.finished, (out.request_id, out.decision, out.finish_reason, out.error)
            assert out.token_ids == expected(prompt), out.request_id
        # Every request ends exactly once, completed with all its tokens (the record).
        ended = await terminal_events(admin.jetstream())
        for out in first + rest:
            (event,) = ended[out.request_id]
            assert isinstance(event, ev.RequestCompleted), event
            assert event.output_tokens == 6, event
        # Live tokens are core NATS (at most once): a chunk in flight through the dead node
        # is gone, and the replayable copy (MC_TOKENS) is what a client reads such gaps back
        # from. So every request's copy holds all its tokens and its final chunk, and every
        # token a client holds live is the right one.
        broken = {}
        for prompt, out in zip(prompts[3:], rest, strict=True):
            copy, done = await stored_copy(admin.jetstream(), out.request_id)
            if found := copy_broken(expected(prompt), out.tokens, copy, done):
                broken[out.request_id] = found
        assert not broken, (broken, {w.name: w.log()[-3000:] for w in workers})
        for w in workers:  # every worker rode through it
            assert w.proc is not None and w.proc.poll() is None, w.log()[-3000:]
    finally:
        await client.close()
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.stop()
