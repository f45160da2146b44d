"""The pure pieces of `mooncake bench memory` on made-up records and processes, so that each
of its checks is seen to fail: terminal events counted exactly once, goodput held to the
SLO, bounds for engine roles only, OOM kills from either source, the supervisor's pass,
the process-tree RSS and the cgroup counter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from mooncake import memory
from mooncake.bench import memwatch
from mooncake.bench.memory import oom_figures, request_figures, role_figures, within_bound
from mooncake.bench.record import Record
from mooncake.config import SLO
from mooncake.supervise import Exit, restart_exited

SLO_ = SLO(ttft_s=2.0, tbt_s=0.1)


def completed(ttft: float, tbt: float | None) -> tuple[str, dict[str, object]]:
    return ("request.completed", {"ttft_s": ttft, "tbt_s": tbt, "output_tokens": 3})


def test_request_figures_count_each_end_and_find_what_did_not_end_once() -> None:
    record: Record = {
        "a": [("request.admitted", {}), completed(1.0, 0.05)],
        "b": [completed(3.0, 0.05)],  # TTFT over the SLO
        "c": [completed(1.0, None)],  # one token: no TBT, within
        "d": [("request.rejected", {"reason": "ttft_slo"})],
        "e": [("request.failed", {"reason": "decode_error"}), completed(1.0, 0.05)],
        "f": [("request.rejected", {"reason": "made_up"})],
    }
    ids = ["a", "b", "c", "d", "e", "f", "g"]  # g: nothing recorded
    out = request_figures(ids, record, {"a": 2, "c": 1}, SLO_, wall_s=10.0)
    assert (out["requests"], out["completed"], out["rejected"], out["failed"]) == (7, 4, 2, 0)
    assert out["unended"] == 1 and out["preemptions"] == 3 and out["preempted_requests"] == 2
    assert out["terminal_exactly_once"] is False and out["terminal_violations"] == ["e", "g"]
    assert out["rejected_by_reason"] == {"ttft_slo": 1, "made_up": 1}
    assert out["rejections_have_reasons"] is False
    assert out["throughput_req_s"] == 0.4
    assert out["goodput_req_s"] == 0.3  # a, c, e: b's TTFT is over


def test_ttft_over_its_prediction_at_admission() -> None:
    record: Record = {
        "a": [
            ("request.submitted", {}),
            ("request.admitted", {"predicted_ttft_s": 0.5}),
            completed(1.0, 0.05),
        ],
        "b": [("request.admitted", {"predicted_ttft_s": 2.0}), completed(1.0, 0.05)],
        "c": [("request.admitted", {"predicted_ttft_s": 1.0}), completed(4.0, 0.05)],
        "d": [("request.admitted", {}), completed(1.0, 0.05)],  # no prediction: left out
        "e": [("request.admitted", {"predicted_ttft_s": 1.0}), ("request.failed", {})],
    }
    out = request_figures(list(record), record, {}, SLO_, wall_s=1.0)
    assert out["ttft_over_predicted"] == {"p50": 2.0, "p90": 4.0, "n": 3}


def test_every_request_once_passes() -> None:
    record: Record = {
        "a": [completed(1.0, 0.5)],
        "b": [("request.rejected", {"reason": "no_instance"})],
    }
    out = request_figures(["a", "b"], record, {}, SLO_, wall_s=4.0)
    assert out["terminal_exactly_once"] and out["rejections_have_reasons"]
    assert out["goodput_req_s"] == 0.0 and out["throughput_req_s"] == 0.25  # a's TBT is over


def test_within_slo_at_each_of_the_papers_tbt_limits() -> None:
    record: Record = {
        "fast": [completed(1.0, 0.08)],
        "ii": [completed(1.0, 0.15)],
        "iii": [completed(1.0, 0.25)],
        "slow": [completed(1.0, 0.5)],
        "late": [completed(3.0, 0.05)],  # TTFT over: within none
    }
    out = request_figures(list(record), record, {}, SLO_, wall_s=1.0)
    assert out["within_slo"] == 1 and out["within_ttft_slo"] == 4
    assert out["within_slo_by_tbt_limit_s"] == {"0.1": 1, "0.2": 2, "0.3": 3}


def test_only_engine_roles_have_a_bound() -> None:
    mib = memory.MIB
    roles = role_figures(
        {"prefill-0": 700 * mib, "decode-1": 900 * mib, "conductor-0": 5000 * mib},
        weights_bytes=100 * mib,
        kv_budget_bytes=200 * mib,
    )
    assert roles["prefill-0"] == {"peak_rss_mb": 700.0, "bound_mb": 900.0,
                                  "stated_bound_mb": 900.0}  # fmt: skip
    with_segment = role_figures({"decode-0": 1000 * mib}, 100 * mib, 200 * mib, None, 256 * mib)
    assert with_segment["decode-0"]["stated_bound_mb"] == 1156.0  # its store segment too
    assert not within_bound(with_segment["decode-0"])  # 1000 > 900: issue 15's formula
    assert within_bound(with_segment["decode-0"], bound_key="stated_bound_mb")
    assert roles["conductor-0"]["bound_mb"] is None
    parts = {"decode-1": {"anon": 600 * mib, "shmem": 256 * mib}}
    with_parts = role_figures({"decode-1": 900 * mib}, 100 * mib, 200 * mib, parts)
    assert with_parts["decode-1"]["peak_anon_mb"] == 600.0
    assert with_parts["decode-1"]["peak_shmem_mb"] == 256.0
    private = {"decode-1": {"private": 800 * mib, "shmem": 900 * mib}}
    over_by_segments = role_figures({"decode-1": 1700 * mib}, 100 * mib, 200 * mib, private)
    assert not within_bound(over_by_segments["decode-1"])  # RSS 1700 > 900
    assert within_bound(over_by_segments["decode-1"], "peak_private_mb")  # 800 <= 900
    assert not within_bound(with_parts["decode-1"], "peak_private_mb")  # not sampled: fails
    assert [within_bound(r) for r in roles.values()] == [True, True, True]
    assert not within_bound({"peak_rss_mb": 900.1, "bound_mb": 900.0})


def test_oom_kills_are_the_larger_of_sigkills_and_the_cgroup_count() -> None:
    killed = Exit("decode-0", "decode", -signal.SIGKILL, 1.0)
    crashed = Exit("prefill-0", "prefill", 1, 2.0)
    assert oom_figures([killed, crashed], None)["oom_kills"] == 1
    out = oom_figures([killed], 3)
    assert out["oom_kills"] == 3 and out["oom_kills_source"] == "cgroup memory.events"
    assert oom_figures([crashed], 0)["oom_kills"] == 0


@dataclass
class FakeWorker:
    name: str
    role: str
    code: int | None

    @property
    def running(self) -> bool:
        return self.code is None

    @property
    def proc(self) -> FakeWorker:
        return self

    @property
    def returncode(self) -> int | None:
        return self.code


@dataclass
class FakeStack:
    workers: list[FakeWorker]
    restarted: list[str] = field(default_factory=list)

    def restart(self, w: FakeWorker) -> None:
        self.workers.remove(w)
        self.workers.append(FakeWorker(w.name, w.role, None))
        self.restarted.append(w.name)


def test_the_supervisor_restarts_what_exited_and_says_how() -> None:
    stack = FakeStack(
        [FakeWorker("decode-0", "decode", -9), FakeWorker("prefill-0", "prefill", None)]
    )
    exits = restart_exited(stack)  # type: ignore[arg-type]
    assert [(e.name, e.returncode, e.killed) for e in exits] == [("decode-0", -9, True)]
    assert stack.restarted == ["decode-0"] and all(w.running for w in stack.workers)
    assert restart_exited(stack) == []  # type: ignore[arg-type]


def test_tree_rss_counts_children() -> None:
    code = "import time; b = b'x' * (64 << 20); print(flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the child holds its 64 MiB now
        tree = memwatch.tree_rss({"me": os.getpid(), "gone": 2**22 + 7})
        assert tree["me"] >= psutil.Process().memory_info().rss + (60 << 20)
        assert "gone" not in tree
        parts = memwatch.rss_parts(child.pid)
        assert parts["anon"] >= 60 << 20 and set(parts) == {"anon", "file", "shmem", "private"}
        assert parts["private"] == parts["anon"] + parts["file"]
        assert memwatch.rss_parts(2**22 + 7) == {}
        pss = memwatch.pss_bytes(child.pid)
        assert pss is not None and pss >= 60 << 20
        assert memwatch.pss_bytes(2**22 + 7) is None
    finally:
        child.kill()
        child.wait()


def test_a_mapped_shared_segment_is_in_rss_but_not_in_what_the_process_holds_itself() -> None:
    """The store's segments an engine worker maps count in its RSS (RssShmem) once per mapper;
    `private` (what `bench memory`'s bound check reads) leaves them out."""
    code = (
        "from multiprocessing import shared_memory as s; m = s.SharedMemory(create=True,"
        " size=64 << 20); m.buf[:] = b'x' * (64 << 20); print(flush=True); import time;"
        " time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the segment is written (and a 64 MiB bytes object freed)
        parts = memwatch.rss_parts(child.pid)
        assert parts["shmem"] >= 60 << 20
        assert parts["private"] < psutil.Process(child.pid).memory_info().rss - (60 << 20)
    finally:
        child.kill()
        child.wait()


def test_cgroup_oom_kills_reads_cgroup_v2_and_gives_up_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memwatch, "CGROUP_ROOT", tmp_path)
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "memory.events").write_text("low 0\nhigh 2\nmax 5\noom 3\noom_kill 2\n")
    v2 = tmp_path / "cgroup"
    v2.write_text("0::/svc\n")
    assert memwatch.cgroup_oom_kills(v2) == 2
    v1 = tmp_path / "cgroup-v1"
    v1.write_text("4:memory:/svc\n1:cpu:/\n")
    assert memwatch.cgroup_oom_kills(v1) is None
    assert memwatch.cgroup_oom_kills(tmp_path / "missing") is None


