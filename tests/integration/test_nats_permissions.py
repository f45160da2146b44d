"""deploy/nats/auth.conf, enforced by a real nats-server: each role can do what the code
needs and nothing the security model forbids.

The server runs deploy/nats/nats.conf itself (only port, monitor port and store dir come
from the command line, as they do in compose), with test passwords in its environment. The
subjects come from the code's own constructors (event SUBJECTs, WorkSubjects, the store's
Subjects, the workers' consumer specs), so a subject renamed in the code without the config
following breaks a test here rather than a deployment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from mooncake import events as ev
from mooncake.bus import terminal
from mooncake.bus.connection import (
    NatsRefusedError,
    StreamSetupError,
    auth_options,
    connect,
    ensure_streams,
)
from mooncake.bus.consume import ACK, Delivery, Outcome, PullConsumer, per_message
from mooncake.bus.publish import MSG_ID, Publisher
from mooncake.client import Outcome as Answer
from mooncake.client import ReadBackRefused, read_back, submit
from mooncake.config import BusSettings, Settings
from mooncake.services import ManagedProcess, free_port, nats_server_binary, tcp_reachable
from mooncake.serving.conductor_reaper import work_consumer
from mooncake.serving.streaming import TokenStreamer
from mooncake.serving.token_readback import TokenReadBack
from mooncake.store.protocol import Subjects as StoreSubjects
from mooncake.work import DecodeWork, PrefillWork, Timing, TokenChunk, WorkSubjects
from workers.conductor import SUBMITTED
from workers.recorder import EVENT_CONSUMERS

from helpers import NATS_DEPLOY as DEPLOY
from helpers import NATS_ROLES as ROLES
from helpers import wait_for

pytestmark = pytest.mark.integration

PASSWORDS = {role: f"test-{role}-{uuid.uuid4().hex[:12]}" for role in ROLES}
NS = ev.Namespace()  # auth.conf is written for the default namespace
WORK = WorkSubjects(NS)
STORE = StoreSubjects(NS)


def password_env(passwords: dict[str, str]) -> dict[str, str]:
    env = {f"NATS_{r.upper().replace('-', '_')}_PASSWORD": p for r, p in passwords.items()}
    env["NATS_ROUTE_PASSWORD"] = "test-route"
    return env


def start_server(
    conf: Path, tmp: Path, extra_env: dict[str, str] | None = None
) -> tuple[ManagedProcess, str]:
    port, monitor = free_port(), free_port()
    argv = [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)]
    argv += ["-m", str(monitor), "-sd", str(tmp / "jetstream")]
    env = {"PATH": os.environ.get("PATH", "")} | password_env(PASSWORDS) | (extra_env or {})
    server = ManagedProcess("nats", argv, tmp / "nats.log", port, env=env)
    server.spawn()
    deadline = time.monotonic() + 20
    while not tcp_reachable("127.0.0.1", port):
        assert server.running, (tmp / "nats.log").read_text()
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.05)
    return server, f"nats://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_server(DEPLOY / "nats.conf", tmp_path_factory.mktemp("nats-auth"))
    try:
        yield url
    finally:
        server.stop()


def role_settings(
    url: str, role: str | None, password: str | None = None, **kw: object
) -> Settings:
    """Settings as a worker of `role` gets them (nothing read from dotenv files)."""
    values: dict[str, Any] = {
        "nats_url": url,
        "nats_user": role,
        "nats_password": password if password is not None else PASSWORDS.get(role or ""),
        "nats_password_file": None,
        "nats_token": None,
        "nats_creds": None,
        "nats_inbox_prefix": None,
        "nats_tls_ca": None,
        "nats_tls_cert": None,
        "nats_tls_key": None,
        "namespace": NS.prefix,
    }
    return Settings(_env_file=None, **(values | kw))


async def as_role(url: str, role: str) -> NATS:
    return await connect(role_settings(url, role), f"test-{role}")


@pytest_asyncio.fixture
async def admin(broker: str) -> AsyncIterator[NATS]:
    nc = await as_role(broker, "admin")
    await ensure_streams(nc.jetstream(), role_settings(broker, "admin"))
    try:
        yield nc
    finally:
        await nc.close()


async def permission_error(nc: NATS, subject: str, within_s: float = 3.0) -> str:
    """The permissions violation the server reported to this connection for `subject`."""
    deadline = time.monotonic() + within_s
    err = ""
    while time.monotonic() < deadline:
        # nats-py reports the server's -ERR lower-cased
        err = str(nc.last_error or "").lower()
        if "permissions violation" in err and subject.lower() in err:
            return err
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {subject!r}; last error {err!r}")


async def stored(nc: NATS, stream: str, subject: str) -> bytes | None:
    """The last message a stream holds on `subject`, read as admin; None if there is none."""
    try:
        msg = await nc.jetstream().get_last_msg(NS.stream(stream), subject)
    except NotFoundError:
        return None
    return msg.data


def admitted(request_id: str) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=request_id, policy="none", prefill_instance="p0", decode_instance="d0"
    )


def decode_work(request_id: str, reply_to: str | None = None) -> DecodeWork:
    return DecodeWork(
        request_id=request_id,
        token_ids=[1, 2, 3],
        first_token_id=4,
        prefill_instance="p0",
        decode_instance="d0",
        reply_to=reply_to,
        timing=Timing(submitted_at=time.time()),
        first_token_at=time.time(),
        admitted_event_id=f"adm-{request_id}",
    )


# --- who may connect ----------------------------------------------------------------------


async def test_a_client_without_credentials_cannot_connect(broker: str) -> None:
    with pytest.raises(NatsRefusedError, match="no credentials"):
        await asyncio.wait_for(connect(role_settings(broker, None), "anon"), 10)


async def test_a_wrong_password_cannot_connect(broker: str) -> None:
    with pytest.raises(NatsRefusedError, match="decode"):
        await asyncio.wait_for(connect(role_settings(broker, "decode", "guessed"), "x"), 10)


async def test_the_password_can_come_from_a_file(broker: str, tmp_path: Path) -> None:
    secret = tmp_path / "decode.password"
    secret.write_text(PASSWORDS["decode"] + "\n")  # as a docker secret file may end
    s = role_settings(broker, "decode", None, nats_password=None, nats_password_file=secret)
    nc = await connect(s, "from-file")
    try:
        assert nc.is_connected
    finally:
        await nc.close()


def test_a_password_needs_a_user() -> None:
    with pytest.raises(ValueError, match="needs a user"):
        auth_options(role_settings("nats://127.0.0.1:1", None, "orphan"))


def test_inboxes_follow_the_user_unless_set() -> None:
    url = "nats://127.0.0.1:1"
    assert auth_options(role_settings(url, "decode"))["inbox_prefix"] == "_INBOX.decode"
    assert auth_options(role_settings(url, None))["inbox_prefix"] == "_INBOX"
    custom = role_settings(url, "gateway", nats_inbox_prefix="_INBOX.gateway.eu")
    assert auth_options(custom)["inbox_prefix"] == "_INBOX.gateway.eu"


# --- admissions: only the conductor -------------------------------------------------------


async def test_decode_cannot_publish_an_admission(broker: str, admin: NATS) -> None:
    nc = await as_role(broker, "decode")
    try:
        publisher = Publisher(nc, nc.jetstream(), NS, timeout_s=1.0, give_up_s=1.0)
        forged = admitted("forged-by-decode")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await publisher.publish(forged)
        await permission_error(nc, NS.of(ev.RequestAdmitted))
        # Nor with core NATS (no ack awaited): the stream never sees it.
        await nc.publish(NS.of(ev.RequestAdmitted), forged.to_json())
        await nc.flush()
        assert await stored(admin, "MC_REQ", NS.of(ev.RequestAdmitted)) is None
        # Nor can it hand out work or forge a submission.
        for subject in (WORK.prefill("p0"), WORK.decode("d0"), NS.of(ev.RequestSubmitted)):
            await nc.publish(subject, b"{}")
            await permission_error(nc, subject)
    finally:
        await nc.close()


async def test_conductor_publishes_admissions_and_prefill_work(broker: str, admin: NATS) -> None:
    nc = await as_role(broker, "conductor")
    try:
        js = nc.jetstream()
        await ensure_streams(js, role_settings(broker, "conductor"))
        event = admitted("admitted-by-conductor")
        ack = await Publisher(nc, js, NS).publish(event)
        assert ack.stream == NS.stream("MC_REQ")
        work = PrefillWork(
            request_id=event.request_id,
            token_ids=[1, 2],
            prefill_instance="p0",
            decode_instance="d0",
            timing=Timing(submitted_at=time.time()),
            admitted_event_id=event.event_id,
        )
        await js.publish(WORK.prefill("p0"), work.to_json(), headers={MSG_ID: "w-p0-1"})
        assert nc.last_error is None
        assert (
            json.loads(await stored(admin, "MC_REQ", NS.of(ev.RequestAdmitted)) or b"")[
                "request_id"
            ]
            == event.request_id
        )
        assert await stored(admin, "MC_WORK", WORK.prefill("p0")) == work.to_json()
    finally:
        await nc.close()


# --- the pipeline's own flows, each as its role -------------------------------------------


async def test_prefill_hands_work_to_decode_which_consumes_claims_and_streams(
    broker: str, admin: NATS
) -> None:
    prefill = await as_role(broker, "prefill")
    decode = await as_role(broker, "decode")
    gateway = await as_role(broker, "gateway")
    try:
        reply_inbox = gateway.new_inbox()
        replies = await gateway.subscribe(reply_inbox)
        rid = f"flow-{uuid.uuid4().hex[:8]}"
        # prefill: its facts, and DecodeWork for the chosen decode instance
        pub = Publisher(prefill, prefill.jetstream(), NS)
        await pub.publish(ev.RequestPrefilled(request_id=rid, instance="p0", prompt_tokens=3))
        await pub.publish_raw(WORK.decode("d0"), decode_work(rid, reply_inbox).to_json(), {})
        await prefill.publish(WORK.load("p0"), b"{}")
        # decode: its durable work consumer, the terminal claim, tokens live and stored
        djs = decode.jetstream()
        await ensure_streams(djs, role_settings(broker, "decode"))
        kv = await terminal.open_bucket(djs, NS)
        got: list[DecodeWork] = []
        stop = asyncio.Event()

        async def handle(d: Delivery) -> Outcome:
            work = DecodeWork.model_validate_json(d.data)
            await d.in_progress()  # a heartbeat, then the ack: two replies to one delivery
            assert await terminal.claim(kv, work.request_id, "completed", "e1")
            chunk = TokenChunk(request_id=work.request_id, index=1, token_ids=[7], done=True)
            assert work.reply_to is not None
            await decode.publish(work.reply_to, chunk.to_json())
            await djs.publish(WORK.tokens(work.request_id), chunk.to_json())
            await Publisher(decode, djs, NS).publish(
                ev.RequestCompleted(request_id=work.request_id, output_tokens=2)
            )
            got.append(work)
            stop.set()
            return ACK

        consumer = PullConsumer(decode, djs, work_consumer("decode", "d0"), BusSettings(), NS)
        await asyncio.wait_for(consumer.run(per_message(handle, "decode"), stop), 15)
        assert [w.request_id for w in got] == [rid]
        reply = await replies.next_msg(timeout=5)
        assert TokenChunk.model_validate_json(reply.data).done
        assert await stored(admin, "MC_TOKENS", WORK.tokens(rid)) is not None
        assert await terminal.ended(kv, rid) == "completed"

        async def acked() -> bool:  # on a work queue: the message is gone once acked
            info = await admin.jetstream().consumer_info(NS.stream("MC_WORK"), "decode-d0")
            return bool(info.num_ack_pending == 0 and info.num_pending == 0)

        await wait_for(acked, 5, "decode's ack")
        for nc in (prefill, decode, gateway):
            assert nc.last_error is None, nc.last_error
    finally:
        for nc in (prefill, decode, gateway):
            await nc.close()


async def test_gateway_submits_and_hears_back_on_its_own_inbox(broker: str, admin: NATS) -> None:
    gateway, conductor = await as_role(broker, "gateway"), await as_role(broker, "conductor")
    try:
        cjs = conductor.jetstream()
        stop = asyncio.Event()

        async def admit(d: Delivery) -> Outcome:  # the conductor's consumer, its reply
            request = ev.parse_event(d.data, subject=NS.canonical(d.subject))
            assert isinstance(request, ev.RequestSubmitted) and request.reply_to
            rejected = ev.RequestRejected(request_id=request.request_id, reason="no_instance")
            await conductor.publish(request.reply_to, rejected.to_json())
            stop.set()
            return ACK

        consumer = PullConsumer(conductor, cjs, SUBMITTED, BusSettings(), NS)
        task = asyncio.create_task(consumer.run(per_message(admit, "conductor"), stop))
        await ensure_streams(gateway.jetstream(), role_settings(broker, "gateway"))
        assert gateway.new_inbox().startswith("_INBOX.gateway.")
        replies = [b async for b in submit(gateway, "hello", ns=NS, timeout_s=15)]
        await asyncio.wait_for(task, 5)
        assert [r["type"] for r in replies] == ["request.rejected"]
        assert gateway.last_error is None, gateway.last_error
    finally:
        await gateway.close()
        await conductor.close()


async def test_recorder_reads_what_it_records(broker: str, admin: NATS) -> None:
    nc = await as_role(broker, "recorder")
    try:
        js = nc.jetstream()
        rid = f"rec-{uuid.uuid4().hex[:8]}"
        await Publisher(admin, admin.jetstream(), NS).publish(ev.RequestCancelled(request_id=rid))
        seen: list[str] = []
        stop = asyncio.Event()

        async def record(d: Delivery) -> Outcome:
            seen.append(d.subject)
            if rid.encode() in d.data:
                stop.set()
            return ACK

        spec = EVENT_CONSUMERS[0]
        assert spec.stream == "MC_REQ"
        consumer = PullConsumer(nc, js, spec, BusSettings(), NS)
        await asyncio.wait_for(consumer.run(per_message(record, "recorder"), stop), 15)
        assert NS.of(ev.RequestCancelled) in seen
        assert nc.last_error is None, nc.last_error
    finally:
        await nc.close()


async def test_store_control_plane_request_reply(broker: str, admin: NATS) -> None:
    master, node = await as_role(broker, "store-master"), await as_role(broker, "store-node")
    try:

        async def answer(msg: Msg) -> None:
            await msg.respond(b'{"refused": null}')

        await master.subscribe(STORE.master("heartbeat"), cb=answer)
        await node.subscribe(STORE.node("n0", "move"), cb=answer)
        await node.subscribe(STORE.kv_snapshot("n0"), cb=answer)
        await master.flush()
        await node.flush()
        # node -> master, master -> node: both answered under allow_responses
        assert (await node.request(STORE.master("heartbeat"), b"{}", timeout=3)).data
        assert (await master.request(STORE.node("n0", "move"), b"{}", timeout=3)).data
        await master.publish(STORE.node("n0", "changes"), b"{}")
        await node.publish(STORE.kv_events("n0"), b"{}")
        # a (re)started master asks every node to mount again
        hello: asyncio.Queue[bytes] = asyncio.Queue()

        async def heard(msg: Msg) -> None:
            await hello.put(msg.data)

        await node.subscribe(STORE.master_hello(), cb=heard)
        await node.flush()
        await master.publish(STORE.master_hello(), b"{}")
        assert await asyncio.wait_for(hello.get(), 3) == b"{}"
        conductor = await as_role(broker, "conductor")
        try:
            assert (await conductor.request(STORE.kv_snapshot("n0"), b"", timeout=3)).data
        finally:
            await conductor.close()
        await master.flush()
        await node.flush()
        assert master.last_error is None and node.last_error is None
        # a store node may not journal kv facts (the master does)
        await node.publish(NS.subject("mc.meta.kv.stored"), b"{}")
        await permission_error(node, NS.subject("mc.meta.kv.stored"))
    finally:
        await master.close()
        await node.close()


# --- the gateway: submit, and read its own replies only -----------------------------------


async def test_gateway_cannot_read_other_replies_or_token_streams(broker: str, admin: NATS) -> None:
    gateway, decode = await as_role(broker, "gateway"), await as_role(broker, "decode")
    try:
        other_inbox = admin.new_inbox()  # another client's reply subject
        rid = "someone-elses-request"
        for subject in (other_inbox, "_INBOX.>", WORK.tokens(rid), NS.subject("mc.tokens.>")):
            sub = await gateway.subscribe(subject)
            await gateway.flush()
            await permission_error(gateway, subject)
            # the decode worker streams to it: nothing reaches the gateway
            if "*" not in subject and ">" not in subject:
                await decode.publish(subject, b"secret tokens")
                await decode.flush()
                with pytest.raises(nats.errors.TimeoutError):
                    await sub.next_msg(timeout=0.3)
        # nor read the stored copy through a JetStream consumer
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await gateway.jetstream().subscribe(
                WORK.tokens(rid), ordered_consumer=True, config=None
            )
    finally:
        await gateway.close()
        await decode.close()


async def test_gateway_reads_back_its_own_tokens_through_the_conductor(
    broker: str, admin: NATS
) -> None:
    """The read-back service runs as the conductor user (ordered consumers on MC_TOKENS);
    the gateway, which may not read that stream, gets its own request's tokens from it and
    nothing of another client's request."""
    gateway, conductor = await as_role(broker, "gateway"), await as_role(broker, "conductor")
    decode = await as_role(broker, "decode")
    service = TokenReadBack(conductor, conductor.jetstream(), NS)
    await service.start()
    try:
        streamer = TokenStreamer(decode, decode.jetstream(), NS, instance="d0")
        ours, theirs = gateway.new_inbox(), admin.new_inbox()
        for rid, inbox in (("gw-own", ours), ("someone-elses", theirs)):
            streamer.open(rid, inbox)
            await streamer.emit(TokenChunk(request_id=rid, index=0, token_ids=[5], text="a"))
            await streamer.close(TokenChunk(request_id=rid, index=1, done=True,
                                            finish_reason="stop"))  # fmt: skip
        out = Answer("gw-own", reply_to=ours)
        await read_back(gateway, NS, out, within_s=5)
        assert out.token_ids == [5] and out.finished
        with pytest.raises(ReadBackRefused):
            await read_back(gateway, NS, Answer("someone-elses", reply_to=ours), within_s=5)
        for nc in (gateway, conductor, decode):
            await nc.flush()
            assert nc.last_error is None, nc.last_error
    finally:
        await service.stop()
        for nc in (gateway, conductor, decode):
            await nc.close()


