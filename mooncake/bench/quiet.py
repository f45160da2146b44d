"""Whether the machine is quiet enough for a bench that needs all of it (`bench engine`,
`bench cpp`, `bench vs-vllm`): what else is using the CPUs, sampled at start (psutil), so
a run beside another engine says so instead of printing slow figures as if they were the
engine's. Our own process and its children are not counted."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

BUSY_CPUS = 0.25  # a process using a quarter of a CPU or more over the sample is "heavy"


@dataclass(frozen=True)
class Busy:
    pid: int
    name: str
    cpus: float  # CPUs it used over the sample


def others_busy(sample_s: float = 0.5, threshold: float = BUSY_CPUS) -> list[Busy]:
    """Processes other than this one and its children that used `threshold` CPUs or more
    over `sample_s`, busiest first."""
    me = psutil.Process()
    mine = {me.pid, *(c.pid for c in me.children(recursive=True))}
    procs = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.pid in mine:
            continue
        try:
            p.cpu_percent(None)
            procs.append(p)
        except psutil.Error:
            continue
    time.sleep(sample_s)
    busy = []
    for p in procs:
        try:
            used = p.cpu_percent(None) / 100
        except psutil.Error:
            continue
        if used >= threshold:
            words = p.info.get("cmdline") or [p.info.get("name") or "?"]
            busy.append(Busy(p.pid, " ".join(words)[:80], round(used, 2)))
    return sorted(busy, key=lambda b: -b.cpus)


def warn_if_busy(what: str, log: Callable[[str], None], sample_s: float = 0.5) -> list[Busy]:
    """Say at start that `what` needs the whole machine when something else is using it;
    what was found (empty: quiet)."""
    busy = others_busy(sample_s)
    if busy:
        shown = "; ".join(f"pid {b.pid} {b.name} ({b.cpus:.2f} CPUs)" for b in busy[:5])
        load = os.getloadavg()[0]
        log(
            f"{what} needs the whole machine ({os.cpu_count()} CPUs, load average {load:.2f}), "
            f"and {len(busy)} other process(es) use it: {shown}. Its figures will be slower "
            "than the engine is; run it on a quiet machine."
        )
    return busy