def test_the_stack_hands_its_admission_policy_and_cost_profile_to_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench memory --admission-policy/--cost-profile` (settings built over the environment)
    reach the Conductor the stack starts, whatever the environment says."""
    from mooncake.config import Settings
    from mooncake.stack import Stack

    monkeypatch.setenv("MOONCAKE_ADMISSION_POLICY", "none")
    monkeypatch.delenv("MOONCAKE_CONDUCTOR__COST_PROFILE", raising=False)
    profile = tmp_path / "profile.json"
    env = Stack(
        Settings(data_dir=tmp_path, admission_policy="early", conductor={"cost_profile": profile})
    ).child_env()
    assert env["MOONCAKE_ADMISSION_POLICY"] == "early"
    assert env["MOONCAKE_CONDUCTOR__COST_PROFILE"] == str(profile.resolve())
    assert "MOONCAKE_CONDUCTOR__COST_PROFILE" not in Stack(Settings(data_dir=tmp_path)).child_env()


def test_control_plane_roles_have_the_bound_they_state_from_their_limits() -> None:
    from mooncake.bus.consume import window_bytes
    from mooncake.config import ConductorSettings, GatewaySettings, Settings, StoreSettings

    mib = memory.MIB
    s = Settings(
        gateway=GatewaySettings(max_inflight=100, max_inflight_body_bytes=2 * mib),
        conductor=ConductorSettings(max_inflight=1000, max_index_keys=10_000),
        store=StoreSettings(max_objects=5000, journal_max=100),
    )
    base, window = memory.CONTROL_ALLOWANCE, window_bytes(s.bus)
    conductor = memory.control_parts("conductor", s)
    assert conductor["inflight"] == 1000 * 768 and conductor["index"] == 2 * 10_000 * 128
    assert conductor["consumers"] == 2 * window and conductor["runtime"] == base
    assert conductor["reaping"] == 16 * s.bus.max_event_bytes
    gateway = memory.control_parts("gateway", s)
    assert gateway["inflight"] == 100 * 24 * 1024 and gateway["bodies"] == 2 * mib * 28
    assert memory.control_parts("recorder", s) == {"runtime": base, "consumers": 3 * window}
    assert memory.control_parts("store_master", s)["objects"] == 5000 * 1600
    # Each limit moves the bound by what it holds: twice the requests, 768 B more each.
    more = s.model_copy(
        update={"conductor": ConductorSettings(max_inflight=2000, max_index_keys=10_000)}
    )
    assert (
        memory.control_bound_bytes("conductor", more) - memory.control_bound_bytes("conductor", s)
        == 1000 * 768
    )
    with pytest.raises(ValueError, match="no control-plane role"):
        memory.control_parts("prefill", s)

    peaks = {"conductor-0": 300 * mib, "store-master-0": 200 * mib, "store-node-0": 50 * mib}
    roles = role_figures(peaks, 100 * mib, 200 * mib, settings=s)
    stated = memory.control_bound_bytes("store_master", s) / mib
    assert roles["store-master-0"]["bound_mb"] == roles["store-master-0"]["stated_bound_mb"]
    assert roles["store-master-0"]["bound_mb"] == round(stated, 1)
    assert roles["store-node-0"]["bound_mb"] is None  # no role of its own here
    assert within_bound(roles["conductor-0"])
    assert not within_bound({**roles["conductor-0"], "peak_rss_mb": 10_000.0})
