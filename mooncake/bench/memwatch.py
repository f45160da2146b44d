"""Watching a running stack's memory for `mooncake bench memory`, from a thread of its own (so
a busy event loop never skips a sample):

- every `interval_s`, the resident memory (RSS) of every worker and of the embedded servers,
  each counted with its child processes (Postgres serves every connection from a child);
  the largest seen is kept per role instance (`prefill-0`: across its restarts, if any);
- every `supervise_s`, what `mooncake up` does: a worker that exited is started again
  (`mooncake.supervise`); the exits are kept, so that deaths by SIGKILL (what the kernel's
  OOM killer sends) can be counted;
- every `pss_s`, each worker's proportional set size (PSS: a shared page counted as a
  1/n share in each of the n processes mapping it; the store's shared-memory segments are
  mapped by every engine worker that reads from them, and RSS counts them whole in each).
  Slower to read than RSS (the kernel walks the page tables: ~25 ms per 2 GiB), so sampled
  less often;
- the cgroup's own count of OOM kills (cgroup v2 `memory.events`), where it can be read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from mooncake.supervise import Exit, restart_exited

if TYPE_CHECKING:
    from mooncake.stack import Stack

CGROUP_ROOT = Path("/sys/fs/cgroup")


def tree_rss(roots: dict[str, int]) -> dict[str, int]:
    """RSS (bytes) of each named process together with its descendants, from one pass over
    the process table; a name whose process is gone is left out."""
    children: dict[int, list[int]] = defaultdict(list)
    rss: dict[int, int] = {}
    for p in psutil.process_iter(["ppid", "memory_info"]):
        info = p.info
        if info.get("memory_info") is None:
            continue  # gone, or not ours to read
        rss[p.pid] = int(info["memory_info"].rss)
        children[int(info["ppid"] or 0)].append(p.pid)
    out = {}
    for name, pid in roots.items():
        if pid not in rss:
            continue
        total, todo = 0, [pid]
        while todo:
            q = todo.pop()
            total += rss.get(q, 0)
            todo.extend(children.get(q, ()))
        out[name] = total
    return out


RSS_PARTS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def rss_parts(pid: int) -> dict[str, int]:
    """What a process's RSS is made of (bytes): anonymous memory (heap, the KV pool),
    file pages (libraries, mapped model files), shared memory (store segments); and
    `private`, anon + file: RSS less the shared segments, what the process holds itself."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                fields = line.split()  # "RssAnon:", "152", "kB"
                if fields and fields[0] in RSS_PARTS:
                    out[RSS_PARTS[fields[0]]] = int(fields[1]) * 1024
    except (OSError, ValueError):
        return {}
    if out:
        out["private"] = out.get("anon", 0) + out.get("file", 0)
    return out


def pss_bytes(pid: int) -> int | None:
    """The process's PSS (bytes), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "Pss:":
                    return int(fields[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cgroup_oom_kills(proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The `oom_kill` count of this process's cgroup (v2), None where it cannot be read
    (cgroup v1, no memory controller, no permission)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
        unified = next(line[3:] for line in lines if line.startswith("0::"))
        events = (CGROUP_ROOT / unified.lstrip("/") / "memory.events").read_text()
        return next(
            int(v) for k, v in (ln.split() for ln in events.splitlines()) if k == "oom_kill"
        )
    except (OSError, StopIteration, ValueError, KeyError):
        return None


class MemoryWatch:
    """Samples and supervises `stack` until `stop` (see the module doc)."""

    def __init__(
        self,
        stack: Stack,
        interval_s: float = 0.25,
        supervise_s: float = 0.5,
        pss_s: float = 5.0,
    ) -> None:
        self.stack = stack
        self.interval_s, self.supervise_s, self.pss_s = interval_s, supervise_s, pss_s
        self.peaks: dict[str, int] = {}  # worker name -> largest RSS seen, bytes
        # worker name -> part (anon, file, shmem, private; pss) -> its largest, bytes (the
        # worker alone)
        self.part_peaks: dict[str, dict[str, int]] = defaultdict(dict)
        self.infra_peaks: dict[str, int] = {}  # nats-server, postgres
        self.exits: list[Exit] = []
        self.samples = 0
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and supervising (before the stack is stopped: nothing restarts)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        next_check = time.monotonic() + self.supervise_s
        next_pss = time.monotonic()
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(psutil.Error):
                self.sample()
            now = time.monotonic()
            if now >= next_pss:
                next_pss = now + self.pss_s
                self.sample_pss()
            if now >= next_check:
                next_check = now + self.supervise_s
                self.exits += restart_exited(self.stack)

    def sample_pss(self) -> None:
        for w in list(self.stack.workers):
            if w.proc is not None and (pss := pss_bytes(w.proc.pid)) is not None:
                parts = self.part_peaks[w.name]
                parts["pss"] = max(parts.get("pss", 0), pss)

    def sample(self) -> None:
        workers = {w.name: w.proc.pid for w in list(self.stack.workers) if w.proc is not None}
        infra = {
            name: server.proc.pid
            for name, server in (
                ("nats-server", self.stack.nats),
                ("postgres", self.stack.postgres),
            )
            if server is not None and server.proc is not None
        }
        seen = tree_rss(workers | infra)
        for name, rss in seen.items():
            peaks = self.infra_peaks if name in infra else self.peaks
            peaks[name] = max(peaks.get(name, 0), rss)
        for name, pid in workers.items():
            parts = self.part_peaks[name]
            for part, size in rss_parts(pid).items():
                parts[part] = max(parts.get(part, 0), size)
        self.samples += 1
