"""Segments: sizes, files (name, mode, place), pre-touching, flush and cleanup."""

from __future__ import annotations

import mmap
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.store import segment as segment_module
from mooncake.store.segment import Segment, file_holds, sweep_stale
from mooncake.store.types import Tier


def test_dram_segment_file_and_view(tmp_path: Path) -> None:
    seg = Segment.create_dram("node/1 dram:0", "node1", 10_000, shm_dir=tmp_path)
    try:
        assert seg.info.size == 3 * mmap.PAGESIZE  # rounded up to whole pages
        assert seg.info.tier is Tier.DRAM and seg.info.node_id == "node1"
        assert seg.info.endpoints == {}
        assert len(seg.buf) == seg.info.size and not seg.buf.readonly and seg.buf.format == "B"
        assert seg.path.parent == tmp_path
        name = seg.path.name
        assert name.startswith(f"mc-node_1_dram_0-p{os.getpid()}-")
        assert len(name.rsplit("-", 1)[1]) == 32
        assert file_holds(name, "node/1 dram:0") and not file_holds(name, "node1")
        assert stat.S_IMODE(seg.path.stat().st_mode) == 0o600
        seg.buf[-5:] = b"hello"
        assert seg.path.read_bytes()[-5:] == b"hello"  # MAP_SHARED: the file is the memory
    finally:
        seg.close()
    assert not seg.path.exists()
    seg.close()  # idempotent


def test_default_dram_lives_in_dev_shm() -> None:
    seg = Segment.create_dram("x", "n", 4096)
    try:
        assert seg.path.parent == Path("/dev/shm")
    finally:
        seg.close()


def test_two_segments_of_one_id_get_distinct_files(tmp_path: Path) -> None:
    a = Segment.create_dram("same", "n", 4096, shm_dir=tmp_path)
    b = Segment.create_dram("same", "n", 4096, shm_dir=tmp_path)
    assert a.path != b.path
    a.close()
    b.close()


def test_pretouch_fallback_touches_every_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segment_module, "MADV_POPULATE_WRITE", 10_000)  # madvise fails
    seg = Segment.create_dram("fallback", "n", 64 * mmap.PAGESIZE, shm_dir=tmp_path)
    try:
        assert seg.path.stat().st_blocks * 512 >= seg.info.size
    finally:
        seg.close()


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_sizes(size: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Segment.create_dram("bad", "n", size, shm_dir=tmp_path)  # type: ignore[arg-type]


def test_empty_segment_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Segment.create_dram("", "n", 4096, shm_dir=tmp_path)


def test_ssd_segment(tmp_path: Path) -> None:
    seg = Segment.create_ssd("n1-ssd", "n1", 1 << 20, tmp_path / "ssd")
    try:
        assert seg.info.tier is Tier.SSD and seg.path.parent == tmp_path / "ssd"
        seg.buf[5000:5010] = b"0123456789"
        seg.flush(5000, 10)
        assert seg.path.read_bytes()[5000:5010] == b"0123456789"
        with pytest.raises(ValueError):
            seg.flush(seg.info.size - 1, 2)
    finally:
        seg.close(unlink=False)
    assert seg.path.exists()  # kept when asked to
    seg.path.unlink()


def test_close_with_live_views_does_not_crash(tmp_path: Path) -> None:
    seg = Segment.create_dram("views", "n", 4096, shm_dir=tmp_path)
    view = seg.buf[0:10]
    seg.close()
    assert not seg.path.exists()
    view[0] = 1  # the mapping outlives the name while a view holds it
    view.release()


def test_exit_cleanup_unlinks_unclosed(tmp_path: Path) -> None:
    seg = Segment.create_dram("left-open", "n", 4096, shm_dir=tmp_path)
    segment_module._unlink_leftovers()
    assert not seg.path.exists()
    seg.close()


def test_sweep_removes_only_files_of_dead_processes(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    token = "0" * 32
    stale = tmp_path / f"mc-n1-dram-p{dead_pid}-{token}"
    mine = tmp_path / f"mc-n1-dram-p{os.getpid()}-{token}"
    live = tmp_path / f"mc-n2-dram-p1-{token}"
    other = tmp_path / "not-ours"
    for f in (stale, mine, live, other):
        f.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [stale]
    assert not stale.exists() and mine.exists() and live.exists() and other.exists()
