"""Bring up the whole system on one machine: what is missing of the infrastructure, the
migrations, and one process per worker role. Used by `mooncake up`, `mooncake demo`, the
benches that run the real processes (memory, isolation, overload) and the end-to-end tests
(which kill and restart the pieces)."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias
from urllib.parse import urlparse

import psutil
from rich.table import Table

from mooncake.config import Settings
from mooncake.cpus import available
from mooncake.db.engine import upgrade
from mooncake.services import (
    EmbeddedNats,
    EmbeddedPostgres,
    ManagedProcess,
    free_port,
    url_reachable,
)
from mooncake.stack_index import IndexWatch
from mooncake.store.protocol import KvIndexReport

log = logging.getLogger(__name__)

# (role, instances) in start order.
Layout: TypeAlias = tuple[tuple[str, int], ...]
# The whole system on one machine (`mooncake up`'s): one prefill and one decode instance,
# each pooling its own DRAM into the store (an embedded store node), and each running as many
# torch threads as the machine has CPUs: the two lend each other their cores (a lone prompt
# prefills on all of them; a decode step takes its share while both run). Issue 42 measured
# the old layout, 2 + 2 workers of one thread each on 2 cores: a lone 512-token prompt waited
# for one core, and a prefill-heavy load left the decode workers' half of the machine idle.
LAYOUT: Layout = (
    ("recorder", 1),
    ("store-master", 1),
    ("conductor", 1),
    ("prefill", 1),
    ("decode", 1),
    # The OpenAI-compatible HTTP API (gateway.port, 8000 unless configured or taken).
    ("gateway", 1),
)
# Workers that run the model and hold a KV pool: the default KV budget is divided by these.
ENGINE_ROLES = ("prefill", "decode")
# The Conductor's KV index report older than this (it stopped answering) shows as unknown.
INDEX_STALE_S = 5.0


@dataclass(frozen=True, slots=True)
class Usage:
    """What a running process holds and has spent: resident memory, and CPU time (user +
    system) since it started."""

    rss_bytes: int
    cpu_s: float


def process_usage(p: ManagedProcess) -> Usage | None:
    """`p`'s usage now; None when it is not running (or exits while it is read)."""
    if not p.running or p.proc is None:
        return None
    try:
        ps = psutil.Process(p.proc.pid)
        with ps.oneshot():  # one read of /proc for both
            cpu = ps.cpu_times()
            return Usage(ps.memory_info().rss, cpu.user + cpu.system)
    except psutil.Error:
        return None


@dataclass
class WorkerProcess(ManagedProcess):
    role: str = ""
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    metrics_url: str | None = None  # its Prometheus endpoint, when the stack turned them on

    def rss_mb(self) -> float | None:
        """Resident memory of the process, MiB (None when it is not running)."""
        u = process_usage(self)
        return None if u is None else u.rss_bytes / (1 << 20)


