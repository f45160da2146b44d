"""`bench vs-vllm`'s pure parts: the workload, one run's figures, the peak search, the ratios."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.bench.vs_vllm_figures import (
    Answer,
    CpuUse,
    PeakSearch,
    Workload,
    asks,
    good,
    lone_figures,
    rate_of,
    run_figures,
    summary,
)
from mooncake.trace import TraceRequest

TRACE = [
    TraceRequest(0, 0.0, 1200, 500, (0, 1, 2)),
    TraceRequest(1, 1.0, 700, 3, (0, 3)),
    TraceRequest(2, 3.0, 9000, 40, tuple(range(10, 28))),
]


def test_the_workload_is_the_traces_prompts_cut_and_timed_by_the_speed() -> None:
    work = Workload(block_tokens=512, max_prompt=3000, max_output=64, vocab_size=1000)
    run = asks(TRACE, work, speed=0.5, seed=7)
    assert [a.at_s for a in run] == [0.0, 2.0, 6.0]
    assert [len(a.tokens) for a in run] == [1200, 700, 3000]
    assert [a.max_tokens for a in run] == [64, 3, 40]
    # Shared hash ids share their tokens; another seed shares none of them.
    assert run[0].tokens[:512] == run[1].tokens[:512]
    assert run[0].tokens[512:1024] != run[1].tokens[512:1024]
    other = asks(TRACE, work, speed=0.5, seed=8)
    assert other[0].tokens[:512] != run[0].tokens[:512]
    assert asks(TRACE, work, speed=0.5, seed=7) == run
    assert rate_of(TRACE, 0.5) == pytest.approx(3 / 6.0)
    with pytest.raises(ValueError):
        asks(TRACE, work, speed=0, seed=1)


def answer(sent: float, first: float | None, gaps: list[float], done: bool = True) -> Answer:
    chunks = [] if first is None else [first]
    for g in gaps:
        chunks.append(chunks[-1] + g)
    return Answer(
        sent_s=sent,
        prompt_tokens=100,
        first_s=first,
        chunk_s=chunks,
        end_s=chunks[-1] if chunks else sent,
        completed=done,
        tokens=len(chunks),
    )


def test_a_good_request_meets_both_slos() -> None:
    assert good(answer(0.0, 9.0, [0.1] * 20), 10.0, 0.2)
    assert not good(answer(0.0, 11.0, [0.1] * 20), 10.0, 0.2)  # late first token
    # Its p90 gap is what counts: 2 slow gaps of 20 pass, 3 do not.
    assert good(answer(0.0, 1.0, [0.1] * 18 + [0.5] * 2), 10.0, 0.2)
    assert not good(answer(0.0, 1.0, [0.1] * 17 + [0.5] * 3), 10.0, 0.2)
    assert not good(answer(0.0, 1.0, [0.1], done=False), 10.0, 0.2)
    assert good(answer(0.0, 1.0, []), 10.0, 0.2)  # one token: no gap to miss


def test_one_runs_figures() -> None:
    rejected = Answer(sent_s=2.0, prompt_tokens=100, end_s=2.1, rejected="ttft_slo")
    late = answer(1.0, 30.0, [0.05] * 4)
    answers = [answer(0.0, 1.0, [0.1] * 9), late, rejected]
    f = run_figures(answers, 10.0, 0.2, peak_pss=3 << 20)
    assert f["requests"] == 3 and f["completed"] == 2 and f["good"] == 1
    assert f["span_s"] == pytest.approx(30.2)
    assert f["goodput_rps"] == pytest.approx(1 / 30.2, abs=1e-4)
    assert f["rejected"] == 1 and f["rejected_by_reason"] == {"ttft_slo": 1}
    assert f["ttft_s"]["p50"] == 1.0 and f["ttft_s"]["p90"] == 29.0
    assert f["tbt_s"]["p90"] == pytest.approx(0.1)
    assert f["prompt_tok_s"] == pytest.approx(200 / 30.2, abs=0.1)
    assert f["peak_pss_mb"] == 3.0
    assert f["cpu_s"] is None and f["cpu_busy"] is None  # not measured
    cpu = CpuUse({"decode": 20.04, "prefill": 40.0}, window_s=40.0, cpus=2)
    with_cpu = run_figures(answers, 10.0, 0.2, None, cpu)
    assert with_cpu["cpu_s"] == {"decode": 20.0, "prefill": 40.0}
    assert with_cpu["cpu_busy"] == pytest.approx(0.75, abs=1e-3)  # 60 of 80 CPU-seconds
    assert CpuUse({}, 0.0, 2).busy() == 0.0
    from mooncake.bench.schema import RateRun

    for figures in (f, with_cpu):  # what `bench vs-vllm` prints per speed
        RateRun.model_validate({"speed": 0.2, "rate_rps": 0.8, **figures})


def test_the_lone_requests_decode_speed_counts_the_gaps_after_the_first_token() -> None:
    f = lone_figures(answer(0.0, 0.25, [0.02] * 127))
    assert f["ttft_s"] == 0.25 and f["decode_tok_s"] == pytest.approx(50.0)
    assert lone_figures(Answer(sent_s=0.0, prompt_tokens=1, rejected="x"))["decode_tok_s"] is None


def test_the_search_doubles_while_goodput_rises_and_halves_when_it_does_not() -> None:
    curve = {0.025: 0.05, 0.05: 0.08, 0.1: 0.1, 0.2: 0.12, 0.4: 0.03, 0.8: 0.0}
    s = PeakSearch(start=0.1, probes=6)
    while (x := s.next_speed()) is not None:
        s.record(x, curve[x])
    assert s.peak() == 0.2 and set(s.seen) == {0.1, 0.2, 0.4}
    down = PeakSearch(start=0.1, probes=6)
    falling = {0.025: 0.09, 0.05: 0.1, 0.1: 0.07, 0.2: 0.02}
    while (x := down.next_speed()) is not None:
        down.record(x, falling[x])
    assert down.peak() == 0.05 and set(down.seen) == {0.025, 0.05, 0.1, 0.2}


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.integers(1, 8))
def test_the_search_ends_within_its_probes_at_the_best_speed_it_saw(
    curve: list[float], probes: int
) -> None:
    s = PeakSearch(start=1.0, probes=probes)
    runs = 0
    while (x := s.next_speed()) is not None:
        s.record(x, curve[hash(x) % len(curve)])
        runs += 1
        assert runs <= probes
    assert s.seen[s.peak()] == max(s.seen.values())


def run(goodput: float, rejected: int = 0, tbt90: float | None = 0.1) -> dict[str, object]:
    return {"goodput_rps": goodput, "rejected": rejected, "requests": 60, "tbt_s": {"p90": tbt90}}


def test_the_top_level_ratios() -> None:
    rates = [
        {"speed": 0.1, "vllm": run(0.1), "mooncake": run(0.2, rejected=3, tbt90=0.09)},
        {"speed": 0.2, "vllm": run(0.05), "mooncake": run(0.06, tbt90=0.15)},
        {"speed": 0.4, "vllm": run(0.0), "mooncake": run(0.01)},
    ]
    lone = {
        "vllm": {"ttft_s": 0.25, "decode_tok_s": 26.0},
        "mooncake": {"ttft_s": 0.2, "decode_tok_s": 52.0},
    }
    top = summary(rates, lone, {"vllm": 4 << 30, "mooncake": 2 << 30})
    assert top["goodput_ratio_min"] == 1.2
    assert top["overload_goodput_positive"] is True
    assert top["lowest_rate_rejected_frac"] == 0.05
    assert top["lone_ttft_ratio"] == 0.8 and top["lone_decode_ratio"] == 2.0
    assert top["pss_ratio"] == 0.5 and top["tbt_p90_s_max"] == 0.15
    rates[2]["mooncake"] = run(0.0)
    assert summary(rates, lone, {})["overload_goodput_positive"] is False
    assert summary(rates, lone, {})["pss_ratio"] is None


def test_the_watch_counts_each_roles_cpu_seconds_between_two_takes() -> None:
    """A busy child of the watched process, started as a worker is (`... worker prefill`):
    its CPU seconds over the window are the prefill role's."""
    import subprocess
    import sys
    import time

    import psutil

    from mooncake.bench.vs_vllm import PssWatch, process_role

    busy = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
    child = f"[sys.executable, '-c', {busy!r}, 'worker', 'prefill']"
    spawn = f"import subprocess, sys; subprocess.run({child})"
    root = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        with PssWatch(root.pid, interval_s=0.1) as watch:
            time.sleep(1.0)  # the child is up and sampled
            watch.take_cpu()
            time.sleep(1.5)
            by_role, window = watch.take_cpu()
        assert window == pytest.approx(1.5, abs=0.3)
        assert 0.3 < by_role["prefill"] <= window + 0.2  # one busy thread: at most a CPU
        parent = process_role(psutil.Process(root.pid))
        assert parent != "prefill" and by_role.get(parent, 0.0) < 0.2  # it only waits
    finally:
        root.kill()
        root.wait()
