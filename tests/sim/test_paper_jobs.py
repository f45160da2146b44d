"""`run_paper` in two processes gives the numbers it gives in one (every run is a pure
function of its trace and configuration), and the result says how many ran."""

from __future__ import annotations

from pathlib import Path

from mooncake.sim.paper import run_paper

from helpers import small_traces


def test_two_processes_give_the_same_numbers_as_one(tmp_path: Path) -> None:
    small_traces(tmp_path, 80)
    heard: list[str] = []
    one, one_samples = run_paper(tmp_path, quick=True, jobs=1)
    two, two_samples = run_paper(tmp_path, quick=True, jobs=2, log=heard.append)
    assert (one.pop("jobs"), two.pop("jobs")) == (1, 2)
    one.pop("elapsed_s"), two.pop("elapsed_s")
    assert one == two and one_samples == two_samples
    assert one["requests"] == {"conversation": 80, "synthetic": 80}
    # The half run in this process logs here; the forked one's lines go to its own copy.
    assert any(line.startswith("capacity") for line in heard), heard
