"""A node's memory: one contiguous, preallocated region per segment.

DRAM segments live in POSIX shared memory (a file in /dev/shm) so that a client on the same
host can map the very same pages (the `shm` transport) while remote clients reach them over
tcp or rdma. The pages are allocated and touched up front: the hot path (a transfer landing
in the segment) must never take a page fault or fail for lack of memory halfway through.

SSD segments are a file in a directory of the node's choice, mapped the same way but not
pre-touched (the kernel pages them in and out; `flush` makes a written range durable).

File names derive from the segment id (sanitised) plus a random 128-bit token, never from an
object key: the name is unguessable, which together with mode 0600 is what guards the shm
transport (see `mooncake.store.transfer.shm`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import re
import secrets
import threading
from pathlib import Path

from mooncake.store.types import SegmentInfo, Tier

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

# Files of segments not yet closed: removed at interpreter exit, so that a test that fails
# without closing its segments does not leave /dev/shm full (SIGKILL cannot be covered).
_live_files: set[Path] = set()
_live_lock = threading.Lock()
# This process's own DRAM segments by backing file: the shm transport copies through the
# segment's mapping instead of mapping the file a second time (every page of a second
# mapping is counted again in the process's RSS, and its page tables are a second copy).
_own_mappings: dict[Path, mmap.mmap] = {}


@atexit.register
def _unlink_leftovers() -> None:
    with _live_lock:
        paths = list(_live_files)
        _live_files.clear()
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def page_round(size: int) -> int:
    """`size` rounded up to a whole number of pages; ValueError unless it is a positive int."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"segment size must be an int, got {type(size).__name__}")
    if size <= 0:
        raise ValueError(f"segment size must be > 0, got {size}")
    return -(-size // PAGE) * PAGE


def _safe(segment_id: str) -> str:
    return _UNSAFE.sub("_", segment_id)[:64]


def file_name(segment_id: str) -> str:
    """A backing file name: the sanitised segment id, the owner's pid (so files of a process
    that was killed can be found and swept, see `sweep_stale`) and a random 128-bit token."""
    if not segment_id:
        raise ValueError("segment id must not be empty")
    return f"mc-{_safe(segment_id)}-p{os.getpid()}-{secrets.token_hex(16)}"


def file_holds(name: str, segment_id: str) -> bool:
    """Whether a backing file called `name` can be segment `segment_id`'s."""
    pattern = rf"mc-{re.escape(_safe(segment_id))}-p[0-9]+-[0-9a-f]{{32}}"
    return re.fullmatch(pattern, name) is not None


_OWNER = re.compile(r"mc-.+-p([0-9]+)-[0-9a-f]{32}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale(directory: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink segment files of ours whose owning process is gone (killed with -9: no exit
    handler ran). Only files of this user whose recorded pid no longer exists are touched."""
    swept: list[Path] = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = _OWNER.fullmatch(entry.name)
            if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == uid and entry.is_file(
                    follow_symlinks=False
                ):
                    os.unlink(entry.path)
                    swept.append(Path(entry.path))
    return swept


class Segment:
    """One mapped segment. `buf` is a writable, flat 'B' view of exactly `info.size` bytes."""

    info: SegmentInfo
    buf: memoryview
    path: Path

    def __init__(self, info: SegmentInfo, path: Path, mm: mmap.mmap) -> None:
        self.info = info
        self.path = path
        self._mmap = mm
        self.buf = memoryview(mm)
        self._closed = False

    @classmethod
    def create_dram(
        cls, segment_id: str, node_id: str, size: int, *, shm_dir: Path = Path("/dev/shm")
    ) -> Segment:
        size = page_round(size)
        path = Path(shm_dir) / file_name(segment_id)
        mm = _create_mapping(path, size)
        _pretouch(mm, size)
        with _live_lock:
            _own_mappings[path] = mm
        return cls(SegmentInfo(segment_id, node_id, Tier.DRAM, size), path, mm)

    @classmethod
    def create_ssd(cls, segment_id: str, node_id: str, size: int, directory: Path) -> Segment:
        size = page_round(size)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / file_name(segment_id)
        mm = _create_mapping(path, size)
        return cls(SegmentInfo(segment_id, node_id, Tier.SSD, size), path, mm)

    def flush(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) durable (SSD tier); DRAM has nothing to flush."""
        if self.info.tier is Tier.DRAM or length == 0:
            return
        if offset < 0 or length < 0 or offset + length > self.info.size:
            raise ValueError(f"flush range {offset}+{length} outside segment of {self.info.size}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # msync wants an aligned start
        self._mmap.flush(start, offset + length - start)

    def close(self, *, unlink: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        with _live_lock:
            _own_mappings.pop(self.path, None)
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view of the segment: the mapping stays until they drop it
            # (the kernel frees the pages then), but the name is gone below all the same.
            log.warning("segment %s closed while views of it are alive", self.info.segment_id)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with _live_lock:
            _live_files.discard(self.path)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        i = self.info
        return f"Segment({i.segment_id!r}, node={i.node_id!r}, {i.tier}, {i.size} B, {self.path})"


def own_mapping(path: Path) -> mmap.mmap | None:
    """The mapping of this process's own open DRAM segment backed by `path`, if it is one."""
    with _live_lock:
        return _own_mappings.get(path)


def _create_mapping(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with _live_lock:
        _live_files.add(path)
    try:
        os.ftruncate(fd, size)
        try:
            # Reserve the blocks now: a full tmpfs / disk fails here, not in the middle of a put.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: filesystem cannot, go on
                raise
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        with _live_lock:
            _live_files.discard(path)
        raise
    finally:
        os.close(fd)


def _pretouch(mm: mmap.mmap, size: int) -> None:
    """Fault every page in writable now, so that transfers never page-fault later."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, size)
        return
    except (OSError, ValueError):
        pass
    import numpy as np  # one strided store per page, in C (a Python loop is ~100x slower)

    pages = np.frombuffer(mm, dtype=np.uint8)
    pages[::PAGE] = 0
    del pages
