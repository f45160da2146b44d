"""Hostile and careless use of a running stack: one client floods, secrets must stay secret.

One stack for the module, as production runs it: its own nats-server on the project's
config (deploy/nats/nats.conf: one user per role, each worker with its role's password), a
throwaway database reached with a password, a store secret, and recorder, store master,
Conductor, one prefill and one decode worker (dummy model) and the gateway, all logging at
DEBUG.

- Per-client limits: a client flooding the gateway gets its burst, then 429
  `client_rate_limited` with `Retry-After`, while other clients (another API key, or no key)
  are served; a client flooding `mc.req.submitted` directly gets its burst admitted and the
  rest rejected by the Conductor with reason `client_rate_limited`, recorded like any
  rejection, while another named client is admitted.
- Secrets: no store secret, NATS password, database password or API key appears in any
  worker's log, the broker's log, the gateway's /metrics, or any table of the record (with
  positive controls: the scans do find what they must find); a recorder whose database is
  down logs that, without the password.

Covered elsewhere, not repeated here: a store segment cannot be read or written without the
secret (tests/unit/store/test_tcp_security.py: HMAC handshake, tampered frames, replay);
without its credentials a NATS client cannot subscribe to another request's tokens or
publish admissions (tests/integration/test_nats_permissions.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from pydantic import SecretStr

from mooncake import events as ev
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.db.engine import upgrade
from mooncake.services import ManagedProcess, free_port, nats_server_binary, tcp_reachable

from helpers import Worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
ROLES = ("admin", "recorder", "conductor", "prefill", "decode", "store-master", "store-node",
         "gateway")  # fmt: skip
LAYOUT = (("recorder", "recorder-0"), ("store-master", "store-master-0"),
          ("conductor", "conductor-0"), ("prefill", "prefill-0"), ("decode", "decode-0"),
          ("gateway", "gateway-0"))  # fmt: skip
MODEL = "smollm2-135m-instruct"  # Settings.model_id: what the gateway serves
GATEWAY_LIMIT = (2.0, 4)  # requests/s, burst per client at the gateway
CONDUCTOR_LIMIT = (3.0, 6)  # per named client at the Conductor


@dataclass
class Secrets:
    store: str
    nats: dict[str, str]
    db_password: str
    api_keys: dict[str, str]

    def all(self) -> dict[str, str]:
        named = {"store secret": self.store, "database password": self.db_password}
        named |= {f"NATS password of {r}": p for r, p in self.nats.items()}
        named |= {f"API key {k}": v for k, v in self.api_keys.items()}
        return named


@dataclass
class Stack:
    secrets: Secrets
    nats_url: str
    database_url: str  # with the password
    admin: Settings
    workers: dict[str, Worker]
    gateway: str
    logs: Path
    nats_log: Path

    def role_settings(self, role: str) -> Settings:
        return self.admin.model_copy(
            update={"nats_user": role, "nats_password": SecretStr(self.secrets.nats[role])}
        )


def _url(url: str, database: str, *, password: str = "", host: str | None = None) -> str:
    """`url` (the test database's) for user postgres with `password` on `database`."""
    scheme, rest = url.split("://", 1)
    host = host or rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}://postgres{':' + password if password else ''}@{host}/{database}"


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="module")
def stack(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("hostile")
    s = Secrets(
        store=f"store-{secrets.token_hex(16)}",
        nats={r: f"nats-{r}-{secrets.token_hex(12)}" for r in ROLES},
        db_password=f"dbpw-{secrets.token_hex(12)}",
        api_keys={k: f"sk-{k}-{secrets.token_hex(16)}" for k in ("flood", "polite")},
    )
    # The broker: deploy/nats/nats.conf, passwords from its environment (as compose does).
    port = free_port()
    argv = [nats_server_binary(), "-c", str(DEPLOY / "nats.conf"), "-a", "127.0.0.1"]
    argv += ["-p", str(port), "-m", str(free_port()), "-sd", str(tmp / "jetstream")]
    env = {"PATH": os.environ.get("PATH", ""), "NATS_ROUTE_PASSWORD": "unused-route"}
    env |= {f"NATS_{r.upper().replace('-', '_')}_PASSWORD": p for r, p in s.nats.items()}
    broker = ManagedProcess("nats", argv, tmp / "nats.log", port, env=env)
    broker.spawn()
    deadline = time.monotonic() + 20
    while not tcp_reachable("127.0.0.1", port):
        assert broker.running and time.monotonic() < deadline, (tmp / "nats.log").read_text()
        time.sleep(0.05)
    # A database of our own on the test Postgres, reached with a password (the test server
    # trusts local connections, so it is not checked; it is configured all the same, which
    # is what a leak would need).
    name = f"mc_hostile_{uuid.uuid4().hex[:8]}"
    admin_dsn = _libpq(_url(database_url, "postgres"))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = _url(database_url, name, password=s.db_password)
    upgrade(db_url)
    admin = Settings(
        _env_file=None,  # type: ignore[call-arg]
        nats_url=f"nats://127.0.0.1:{port}",
        nats_user="admin",
        nats_password=s.nats["admin"],
        database_url=db_url,
        namespace="mc",  # auth.conf is written for the default namespace
        data_dir=tmp / "data",
    )
    asyncio.run(_streams(admin))
    gateway_port = free_port()
    common = {
        "MOONCAKE_LOG_LEVEL": "DEBUG",
        "MOONCAKE_BLOCK_TOKENS": "16",
        "MOONCAKE_ENGINE__MODEL": "dummy",
        "MOONCAKE_ENGINE__THREADS": "1",
        "MOONCAKE_STORE__SECRET": s.store,
        "MOONCAKE_STORE__DRAM_BYTES": str(32 << 20),
        "MOONCAKE_GATEWAY__PORT": str(gateway_port),
        "MOONCAKE_GATEWAY__CLIENT_RATE_PER_S": str(GATEWAY_LIMIT[0]),
        "MOONCAKE_GATEWAY__CLIENT_BURST": str(GATEWAY_LIMIT[1]),
        "MOONCAKE_CONDUCTOR__CLIENT_RATE_PER_S": str(CONDUCTOR_LIMIT[0]),
        "MOONCAKE_CONDUCTOR__CLIENT_BURST": str(CONDUCTOR_LIMIT[1]),
    }
    logs = tmp / "logs"
    workers = {}
    for role, wname in LAYOUT:
        env = common | {"MOONCAKE_NATS_USER": role, "MOONCAKE_NATS_PASSWORD": s.nats[role]}
        workers[wname] = Worker(role, admin, logs, name=wname, env=env).start()
    st = Stack(s, admin.nats_url, db_url, admin, workers, f"http://127.0.0.1:{gateway_port}",
               logs, tmp / "nats.log")  # fmt: skip
    try:
        asyncio.run(_ready(st))
        yield st
    finally:
        for w in workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.stop()
        broker.stop()
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _streams(admin: Settings) -> None:
    nc = await connect(admin, "test-admin")
    try:
        await ensure_streams(nc.jetstream(), admin)
    finally:
        await nc.close()


def _completion(tokens: list[int] | None = None) -> dict[str, Any]:
    return {"model": MODEL, "prompt": tokens or [5, 6, 7, 8], "max_tokens": 2}


async def _ready(st: Stack) -> None:
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(base_url=st.gateway, timeout=10) as http:
        while True:
            dead = [n for n, w in st.workers.items() if w.proc is None or w.proc.poll() is not None]
            assert not dead, {n: st.workers[n].log()[-3000:] for n in dead}
            try:
                r = await http.post("/v1/completions", json=_completion([1, 2, 3]))
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stack never answered through the gateway"
            await asyncio.sleep(1.0)


@pytest_asyncio.fixture
async def gateway_nc(stack: Stack) -> AsyncIterator[NATS]:
    nc = await connect(stack.role_settings("gateway"), "test-gateway")
    try:
        yield nc
    finally:
        await nc.close()


async def _rows(stack: Stack, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(_libpq(stack.database_url)) as conn:
        return list(await (await conn.execute(sql, params)).fetchall())


# --- per-client limits ---------------------------------------------------------------------------


async def test_a_flooding_client_gets_429_while_others_are_served(stack: Stack) -> None:
    keys = stack.secrets.api_keys
    rate, burst = GATEWAY_LIMIT

    async def post(http: httpx.AsyncClient, key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return await http.post("/v1/completions", json=_completion(), headers=headers)

    async with httpx.AsyncClient(base_url=stack.gateway, timeout=60) as http:
        started = time.monotonic()

        async def flood() -> list[httpx.Response]:
            out: list[httpx.Response] = []
            for _ in range(4):  # 4 waves of 15 at once, over ~1.5 s
                out += await asyncio.gather(*(post(http, keys["flood"]) for _ in range(15)))
                await asyncio.sleep(0.5)
            return out

        async def polite(key: str | None) -> list[httpx.Response]:
            out = []
            for _ in range(3):  # within any limit: one every 0.6 s
                out.append(await post(http, key))
                await asyncio.sleep(0.6)
            return out

        flooded, kind, anonymous = await asyncio.gather(
            flood(), polite(keys["polite"]), polite(None)
        )
        elapsed = time.monotonic() - started

    served = [r for r in flooded if r.status_code == 200]
    limited = [r for r in flooded if r.status_code == 429]
    print(
        f"gateway flood: {len(flooded)} sent in {elapsed:.2f} s, {len(served)} served, "
        f"{len(limited)} 429; others {[r.status_code for r in (*kind, *anonymous)]}"
    )
    assert len(served) + len(limited) == len(flooded), {r.status_code for r in flooded}
    assert 1 <= len(served) <= burst + rate * elapsed + 1, (len(served), elapsed)
    assert len(limited) >= len(flooded) - (burst + rate * elapsed + 1)
    for r in limited:
        err = r.json()["error"]
        assert err["code"] == "client_rate_limited" and err["type"] == "rate_limit_error", err
        assert int(r.headers["Retry-After"]) >= 1
    for r in (*kind, *anonymous):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")

    # The gateway named the client in each submission: by a digest of its key, never the key.
    flood_id = "key-" + hashlib.sha256(keys["flood"].encode()).hexdigest()[:32]
    rows = await _rows(
        stack, "SELECT count(*) FROM events WHERE type = 'request.submitted' "
        "AND payload->>'client_id' = %s", flood_id,
    )  # fmt: skip
    assert rows[0][0] == len(served)


async def test_a_bus_flood_is_rejected_per_client_by_the_conductor(
    stack: Stack, gateway_nc: NATS
) -> None:
    rate, burst = CONDUCTOR_LIMIT
    run = uuid.uuid4().hex[:6]
    greedy = [f"greedy-{run}-{i}" for i in range(30)]
    polite = [f"polite-{run}-{i}" for i in range(3)]

    def sub(rid: str, client: str) -> ev.RequestSubmitted:
        return ev.RequestSubmitted(
            request_id=rid, token_ids=[3, 1, 4, 1, 5], client_id=client,
            params=ev.SamplingParams(max_tokens=2),
        )  # fmt: skip

    batch = [sub(rid, "bus-greedy") for rid in greedy[:15]]
    batch += [sub(polite[0], "bus-polite")]
    batch += [sub(rid, "bus-greedy") for rid in greedy[15:]]
    batch += [sub(rid, "bus-polite") for rid in polite[1:]]
    started = time.monotonic()
    await Publisher(gateway_nc, gateway_nc.jetstream(), ev.Namespace()).publish_many(batch)
    ids = greedy + polite

    async def decided() -> bool:
        rows = await _rows(
            stack, "SELECT count(DISTINCT request_id) FROM events WHERE request_id = ANY(%s) "
            "AND type IN ('request.admitted', 'request.rejected')", ids,
        )  # fmt: skip
        return rows[0][0] == len(ids)

    await wait_for(decided, 60, "a decision for every submission")
    elapsed = time.monotonic() - started
    rows = await _rows(
        stack, "SELECT request_id, type, payload FROM events WHERE request_id = ANY(%s) "
        "AND type IN ('request.admitted', 'request.rejected')", ids,
    )  # fmt: skip
    decision = {rid: (type_, payload) for rid, type_, payload in rows}
    limited = [rid for rid in greedy if decision[rid][1].get("reason") == "client_rate_limited"]
    admitted = [rid for rid in greedy if decision[rid][0] == "request.admitted"]
    assert len(limited) + len(admitted) == len(greedy), decision
    print(
        f"bus flood: {len(greedy)} sent, {len(admitted)} admitted, {len(limited)} "
        f"client_rate_limited in {elapsed:.2f} s; polite {[decision[r][0] for r in polite]}"
    )
    assert burst <= len(admitted) <= burst + rate * elapsed + 1, (len(admitted), elapsed)
    assert set(greedy[:burst]) <= set(admitted)  # arrival order: the burst went first
    for rid in limited:
        payload = decision[rid][1]
        assert payload["stage"] == "ingress" and "bus-greedy" in payload["detail"]
        assert payload["inputs"]["retry_after_s"] > 0
    assert all(decision[rid][0] == "request.admitted" for rid in polite)
    status = await _rows(
        stack, "SELECT count(*) FROM requests WHERE request_id = ANY(%s) AND status = "
        "'rejected' AND reject_reason = 'client_rate_limited'", greedy,
    )  # fmt: skip
    assert status[0][0] == len(limited)  # recorded like any rejection


# --- secrets -------------------------------------------------------------------------------------


def _leaks(text: str, named: dict[str, str]) -> list[str]:
    return [what for what, value in named.items() if value in text]


async def test_no_secret_in_any_log_the_metrics_or_the_record(stack: Stack) -> None:
    named = stack.secrets.all()
    async with httpx.AsyncClient(base_url=stack.gateway, timeout=10) as http:
        # One more request with a key, so every path has seen one.
        headers = {"Authorization": f"Bearer {stack.secrets.api_keys['polite']}"}
        r = await http.post("/v1/completions", json=_completion(), headers=headers)
        assert r.status_code == 200, r.text
        metrics = (await http.get("/metrics")).text
    assert "mc_gateway_requests_total" in metrics  # the scan reads real metrics
    assert not _leaks(metrics, named)

    tables = [t for (t,) in await _rows(
        stack, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
    )]  # fmt: skip
    assert {"events", "requests", "instances", "dead_letters"} <= set(tables)
    dumped = []
    for table in tables:
        dumped += [row for (row,) in await _rows(stack, f'SELECT t::text FROM "{table}" t')]
    record = "\n".join(dumped)
    polite_id = "key-" + hashlib.sha256(stack.secrets.api_keys["polite"].encode()).hexdigest()
    assert polite_id[:36] in record  # the scan sees event payloads
    assert not _leaks(record, named), _leaks(record, named)

    await asyncio.sleep(1.0)  # the last log lines reach their files
    logs = {p.name: p.read_text(errors="replace") for p in stack.logs.glob("*.log")}
    assert set(logs) == {f"{name}.log" for name in stack.workers}
    assert "OpenAI-compatible API on" in logs["gateway-0.log"]  # the scan reads real logs
    assert all(" DEBUG " in text for text in logs.values()), "not logging at DEBUG"
    logs["nats-server"] = stack.nats_log.read_text(errors="replace")
    found = {name: _leaks(text, named) for name, text in logs.items()}
    assert not any(found.values()), found


async def test_a_recorder_whose_database_is_down_does_not_log_its_password(
    stack: Stack, tmp_path: Path
) -> None:
    """The likeliest leak: the error a database driver raises, logged as it is."""
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    dead = _url(stack.database_url, "mooncake", password=stack.secrets.db_password, host=closed)
    settings = stack.admin.model_copy(update={"database_url": dead})
    env = {"MOONCAKE_LOG_LEVEL": "DEBUG", "MOONCAKE_NATS_USER": "recorder",
           "MOONCAKE_NATS_PASSWORD": stack.secrets.nats["recorder"]}  # fmt: skip
    live = stack.workers["recorder-0"]
    live.stop()  # the new one takes over its durable consumers, as a restart would
    recorder = Worker("recorder", settings, tmp_path, name="recorder-dbdown", env=env).start()
    try:
        async with await connect(stack.role_settings("admin"), "test-admin") as nc:
            await Publisher(nc, nc.jetstream(), ev.Namespace()).publish(
                ev.RequestSubmitted(request_id=f"dbdown-{uuid.uuid4().hex[:6]}", prompt="x")
            )

        async def complained() -> bool:
            return "database unavailable" in recorder.log()

        await wait_for(complained, 60, "the recorder to report its database down")
    finally:
        recorder.stop()
    text = recorder.log()
    assert not _leaks(text, stack.secrets.all()), text[-2000:]
