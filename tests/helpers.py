"""Helpers shared by the integration and end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake.bench.record import TERMINAL
from mooncake.client import Outcome
from mooncake.config import Settings
from mooncake.core import cluster as cl
from mooncake.trace import SHIPPED_CONVERSATION, TRACE_NAMES, dump_line, load_trace, trace_path

# deploy/nats: the broker configs, and the users auth.conf defines (one per role).
NATS_DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "nats"
# The first 200 requests of the conversation trace, plain JSONL, shipped in the package.
TRACE_HEAD = SHIPPED_CONVERSATION


def cluster_view(prefill: int = 3, decode: int = 2) -> cl.ClusterView:
    """A core ClusterView with prefill instances p0.. and decode instances d0.. (unit tests)."""
    v = cl.ClusterView()
    for i in range(prefill):
        v.apply(cl.InstanceJoined(f"p{i}", "prefill"), 0.0)
    for i in range(decode):
        v.apply(cl.InstanceJoined(f"d{i}", "decode"), 0.0)
    return v


def trace_file(name: str = "conversation") -> Path:
    """The whole trace `name` as the package ships it (gzipped), whatever MOONCAKE_TRACES
    says: the tests' numbers do not depend on the machine's settings."""
    return trace_path(name)


def small_traces(directory: Path, requests: int) -> Path:
    """`directory` made a traces directory (`trace.traces_dir`) of the first `requests`
    requests of each shipped trace, plain JSONL: traces small enough for a quick run."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TRACE_NAMES:
        lines = [dump_line(r) + "\n" for r in load_trace(trace_path(name), limit=requests)]
        (directory / f"{name}_trace.jsonl").write_text("".join(lines))
    return directory


NATS_ROLES = (
    "admin",
    "recorder",
    "conductor",
    "prefill",
    "decode",
    "store-master",
    "store-node",
    "gateway",
)


def worker_env(settings: Settings) -> dict[str, str]:
    """Environment for a worker subprocess that runs against `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env.update(
        MOONCAKE_NATS_URL=settings.nats_url,
        MOONCAKE_DATABASE_URL=settings.database_url or "",
        MOONCAKE_NAMESPACE=settings.namespace,
        MOONCAKE_DATA_DIR=str(settings.data_dir),
        MOONCAKE_ADMISSION_POLICY=settings.admission_policy,
    )
    return env


class Worker:
    """A real worker process (`mooncake worker ROLE`), killable like in production."""

    def __init__(
        self,
        role: str,
        settings: Settings,
        log_dir: Path,
        name: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.role = role
        self.env = env or {}
        self.settings = settings
        self.name = name or f"{role}-0"
        self.log_path = log_dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mooncake.cli",
                    "worker",
                    self.role,
                    "--instance",
                    self.name,
                ],
                env=worker_env(self.settings) | self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextlib.contextmanager
def running_workers(
    layout: Sequence[tuple[str, str]], settings: Settings, log_dir: Path, env: dict[str, str]
) -> Iterator[dict[str, Worker]]:
    """The (role, name) workers of `layout` started; on the way out every one still running
    stopped, and none may have logged a traceback."""
    workers = {name: Worker(role, settings, log_dir, name=name, env=env) for role, name in layout}
    for w in workers.values():
        w.start()
    try:
        yield workers
    finally:
        for w in workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.stop()
        for name, w in workers.items():
            log = w.log()
            assert "Traceback" not in log, f"{name}:\n{log[-4000:]}"


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], within_s: float, what: str, interval: float = 0.2
) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within_s}s waiting for {what}")


async def scalar(engine: AsyncEngine, sql: str, **params: object) -> object:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


# --- judging a run against "nothing lost" ------------------------------------------------------


async def endings(db: AsyncEngine, ids: list[str]) -> dict[str, list[str]]:
    """Each request's terminal events in the record, by type."""
    async with db.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT request_id, type FROM events WHERE request_id = ANY(:ids) "
                    "AND type = ANY(:types) ORDER BY stream_seq"
                ),
                {"ids": ids, "types": list(TERMINAL)},
            )
        ).all()
    ended: dict[str, list[str]] = {}
    for rid, type_ in rows:
        ended.setdefault(rid, []).append(type_)
    return ended


def lost_or_broken(
    done: list[Outcome], ended: dict[str, list[str]], want: Callable[[str], list[int]]
) -> list[str]:
    """What breaks the promise in a replay's outcomes and its record: every request ends
    exactly once, completed with the engine's own answer (`want`) or rejected with a reason
    (its client hears that too), never failed, never twice, never not at all."""
    found = []
    for out in done:
        rid = out.request_id
        types = ended.get(rid, [])
        if not out.admitted:
            if not out.rejected_reason:
                found.append(f"{rid}: rejected without a reason")
            if types != ["request.rejected"]:
                found.append(f"{rid}: rejected, but the record ended it {types}")
            continue
        if out.finish_reason not in ("stop", "length"):
            found.append(f"{rid}: ended {out.finish_reason} ({out.error})")
        elif out.token_ids != want(rid):
            found.append(f"{rid}: answer differs from the engine's ({sorted(out.tokens)})")
        if types != ["request.completed"]:
            found.append(f"{rid}: the record ended it {types}")
    return found
