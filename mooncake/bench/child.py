"""An anchor a bench times in a process of its own (`Child`), so that it cannot take the
bench down: llama.cpp's CPU backend dies with SIGILL on VMs that hide an instruction it
picked, and a crash in the bench's own process loses every figure of the run.

The bench still pairs its timings (`engine.speed.paired`): the parent asks the child to
time one call at a time over a pipe and times its own side between two asks. A child that
dies is an `AnchorFailed` naming the signal or exit code; one that does not answer within
`call_timeout_s` is killed and named so; an error in it (a missing install) comes back as
its message. Children start by `spawn`: a fork of a process holding torch's thread pools
can hang."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 300.0


class AnchorFailed(Exception):
    """The anchor could not give a figure: why, in a few words ("SIGILL", "no answer
    within 300 s", "ModuleNotFoundError: No module named 'llama_cpp'")."""


def _serve(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        runner = factory(*args)
    except BaseException as exc:
        conn.send(("error", _why(exc)))
        return
    conn.send(("ok", None))
    while True:
        try:
            op, op_args = conn.recv()
        except EOFError:
            return  # the parent is gone
        if op == "stop":
            return
        try:
            conn.send(("ok", getattr(runner, op)(*op_args)))
        except BaseException as exc:
            conn.send(("error", _why(exc)))


def _why(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()[:1000]


def exit_reason(code: int | None) -> str:
    """How a child ended, in a field's words: "SIGILL", "exit 3" (every bench's)."""
    if code is None:
        return "its pipe closed while it ran"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class Child:
    """`factory(*args)` built in a child process; `call(op, *op_args)` runs its method `op`
    there and returns what it returned (a picklable value: the seconds a call took)."""

    def __init__(
        self, factory: Callable[..., Any], *args: Any,
        start_timeout_s: float = START_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, factory, args), daemon=True)
        self._proc.start()
        theirs.close()
        self.call_timeout_s = call_timeout_s
        self._answer(start_timeout_s)

    def call(self, op: str, *op_args: Any) -> Any:
        try:
            self._conn.send((op, op_args))
        except OSError as exc:  # it died between calls
            self.close()
            raise AnchorFailed(exit_reason(self._proc.exitcode)) from exc
        return self._answer(self.call_timeout_s)

    def _answer(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.close(hung=True)
            raise AnchorFailed(f"no answer within {timeout_s:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:  # it died: poll saw the pipe close
            self._proc.join(10)
            self.close()
            raise AnchorFailed(exit_reason(self._proc.exitcode)) from None
        if kind == "error":
            self.close()
            raise AnchorFailed(value)
        return value

    def close(self, *, hung: bool = False) -> None:
        """Stop the child: asked to, then killed if it does not within 5 s (at once where
        it `hung`: it reads no more asks)."""
        if self._proc.is_alive() and not hung:
            with contextlib.suppress(OSError):
                self._conn.send(("stop", ()))
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