async def test_gateway_cannot_state_facts_or_touch_streams(broker: str, admin: NATS) -> None:
    gateway = await as_role(broker, "gateway")
    try:
        for subject in (NS.of(ev.RequestAdmitted), NS.of(ev.RequestCompleted), WORK.prefill("p0")):
            await gateway.publish(subject, b"{}")
            await permission_error(gateway, subject)
        delete = f"$JS.API.STREAM.DELETE.{NS.stream('MC_REQ')}"
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await gateway.request(delete, b"", timeout=1)
        await permission_error(gateway, delete)
        assert (await admin.jetstream().stream_info(NS.stream("MC_REQ"))).config.name
    finally:
        await gateway.close()


async def test_only_admin_changes_streams(broker: str, admin: NATS) -> None:
    """Every role may create a missing stream (so start order does not matter), none but
    admin may update, purge or delete one."""
    nc = await as_role(broker, "decode")
    try:
        stream = NS.stream("MC_TOKENS")
        for op in ("UPDATE", "PURGE", "DELETE"):
            subject = f"$JS.API.STREAM.{op}.{stream}"
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request(subject, json.dumps({"name": stream}).encode(), timeout=1)
            await permission_error(nc, subject)
    finally:
        await nc.close()


async def test_gateway_cannot_create_missing_streams(tmp_path: Path) -> None:
    """On an empty broker the gateway fails with a clear error rather than making streams."""
    server, url = start_server(DEPLOY / "nats.conf", tmp_path)
    try:
        nc = await as_role(url, "gateway")
        try:
            with pytest.raises(StreamSetupError, match=r"STREAM\.CREATE"):
                await ensure_streams(nc.jetstream(), role_settings(url, "gateway"))
        finally:
            await nc.close()
    finally:
        server.stop()


