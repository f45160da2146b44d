"""How fast a store node's SSD directory reads KV blocks back (`mooncake profile ssd`).

The Conductor charges a block held only on SSD this speed (`conductor.ssd_read_bytes_per_s`,
core/cost_model.py `Costs.ssd`). The probe writes a file of `size` bytes, syncs it, asks the
kernel to drop it from the page cache (`posix_fadvise(DONTNEED)`) and reads it back in chunks
of one KV block, as a node serving an offloaded block does. Where the directory is not on a
block device (tmpfs, overlay on RAM) the cache cannot be dropped and the figure is memory's:
`filesystem` says what the directory is on, so the reader can tell.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SsdProbe:
    directory: str
    filesystem: str
    size_bytes: int
    chunk_bytes: int
    read_s: float

    @property
    def read_bytes_per_s(self) -> float:
        return self.size_bytes / self.read_s


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on (from /proc/mounts; "unknown" elsewhere)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    best, fstype = "", "unknown"
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return fstype


def probe_ssd(directory: Path, size_bytes: int = 256 << 20, chunk_bytes: int = 1 << 20) -> SsdProbe:
    """Write, sync, drop from cache and read back `size_bytes` in `chunk_bytes` reads."""
    if size_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError("size and chunk must be positive")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".mooncake-ssd-probe-{os.getpid()}"
    chunk = os.urandom(min(chunk_bytes, size_bytes))
    try:
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
        try:
            written = 0
            while written < size_bytes:
                written += os.write(fd, chunk[: size_bytes - written])
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, size_bytes, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            read = 0
            while read < size_bytes:
                got = os.pread(fd, chunk_bytes, read)
                if not got:
                    break
                read += len(got)
            elapsed = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return SsdProbe(str(directory), filesystem_of(directory), read, chunk_bytes, max(elapsed, 1e-9))
