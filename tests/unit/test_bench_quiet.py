"""A bench that needs the whole machine says at start what else is using it (not its own
children: those are the bench)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mooncake.bench.quiet import others_busy, warn_if_busy

SPIN = "while True: pass"


@pytest.fixture
def stranger() -> Iterator[int]:
    """A busy process that is not this one's descendant (its shell parent exits)."""
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{SPIN}" >/dev/null 2>&1 & echo $!'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid = int(out.stdout.strip())
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_busy_process_beside_the_bench_is_named(stranger: int) -> None:
    lines: list[str] = []
    found = warn_if_busy("bench engine", lines.append, sample_s=1.0)
    assert stranger in [b.pid for b in found]
    assert len(lines) == 1 and "bench engine needs the whole machine" in lines[0]
    assert f"and {len(found)} other process(es) use it: pid {found[0].pid} " in lines[0]


def test_its_own_children_are_not_counted() -> None:
    own = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        assert own.pid not in [b.pid for b in others_busy(sample_s=1.0)]
    finally:
        own.kill()
        own.wait()