@dataclass
class Stack:
    settings: Settings
    nats_url: str = ""
    database_url: str = ""
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    # The store's cluster secret: the configured one, else a fresh one per `up`.
    store_secret: str = field(default_factory=lambda: secrets.token_hex(32))
    # Where the gateway listens, chosen once when it first starts (restarts keep it).
    gateway_port: int | None = None
    # Every worker serves Prometheus /metrics on a port of its own (`up`; the status table
    # lists them). Off: what the settings say (`metrics_port`, -1 = off by default).
    metrics: bool = False
    # The Conductor's view of every store node's KV index (`watch_index`; the table's
    # `index` column), None until watched.
    index_watch: IndexWatch | None = None
    # Which workers, how many of each: `mooncake up`'s by default; a bench runs another
    # (`bench overload`: N prefill, M decode, no gateway). Engine workers share this
    # machine's memory by the layout's count (`engine_workers`).
    layout: Layout = LAYOUT
    # Environment one role's workers get on top of `child_env`, e.g. the Conductor's policy
    # and cost profile for one phase of a bench. Kept here, not given to one start, so that
    # a restart (after a crash, `restart`) starts the worker as it was configured.
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Whether the workers inherit this process's MOONCAKE_* variables: `up` passes its
    # configuration on that way (only the settings `child_env` exports are set from
    # `settings`). Off, the workers see `settings` and the defaults, nothing of the
    # caller's shell: a bench that must measure the same system wherever it runs.
    inherit_env: bool = True
    # Processes started beside the stack (a bench's own broker) that `usage` samples with
    # the workers; the stack never stops or restarts them.
    extra: dict[str, ManagedProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        configured = self.settings.store.secret
        if configured is not None and configured.get_secret_value():
            self.store_secret = configured.get_secret_value()

    def start_infrastructure(self) -> None:
        data = self.settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        if url_reachable(self.settings.nats_url, 4222):
            self.nats_url = self.settings.nats_url
        else:
            # Nothing there: serve the configured address ourselves when it is local.
            self.nats = EmbeddedNats.create(data, port=_local_port(self.settings.nats_url)).start()
            self.nats_url = self.nats.url
        if self.settings.database_url:
            self.database_url = self.settings.database_url
        else:
            self.postgres = EmbeddedPostgres.create(data).start()
            self.database_url = self.postgres.url
        upgrade(self.database_url)
        self.write_runtime_env()

    def write_runtime_env(self) -> Path:
        """Let `mooncake submit` in another terminal find what we started."""
        path = self.settings.data_dir / "runtime.env"
        path.write_text(
            f"MOONCAKE_NATS_URL={self.nats_url}\nMOONCAKE_DATABASE_URL={self.database_url}\n"
            f"MOONCAKE_STORE__SECRET={self.store_secret}\nMOONCAKE_UP_PID={os.getpid()}\n"
        )
        path.chmod(0o600)  # it holds the store's cluster secret
        return path

    @property
    def engine_workers(self) -> int:
        """Engine workers in the layout (at least 1: the share a lone worker assumes)."""
        return max(1, sum(n for role, n in self.layout if role in ENGINE_ROLES))

    def child_env(self) -> dict[str, str]:
        if self.inherit_env:
            env = dict(os.environ)
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        env["MOONCAKE_NATS_URL"] = self.nats_url
        env["MOONCAKE_DATABASE_URL"] = self.database_url
        env["MOONCAKE_STORE__SECRET"] = self.store_secret
        # Every worker must agree on these (block keys are computed on both sides).
        env["MOONCAKE_BLOCK_TOKENS"] = str(self.settings.block_tokens)
        env["MOONCAKE_NAMESPACE"] = self.settings.namespace
        # ... and on these: the settings may have been built in code (a bench), not read
        # from this environment. Under `up` they equal the environment's.
        env["MOONCAKE_DATA_DIR"] = str(self.settings.data_dir)
        env["MOONCAKE_LOG_LEVEL"] = self.settings.log_level
        env["MOONCAKE_ENGINE__MODEL"] = self.settings.engine.model
        if self.settings.engine.model == "dummy":  # its shape too (the weights are seeded)
            for name, value in self.settings.engine.dummy.model_dump().items():
                env[f"MOONCAKE_ENGINE__DUMMY__{name.upper()}"] = str(value)
        env["MOONCAKE_SLO__TTFT_S"] = str(self.settings.slo.ttft_s)
        env["MOONCAKE_SLO__TBT_S"] = str(self.settings.slo.tbt_s)
        engine = self.settings.engine
        if engine.threads is not None:  # configured in the settings (a bench's)
            env["MOONCAKE_ENGINE__THREADS"] = str(engine.threads)
        elif "MOONCAKE_ENGINE__THREADS" not in env:
            # The engine processes share this machine's cores: each runs a torch thread per
            # CPU, so whichever is busy uses them all, by turns (engine/turns.py): running at
            # once, their threads would wait on each other's at every OpenMP barrier.
            env["MOONCAKE_ENGINE__THREADS"] = str(len(available()))
            env.setdefault("MOONCAKE_ENGINE__TURNS_DIR", str(self.settings.data_dir / "cores"))
        for name in ("gemm", "attention"):  # a precision the settings name (a bench's)
            if name in engine.model_fields_set:
                env[f"MOONCAKE_ENGINE__{name.upper()}"] = getattr(engine, name)
        if engine.turns_dir is not None:
            env["MOONCAKE_ENGINE__TURNS_DIR"] = str(engine.turns_dir)
        # The KV pools are mapped at start: a prefill does not pay the first touch of its
        # pages, and each worker holds its budget from the start (mooncake/memory.py).
        if "prefault_kv" in engine.model_fields_set:
            env["MOONCAKE_ENGINE__PREFAULT_KV"] = str(engine.prefault_kv).lower()
        env.setdefault("MOONCAKE_ENGINE__PREFAULT_KV", "true")
        # ... and its memory: each engine worker's KV pool is one share of it (or the budget
        # given to `up`, which then overrides the environment's).
        env["MOONCAKE_ENGINE_WORKERS_PER_HOST"] = str(self.engine_workers)
        if self.settings.kv_cache_bytes is not None:
            env["MOONCAKE_KV_CACHE_BYTES"] = str(int(self.settings.kv_cache_bytes))
        env.setdefault("MOONCAKE_STORE__DRAM_BYTES", str(self.store_bytes()))
        # The Conductor admits as these settings say (an option of the command that built
        # them may have overridden the environment's).
        env["MOONCAKE_ADMISSION_POLICY"] = self.settings.admission_policy
        if self.settings.conductor.cost_profile is not None:
            profile = str(Path(self.settings.conductor.cost_profile).resolve())
            env["MOONCAKE_CONDUCTOR__COST_PROFILE"] = profile
        if self.gateway_port is not None:
            env["MOONCAKE_GATEWAY__PORT"] = str(self.gateway_port)
        return env

    def store_bytes(self) -> int:
        """Each engine worker's store segment: configured, or a share of this machine."""
        from mooncake import memory

        if "dram_bytes" in self.settings.store.model_fields_set:
            return self.settings.store.dram_bytes
        return memory.default_store_bytes(memory.machine_memory(), self.engine_workers)

    def kv_statement(self) -> str:
        """What each engine worker's KV pool gets, and why (printed at start)."""
        from mooncake import memory

        total = memory.machine_memory()
        if self.settings.kv_cache_bytes is not None:
            budget, why = int(self.settings.kv_cache_bytes), "configured"
        else:
            budget = memory.default_kv_cache_bytes(total, self.engine_workers)
            why = (
                f"{memory.KV_SHARE_OF_MEMORY:.0%} of {total / memory.GIB:.1f} GiB over "
                f"{self.engine_workers} engine workers; set --kv-cache-bytes to change it"
            )
        store = self.store_bytes() / memory.GIB
        return (
            f"KV cache per engine worker: {budget / memory.GIB:.2f} GiB ({why}); "
            f"store DRAM per engine worker: {store:.2f} GiB"
        )

    @property
    def gateway_url(self) -> str | None:
        if self.gateway_port is None:
            return None
        return f"http://{self.settings.gateway.host}:{self.gateway_port}/v1"

    def start_worker(self, role: str, index: int = 0) -> WorkerProcess:
        if role == "gateway" and self.gateway_port is None:
            self.gateway_port = gateway_port(self.settings.gateway.host, self.settings.gateway.port)
        name = f"{role}-{index}"
        argv = [sys.executable, "-m", "mooncake.cli", "worker", role, "--instance", name]
        log_path = self.log_dir / f"{name}.log"
        env, metrics_url = self.child_env() | self.role_env.get(role, {}), None
        if self.metrics:
            host = self.settings.metrics_host
            port = free_port(host)
            env["MOONCAKE_METRICS_PORT"] = str(port)
            metrics_url = f"http://{host}:{port}/metrics"
        w = WorkerProcess(name, argv, log_path, 0, env=env, role=role, metrics_url=metrics_url)
        w.spawn()
        self.workers.append(w)
        return w

    def start_workers(self, roles: tuple[str, ...] | None = None) -> None:
        """The layout's workers, in its order (or only `roles`, in theirs)."""
        counts = dict(self.layout)
        for role in roles if roles is not None else tuple(counts):
            for index in range(counts.get(role, 1)):
                self.start_worker(role, index)

    def restart(self, w: WorkerProcess) -> WorkerProcess:
        """Start `w` again under its name; a running one is stopped first (a restart that
        takes a changed `role_env`)."""
        w.stop(timeout=15)
        self.workers.remove(w)
        fresh = self.start_worker(w.role, int(w.name.rsplit("-", 1)[1]))
        fresh.restarts = w.restarts + 1
        return fresh

    def worker(self, name: str) -> WorkerProcess:
        return next(w for w in self.workers if w.name == name)

    def dead(self) -> list[str]:
        """The workers that are not running (exited, killed), by name."""
        return [w.name for w in self.workers if not w.running]

    def usage(self) -> dict[str, Usage]:
        """Every running worker's usage, and the `extra` processes', by name."""
        procs: list[tuple[str, ManagedProcess]] = [(w.name, w) for w in self.workers]
        procs += self.extra.items()
        return {name: u for name, p in procs if (u := process_usage(p)) is not None}

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    def log_text(self) -> dict[str, str]:
        """Each worker's log so far, by name ("" before it wrote one)."""
        return {
            w.name: w.log_path.read_text(errors="replace") if w.log_path.exists() else ""
            for w in self.workers
        }

    def watch_index(self) -> None:
        """Follow the Conductor's KV index states for the status table (a thread: the
        table never waits on the broker)."""
        if self.index_watch is None:
            there = self.settings.model_copy(update={"nats_url": self.nats_url})
            self.index_watch = IndexWatch(there).start()

    def stop(self) -> None:
        if self.index_watch is not None:
            self.index_watch.stop()
            self.index_watch = None
        for w in reversed(self.workers):
            w.stop(timeout=15)
        self.workers.clear()
        if self.postgres is not None:
            self.postgres.stop()
        if self.nats is not None:
            self.nats.stop()
        # What it pointed at is gone; a later `submit` must not chase it.
        (self.settings.data_dir / "runtime.env").unlink(missing_ok=True)

    def status_rows(self) -> list[tuple[str, str, str, str, str, str, str]]:
        """(component, address, state, uptime, restarts, memory, index) for the status
        table; index: the Conductor's view of the worker's store node's KV index."""
        rows = [
            ("nats", self.nats_url, "embedded" if self.nats else "external", "", "", "", ""),
            ("postgres", self.database_url, "embedded" if self.postgres else "external", "",
             "", "", ""),
        ]  # fmt: skip
        now = time.monotonic()
        latest = self.index_watch.latest() if self.index_watch is not None else None
        index = index_cells(latest[0], now - latest[1]) if latest is not None else {}
        for w in self.workers:
            state = "running" if w.running else f"exited {w.proc.returncode if w.proc else '?'}"
            where = f"pid {w.proc.pid if w.proc else '-'}"
            if w.role == "gateway" and self.gateway_url:
                where += f", {self.gateway_url}"
            if w.metrics_url:
                where += f", metrics {w.metrics_url}"
            rss = w.rss_mb()
            rows.append(
                (
                    w.name,
                    where,
                    state,
                    _duration(now - w.started_at),
                    str(w.restarts),
                    f"{rss:.0f} MiB" if rss is not None else "-",
                    # A worker's store node is named as the worker (its instance id).
                    index.get(w.name, "-"),
                )
            )
        return rows


def index_cells(report: KvIndexReport, age_s: float) -> dict[str, str]:
    """Store node id -> "exact 3m02s" (its state, and for how long), from the Conductor's
    report received `age_s` ago; nothing when that is too old to stand for now. Durations
    are the Conductor's own clock differences, so the two machines' clocks need not agree."""
    if age_s > INDEX_STALE_S:
        return {}
    return {
        n.node_id: f"{n.state.value} {_duration(max(0.0, report.at - n.since + age_s))}"
        for n in report.nodes
    }


def other_system(settings: Settings, nats_url: str) -> str | None:
    """Why another system already serves this namespace on the broker at `nats_url` (its
    Conductor takes submissions: a second `up` would share its streams, work and state), or
    None."""
    import asyncio

    from mooncake.bus.connection import connect
    from mooncake.client import SystemDown, check_admitting
    from mooncake.events import Namespace

    async def probe() -> str | None:
        there = settings.model_copy(update={"nats_url": nats_url})
        nc = await connect(there, "up-probe", connect_timeout=3, max_reconnect_attempts=0)
        try:
            await check_admitting(nc, Namespace(settings.namespace), within_s=1.0)
        except SystemDown:
            return None
        finally:
            await nc.close()
        return (
            f"a Conductor already takes submissions in namespace {settings.namespace!r} on "
            f"{nats_url}: another system uses this broker; set MOONCAKE_NAMESPACE to run "
            "a second one beside it"
        )

    try:
        return asyncio.run(probe())
    except Exception:
        return None


def running_up(runtime_env: Path) -> int | None:
    """The pid of the `mooncake up` that wrote `runtime_env` if it still runs; None when the
    file is absent or stale (its `up` was killed: `stop` removes the file)."""
    try:
        lines = runtime_env.read_text().splitlines()
    except OSError:
        return None
    values = dict(line.split("=", 1) for line in lines if "=" in line)
    try:
        pid = int(values.get("MOONCAKE_UP_PID", ""))
    except ValueError:
        return None
    return pid if pid != os.getpid() and psutil.pid_exists(pid) else None


def status_table(stack: Stack, title: str = "mooncake") -> Table:
    table = Table(title=title)
    for col in ("component", "address", "state", "up", "restarts", "memory", "index"):
        # Addresses are folded onto more lines, never cut: they are there to be copied.
        table.add_column(col, overflow="fold" if col == "address" else "ellipsis")
    for row in stack.status_rows():
        table.add_row(*row)
    return table


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def gateway_port(host: str, configured: int) -> int:
    """The configured port when it can be bound, else a free one (0 asks for that).

    `mooncake up` is the one-machine dev path: when 8000 is taken (another service, a second
    stack, tests running side by side) the system still comes up, on a port the status table
    shows, instead of a gateway that crashes and restarts forever."""
    if configured:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, configured))
            return configured
        except OSError:
            log.warning("gateway port %s:%d is taken; using a free one", host, configured)
    return free_port(host)


def _local_port(url: str) -> int | None:
    parsed = urlparse(url)
    if parsed.hostname in ("127.0.0.1", "localhost") and parsed.port:
        return parsed.port
    return None


def wait_until(predicate: object, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False