# --- TLS ----------------------------------------------------------------------------------


def make_certs(out: Path) -> dict[str, Path]:
    """The dev CA and server certificate deploy/nats/make-dev-certs.sh makes (compose's TLS
    switch uses the same script), valid for localhost and 127.0.0.1 too."""
    script = DEPLOY / "make-dev-certs.sh"
    subprocess.run(["sh", str(script), str(out)], check=True, capture_output=True, timeout=120)
    return {"ca": out / "ca.pem", "cert": out / "server.pem", "key": out / "server-key.pem"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
async def test_tls_config_switch(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    env = {
        "NATS_TLS_CERT": str(certs["cert"]),
        "NATS_TLS_KEY": str(certs["key"]),
        "NATS_TLS_CA": str(certs["ca"]),
    }
    server, url = start_server(DEPLOY / "tls.conf", tmp_path, env)
    try:
        # with the CA: connected over TLS, as a role, with its permissions
        nc = await connect(role_settings(url, "decode", nats_tls_ca=certs["ca"]), "tls")
        try:
            assert nc.is_connected
            await nc.publish(NS.of(ev.RequestAdmitted), b"{}")
            await permission_error(nc, NS.of(ev.RequestAdmitted))
        finally:
            await nc.close()
        # without our CA the server's certificate does not verify: refused, at once
        with pytest.raises(NatsRefusedError, match="certificate verify failed"):
            await asyncio.wait_for(connect(role_settings(url, "decode"), "no-ca"), 10)
    finally:
        server.stop()


def test_every_role_has_a_user() -> None:
    text = (DEPLOY / "auth.conf").read_text()
    for role in ROLES:
        assert f"user: {role}\n" in text, role
        assert f"$NATS_{role.upper().replace('-', '_')}_PASSWORD" in text, role


async def test_engine_tiers_and_preemptions_under_the_role_permissions(
    broker: str, admin: NATS
) -> None:
    """Prefill and decode announce their engine tier and answer its snapshot requests; the
    Conductor hears both and asks; decode records its preemptions; the Conductor cannot
    announce a worker's engine tier."""
    conductor = await as_role(broker, "conductor")
    workers = {role: await as_role(broker, role) for role in ("prefill", "decode")}
    try:
        heard: list[str] = []

        async def hear(msg: Msg) -> None:
            heard.append(msg.subject)

        await conductor.subscribe(STORE.engine_kv_events(), cb=hear)
        await conductor.flush()
        for role, nc in workers.items():

            async def answer(msg: Msg) -> None:
                await msg.respond(b'{"keys": []}')

            await nc.subscribe(STORE.engine_kv_snapshot(f"{role}-0"), cb=answer)
            await nc.flush()
            await nc.publish(STORE.engine_kv_events(f"{role}-0"), b"{}")
            await nc.flush()
            reply = await conductor.request(STORE.engine_kv_snapshot(f"{role}-0"), b"", timeout=3)
            assert reply.data
        await wait_for_true(lambda: len(heard) == 2)
        decode = workers["decode"]
        js = decode.jetstream()
        for event in (
            ev.DecodePreempted(request_id="r-p", instance="d0"),
            ev.DecodeResumed(request_id="r-p", instance="d0"),
            ev.DecodeStopped(request_id="r-p", instance="d0", reason="client", output_tokens=2),
            ev.TokensNotStored(request_id="r-p", instance="d0", first_index=0, last_index=1),
        ):
            await js.publish(NS.of(type(event)), event.to_json())
        assert decode.last_error is None and conductor.last_error is None
        # the Conductor may not state a worker's engine tier
        await conductor.publish(STORE.engine_kv_events("prefill-0"), b"{}")
        await permission_error(conductor, STORE.engine_kv_events("prefill-0"))
    finally:
        await conductor.close()
        for nc in workers.values():
            await nc.close()


async def test_the_conductor_answers_its_kv_index_states(broker: str, admin: NATS) -> None:
    """The Conductor serves `mc.kv.index.state` (its live feed); admin (`mooncake up`) asks."""
    conductor = await as_role(broker, "conductor")
    try:

        async def answer(msg: Msg) -> None:
            await msg.respond(b'{"at": 0}')

        await conductor.subscribe(STORE.kv_index_state(), cb=answer)
        await conductor.flush()
        assert (await admin.request(STORE.kv_index_state(), b"", timeout=3)).data
        assert conductor.last_error is None
    finally:
        await conductor.close()


async def wait_for_true(check: Callable[[], bool], within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


async def test_prefill_instances_meet_as_cpp_groups(broker: str, admin: NATS) -> None:
    """A CPP stage asks its group's leader over `mc.cpp.<leader>` and the leader answers
    (serving/cpp_group.py); the decode role may not ask."""
    leader, member = await as_role(broker, "prefill"), await as_role(broker, "prefill")
    decode = await as_role(broker, "decode")
    try:

        async def answer(msg: Msg) -> None:
            await msg.respond(b'{"state": "wait"}')

        await leader.subscribe(WORK.cpp("p0"), cb=answer)
        await leader.flush()
        reply = await member.request(WORK.cpp("p0"), b"{}", timeout=3)
        assert reply.data == b'{"state": "wait"}'
        assert leader.last_error is None and member.last_error is None
        await decode.publish(WORK.cpp("p0"), b"{}")
        await permission_error(decode, WORK.cpp("p0"))
    finally:
        for nc in (leader, member, decode):
            await nc.close()
