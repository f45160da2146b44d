"""`mooncake profile ssd`: the probe reads back what it wrote and leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli import app
from mooncake.store.ssd_probe import filesystem_of, probe_ssd


def test_the_probe_reads_back_every_byte_and_removes_its_file(tmp_path: Path) -> None:
    probe = probe_ssd(tmp_path / "ssd", size_bytes=3 << 20, chunk_bytes=256 << 10)
    assert probe.size_bytes == 3 << 20 and probe.chunk_bytes == 256 << 10
    assert probe.read_s > 0 and probe.read_bytes_per_s == probe.size_bytes / probe.read_s
    assert list((tmp_path / "ssd").iterdir()) == []
    with pytest.raises(ValueError):
        probe_ssd(tmp_path, size_bytes=0)


def test_the_filesystem_is_the_deepest_mount_holding_the_path() -> None:
    assert filesystem_of(Path("/proc/self")) == "proc"


def test_profile_ssd_prints_the_setting(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["profile", "ssd", "--dir", str(tmp_path), "--size-mib", "2",
                                   "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["size_bytes"] == 2 << 20 and doc["ssd_read_bytes_per_s"] > 0
    assert doc["setting"].startswith("MOONCAKE_CONDUCTOR__SSD_READ_BYTES_PER_S=")
