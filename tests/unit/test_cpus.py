"""CPU lists, pinning and spreading workers over CPUs (mooncake/cpus.py), and the
`engine.cpus` setting that carries a list."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from mooncake.config import EngineSettings
from mooncake.cpus import available, format_cpus, parse_cpus, spread


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("8, 0-2", (0, 1, 2, 8)),
        ("3,1-2,2", (1, 2, 3)),
        (" 5 - 6 ", (5, 6)),
    ],
)
def test_a_cpu_list_is_read_as_taskset_reads_it(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "at least one CPU"),
        (" , ", "at least one CPU"),
        ("a", "neither a CPU number nor a range"),
        ("1-", "neither a CPU number nor a range"),
        ("1,,2", "neither a CPU number nor a range"),
        ("3-1", "not a range of CPUs"),
        ("-1", "neither a CPU number nor a range"),
        ("0-70000", "not a range of CPUs"),
    ],
)
def test_a_bad_cpu_list_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_cpus(text)


def test_a_list_is_written_back_in_ranges() -> None:
    assert format_cpus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpus([5]) == "5"
    for text in ("0-3,8,10-11", "7", "0,2,4"):
        assert format_cpus(parse_cpus(text)) == text


def test_workers_get_cpus_of_their_own() -> None:
    assert spread(2, 1, [1, 0]) == [(0,), (1,)]
    assert spread(2, 2, [4, 5, 6, 7, 8]) == [(4, 5), (6, 7)]
    assert spread(0, 1, [0]) == []
    with pytest.raises(ValueError, match="4 workers of 1 threads do not fit on 2 CPUs"):
        spread(4, 1, [0, 1])
    with pytest.raises(ValueError, match="do not fit"):
        spread(1, 3, [0, 1])
    with pytest.raises(ValueError):
        spread(1, 0, [0])


def test_the_engine_setting_is_checked_and_kept_in_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineSettings(cpus="3, 0-2").cpus == "0-3"
    assert EngineSettings().cpus is None
    with pytest.raises(ValidationError, match="neither a CPU number nor a range"):
        EngineSettings(cpus="0-x")
    from mooncake.config import Settings

    monkeypatch.setenv("MOONCAKE_ENGINE__CPUS", "1,0")
    assert Settings().engine.cpus == "0-1"


PIN_PROBE = """
import os, threading
from mooncake.cpus import pin_process
before = threading.Event(); after = []
def wait():
    before.wait()
t = threading.Thread(target=wait); t.start()        # a thread already running
pin_process([{cpu}])
def report():
    after.append(os.sched_getaffinity(0))
n = threading.Thread(target=report); n.start(); n.join()  # a thread started after
masks = [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")]
before.set(); t.join()
print(sorted({{tuple(sorted(m)) for m in masks + after}}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")
def test_pinning_moves_every_thread_and_those_started_after() -> None:
    cpu = available()[-1]
    out = subprocess.run(
        [sys.executable, "-c", PIN_PROBE.format(cpu=cpu)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == f"[({cpu},)]", out.stdout + out.stderr


def test_cpus_outside_the_process_set_are_refused_and_nothing_is_pinned() -> None:
    from mooncake.cpus import pin_process

    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    outside = max(available()) + 1
    with pytest.raises(ValueError, match=f"CPUs {outside} are not available to this process"):
        pin_process([available()[0], outside])
    if mine is not None:
        assert os.sched_getaffinity(0) == mine


ENGINE_PROBE = """
import os, torch
from mooncake.config import DummyModel, EngineSettings, Settings
from mooncake.serving.models import build_engine
engine = build_engine(Settings(engine=EngineSettings(
    model="dummy", dummy=DummyModel(layers=2, context=256), cpus="{cpus}")))
engine.prefill(list(range(10, 60)))  # torch's pool at work
masks = {{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}
print(torch.get_num_threads(), sorted(masks))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")
def test_an_engine_worker_runs_its_threads_on_its_cpus_only() -> None:
    """`engine.cpus` pins the worker as its engine is built, and sets torch's threads to
    their number where `engine.threads` is not set."""
    cpu = available()[-1]
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_PROBE.format(cpus=cpu)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == f"1 [({cpu},)]", out.stdout + out.stderr


def test_an_engine_on_cpus_it_cannot_have_is_refused_with_the_reason() -> None:
    from mooncake.engine.errors import EngineError
    from mooncake.serving.models import pin_engine

    outside = max(available()) + 1
    with pytest.raises(EngineError, match=f"engine.cpus {outside}: CPUs {outside} are not"):
        pin_engine(str(outside))
    assert pin_engine(None) == ()
