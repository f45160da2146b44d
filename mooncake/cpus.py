"""Which CPUs a process runs on: the list syntax of `taskset -c` and Linux's cpusets
("0-3,8"), pinning a process to such a list, and spreading workers over a machine's CPUs.

An engine worker pinned to CPUs of its own keeps its caches and is not moved onto a core
another worker is computing on. Measured on a 2-vCPU VM (`mooncake bench cpp`, two
one-thread pipeline stages, an 8k-token prefill): 2-4 % sooner pinned in alternating pairs,
the same within noise in medians of three; a lone worker as fast either way; four stages,
two pinned to each vCPU, ~4 % later than left to the scheduler. Pure but for `pin_process`
and `available`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

MAX_CPU = 1 << 16  # no machine has more; a typo such as "0-100000" is an error, not a mask


def parse_cpus(text: str) -> tuple[int, ...]:
    """The sorted CPUs of a list such as "0-3,8" (ranges inclusive, commas between items,
    spaces ignored). ValueError, saying what is wrong, for anything else or an empty list."""
    cpus: set[int] = set()
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise ValueError("a CPU list names at least one CPU, e.g. 0-3,8")
    for item in items:
        lo_text, dash, hi_text = item.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise ValueError(
                f"{item!r} in the CPU list {text!r} is neither a CPU number nor a range such as 0-3"
            ) from None
        if lo < 0 or hi < lo or hi >= MAX_CPU:
            raise ValueError(f"{item!r} in the CPU list {text!r} is not a range of CPUs")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpus(cpus: Iterable[int]) -> str:
    """The shortest list syntax for `cpus`: runs of consecutive CPUs as ranges."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            out.append(_run(run))
            run = []
        run.append(cpu)
    if run:
        out.append(_run(run))
    return ",".join(out)


def _run(run: Sequence[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def spread(workers: int, threads: int, cpus: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive disjoint sets of `threads` of `cpus` for `workers` workers. ValueError
    where they do not fit: workers sharing pinned CPUs ran slower here than left to the
    scheduler (see the module docstring)."""
    if workers < 0 or threads < 1:
        raise ValueError("spread wants workers >= 0 and threads >= 1")
    if workers * threads > len(cpus):
        raise ValueError(f"{workers} workers of {threads} threads do not fit on {len(cpus)} CPUs")
    order = sorted(cpus)
    return [tuple(order[w * threads : (w + 1) * threads]) for w in range(workers)]


def available() -> tuple[int, ...]:
    """The CPUs this process may run on (every CPU where the OS cannot say)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def pin_process(cpus: Sequence[int]) -> None:
    """Run every thread of this process, and the threads it starts later, on `cpus` only.
    ValueError where some of them are not available to it (another cpuset, an offline
    CPU) or the OS cannot pin (not Linux)."""
    allowed = set(available())
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(
            f"CPUs {format_cpus(missing)} are not available to this process "
            f"(it may run on {format_cpus(allowed)})"
        )
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("this OS cannot pin a process to CPUs")
    mask = set(cpus)
    # Threads already running (torch's pool, where it started) keep their own mask: each
    # is set; new threads inherit the mask of the thread that starts them.
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            raise ValueError(f"pinning to CPUs {format_cpus(mask)} failed: {exc}") from None
