"""engine.turns: a host's prefill and decode engines take its CPUs by turns (real processes,
real flocks)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from mooncake.engine.turns import NO_TURNS, CoreTurns, TurnHooks

CTX = mp.get_context("spawn")


def _decode_steps(directory: str, log: str, step_s: float, ready: object, stop: object) -> None:
    """Decode steps of `step_s` until `stop` (at most 30 s)."""
    turns = CoreTurns(Path(directory), "decode")
    ready.set()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    with open(log, "a") as out:
        while not stop.is_set() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            with turns.turn():
                a = time.monotonic()
                time.sleep(step_s)
                out.write(f"decode {a} {time.monotonic()}\n")
                out.flush()


def _prefill(directory: str, log: str, layers: int, layer_s: float, quantum_s: float) -> None:
    turns = CoreTurns(Path(directory), "prefill", quantum_s)
    with open(log, "a") as out, turns.turn():
        start = time.monotonic()
        for _ in range(layers):
            turns.pause_point()
            a = time.monotonic()
            time.sleep(layer_s)
            out.write(f"prefill {a} {time.monotonic()}\n")
            out.flush()
        out.write(f"done {start} {time.monotonic()} {turns.yields}\n")


def _intervals(log: Path) -> list[tuple[str, float, float]]:
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(r[0], float(r[1]), float(r[2])) for r in rows if r[0] != "done"]


def test_a_prefill_and_a_decode_never_compute_at_once_and_alternate(tmp_path: Path) -> None:
    log = tmp_path / "log"
    ready, stop = CTX.Event(), CTX.Event()
    decode = CTX.Process(target=_decode_steps, args=(str(tmp_path), str(log), 0.005, ready, stop))
    decode.start()
    assert ready.wait(30)
    prefill = CTX.Process(target=_prefill, args=(str(tmp_path), str(log), 20, 0.02, 0.03))
    prefill.start()
    prefill.join(60)
    stop.set()
    decode.join(60)
    assert prefill.exitcode == 0 and decode.exitcode == 0
    spans = sorted(_intervals(log), key=lambda r: r[1])
    for (_, _, end), (_, start, _) in itertools.pairwise(spans):
        assert start >= end - 1e-4, "two engines computed at once"
    done = next(line.split() for line in log.read_text().splitlines() if line.startswith("done"))
    begun, ended, yields = float(done[1]), float(done[2]), int(done[3])
    assert yields >= 3  # the prefill let decode steps in while it ran
    inside = [s for s in spans if s[0] == "decode" and begun < s[1] < ended]
    assert inside, "no decode step ran during the prefill"
    # While the prefill ran, a decode step waited about a quantum plus a layer, not for the
    # whole prefill (20 layers of 20 ms).
    gaps = [b[1] - a[2] for a, b in itertools.pairwise(inside)]
    assert gaps and max(gaps) < 0.2


def _hold(directory: str, side: str, held: object) -> None:
    turns = CoreTurns(Path(directory), side)  # type: ignore[arg-type]
    with turns.turn():
        held.set()  # type: ignore[attr-defined]
        time.sleep(600)


def test_a_holder_killed_with_sigkill_blocks_nobody(tmp_path: Path) -> None:
    held = CTX.Event()
    holder = CTX.Process(target=_hold, args=(str(tmp_path), "prefill", held))
    holder.start()
    assert held.wait(30)
    mine = CoreTurns(tmp_path, "decode")
    assert mine.wanted_by_other() is False
    assert holder.pid is not None
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    t0 = time.monotonic()
    with mine.turn():
        pass
    assert time.monotonic() - t0 < 5
    mine.close()


def test_turns_are_reentrant_and_the_default_does_nothing(tmp_path: Path) -> None:
    turns = CoreTurns(tmp_path, "prefill")
    with turns.turn(), turns.turn():
        turns.pause_point()  # nobody waits: it goes on
    assert turns.yields == 0
    with NO_TURNS.turn():
        NO_TURNS.pause_point()

    class Seen:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def before_layer(self, layer: int) -> None:
            self.calls.append(f"before {layer}")

        def after_layer(self, layer: int, k: object, v: object) -> None:
            self.calls.append(f"after {layer}")

    inner = Seen()
    hooks = TurnHooks(inner, turns)
    hooks.before_layer(0)
    hooks.after_layer(0, None, None)  # type: ignore[arg-type]
    assert inner.calls == ["before 0", "after 0"]
    with pytest.raises(ValueError):
        CoreTurns(tmp_path, "gateway")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CoreTurns(tmp_path, "decode", quantum_s=0)
    turns.close()
