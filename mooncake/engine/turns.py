"""Turns at a host's CPUs between its engine processes: a prefill and a decode instance of
one host that both run a thread per CPU take the whole machine by turns instead of
splitting it (issue 42).

Why turns and not a split. Measured on a 2-vCPU VM (SmolLM2, bfloat16 prefill GEMMs): a
3,000-token prefill on 2 threads takes 2.0 s alone, but 5-10 s while a 1-thread decode loop
runs beside it (OpenMP's barriers wait for the thread the other process displaced; the
fused decode step has ~150 barriers, a prefill layer a few), 3.7 s on 1 thread beside it; a
batch-4 decode step takes 22 ms on 2 threads, 40 ms on 1, and up to ~1 s on 2 threads
beside a prefill. So the two never compute at once: each runs on every CPU while it holds
the turn.

How. One exclusive `flock` on `turn.lock` is the turn; a side that wants it holds a shared
lock on its `want-<side>.lock` while it waits, so the holder can see a waiter
(`wanted_by_other`). A decode step holds the turn for that step and, when a prefill waits,
lets it in before asking again; a prefill holds it until it ends, yielding between layers
once it has held it for `quantum_s` and a decode step waits. So while both have work they
alternate one decode step with about a quantum of prefill: the time between tokens is about
a quantum plus a step (a layer of a 3,000-token SmolLM2 prefill is ~70 ms here), and the
prefill keeps most of the machine. The kernel drops a dead process's locks: a worker
killed while it holds the turn blocks nobody.

`NO_TURNS` (the default) does nothing: an engine alone on its host, or on a GPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # no torch for the turns themselves (tests take them in bare processes)
    from torch import Tensor

    from mooncake.engine.model import LayerHooks

Side = Literal["prefill", "decode"]
SIDES: tuple[Side, Side] = ("prefill", "decode")
HANDOFF_POLL_S = 0.0002  # how often a side that let the other in looks whether it got in
HANDOFF_LIMIT_S = 1.0  # a waiter that has not taken the turn by then is not waited for


class NoTurns:
    """Every CPU, all the time: nobody to take turns with."""

    waited_s = 0.0

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        yield

    def pause_point(self) -> None:
        return None


class CoreTurns:
    """This process's side of the turns in `directory` (see the module docstring)."""

    def __init__(self, directory: Path, side: Side, quantum_s: float = 0.05) -> None:
        if side not in SIDES:
            raise ValueError(f"a side is prefill or decode, not {side!r}")
        if quantum_s <= 0:
            raise ValueError("a quantum is above 0 seconds")
        directory.mkdir(parents=True, exist_ok=True)
        self.side: Side = side
        self.other: Side = SIDES[1 - SIDES.index(side)]
        self.quantum_s = quantum_s
        self._turn = _open(directory / "turn.lock")
        self._want = {s: _open(directory / f"want-{s}.lock") for s in SIDES}
        self._since: float | None = None  # when this process took the turn it holds
        # The process's threads take the turn one at a time (a flock is the process's, not
        # a thread's); the holder's own nested turns are its outer one.
        self._mutex = threading.RLock()
        self._depth = 0
        self.waited_s = 0.0  # time spent waiting for the turn, all told
        self.yields = 0  # times a prefill let a decode step in

    def close(self) -> None:
        for fd in (self._turn, *self._want.values()):
            os.close(fd)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for what runs inside (re-entrant: an inner turn is the outer one's)."""
        with self._mutex:
            self._depth += 1
            try:
                if self._depth == 1:
                    self._acquire()
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._release()
                    if self.side == "decode" and self.wanted_by_other():
                        self._let_other_in()

    def pause_point(self) -> None:
        """Between two parts of a long computation: a prefill that has held the turn for a
        quantum lets a waiting decode step run, then goes on."""
        if self._since is None or time.monotonic() - self._since < self.quantum_s:
            return
        if not self.wanted_by_other():
            return
        self._release()
        self._let_other_in()
        self.yields += 1
        self._acquire()

    def wanted_by_other(self) -> bool:
        """Whether the other side waits for the turn."""
        fd = self._want[self.other]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _acquire(self) -> None:
        t0 = time.monotonic()
        want = self._want[self.side]
        fcntl.flock(want, fcntl.LOCK_SH)
        try:
            fcntl.flock(self._turn, fcntl.LOCK_EX)
        finally:
            fcntl.flock(want, fcntl.LOCK_UN)
        self._since = time.monotonic()
        self.waited_s += self._since - t0

    def _release(self) -> None:
        self._since = None
        fcntl.flock(self._turn, fcntl.LOCK_UN)

    def _let_other_in(self) -> None:
        """Wait (briefly) until the waiting side holds the turn: it stops wanting once it
        does. Without this, this side could take the turn straight back."""
        deadline = time.monotonic() + HANDOFF_LIMIT_S
        while self.wanted_by_other() and time.monotonic() < deadline:
            time.sleep(HANDOFF_POLL_S)


Turns = NoTurns | CoreTurns
NO_TURNS = NoTurns()


class TurnHooks:
    """A prefill's layer hooks with a pause point before each layer."""

    def __init__(self, inner: LayerHooks, turns: Turns) -> None:
        self.inner, self.turns = inner, turns

    def before_layer(self, layer: int) -> None:
        self.turns.pause_point()
        self.inner.before_layer(layer)

    def after_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.inner.after_layer(layer, k, v)


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
