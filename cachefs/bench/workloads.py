"""Read workloads against any directory: sequential, random pread, small-file walk and read-all.

Every workload is bounded by a byte or count budget *and* a time limit, and
returns a plain dataclass (`.as_dict()` for JSON). The training-like loader
lives in `loader.py`.

Dataset layout convention (what `cachefs bench` builds): `shards/*.bin`
are the large files, `small/<dir>/<file>` the small ones. Any other tree
works too: files of at least `LARGE_FILE_MIN_BYTES` count as large, the
rest as small.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
LARGE_FILE_MIN_BYTES = 8 * MiB
# 1 MiB: the largest read the kernel sends a FUSE daemon, and what `cat` or
# a framework's sequential reader typically asks for.
SEQUENTIAL_READ_BYTES = 1 * MiB
# The groups the large files are dealt into, one per workload, so that on a
# cold cache no workload reads what an earlier one already fetched.
LARGE_FILE_GROUPS = ("seq1", "seq4", "random", "loader")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A regular file of the dataset and its size."""

    path: str
    size_bytes: int


@dataclasses.dataclass
class Dataset:
    """The files a benchmark reads, found by layout convention."""

    root: Path
    large: list[FileEntry]
    small: list[FileEntry]
    small_root: Path  # what the tree walk stats

    def large_group(self, name: str) -> list[FileEntry]:
        """The large files dealt to one workload (round robin); all of them if there are too few to share out."""
        if len(self.large) < len(LARGE_FILE_GROUPS):
            return list(self.large)
        index = LARGE_FILE_GROUPS.index(name)
        return self.large[index :: len(LARGE_FILE_GROUPS)]


def _regular_files(root: Path) -> list[FileEntry]:
    """Regular files below `root`, never following symlinks, sorted by path."""
    found: list[FileEntry] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                found.append(FileEntry(path, info.st_size))
    return found


def find_dataset(root: Path, with_small: bool = True) -> Dataset:
    """Large and small files of `root`: `shards/*.bin` and `small/` if present, else split by size.

    `with_small=False` skips listing the small files where the layout allows (a slow listing on some
    filesystems).
    """
    root = Path(root)
    shards_dir, small_dir = root / "shards", root / "small"
    shards = sorted(path for path in shards_dir.glob("*.bin") if path.is_file()) if shards_dir.is_dir() else []
    if shards:
        large = [FileEntry(str(path), path.stat().st_size) for path in shards]
    else:  # also a shards/ of other files (WebDataset's .tar): by size
        large = [entry for entry in _regular_files(root) if entry.size_bytes >= LARGE_FILE_MIN_BYTES]
    if small_dir.is_dir():
        small, small_root = (_regular_files(small_dir) if with_small else []), small_dir
    else:
        small = [entry for entry in _regular_files(root) if entry.size_bytes < LARGE_FILE_MIN_BYTES]
        small_root = root
    log.info("dataset %s: %d large files (%d bytes), %d small files", root, len(large),
             sum(entry.size_bytes for entry in large), len(small))
    return Dataset(root, large, small, small_root)


# -- results ----------------------------------------------------------------------


@dataclasses.dataclass
class ThroughputResult:
    """Bytes moved in a wall time."""

    threads: int
    files: int
    bytes_read: int
    wall_s: float
    complete: bool  # False if the time limit cut it short
    errors: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.wall_s / 1e6 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mb_per_s": self.mb_per_s}


@dataclasses.dataclass
class LatencyResult:
    """Per-read latencies of single-threaded preads of one size."""

    read_bytes: int
    reads: int
    bytes_read: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    complete: bool
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class WalkResult:
    """A recursive walk that lstat()s every entry."""

    entries: int
    files: int
    wall_s: float
    complete: bool
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of `values` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


# -- sequential -------------------------------------------------------------------


def _read_whole_file(path: str, buffer: bytearray, deadline: float) -> tuple[int, bool]:
    """Read `path` to the end in buffer-sized reads; (bytes, finished before the deadline)."""
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as stream:
        while True:
            count = stream.readinto(view)
            if not count:
                return total, True
            total += count
            if time.monotonic() > deadline:
                return total, False


DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_page_cache() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def drop_page_cache(*, names_too: bool = True) -> bool:
    """`sync; echo 3 > /proc/sys/vm/drop_caches` (root only), so that the next reads start as on a
    node that has not read these files since boot; without `names_too`, `echo 1`: the file data
    only, the directory entries and inodes a listing brought in stay. False if not permitted."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as control:
            control.write("3\n" if names_too else "1\n")
        return True
    except OSError as exc:
        log.warning("cannot drop the page cache: %s", exc)
        return False


def machine_cpu_seconds() -> tuple[float, float] | None:
    """The whole machine's CPU seconds so far, all cores and every process (/proc/stat):
    (busy, idle); None where that is not readable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait; the rest of user nice system idle iowait irq softirq steal is busy
    return (sum(fields) - idle) / ticks, idle / ticks


def sequential_read(files: Sequence[FileEntry], threads: int, time_limit_s: float,
                    chunk_bytes: int = SEQUENTIAL_READ_BYTES) -> ThroughputResult:
    """Read whole files front to back, `threads` files at a time, until done or `time_limit_s`."""
    pending: queue.SimpleQueue[FileEntry] = queue.SimpleQueue()
    for entry in files:
        pending.put(entry)
    lock = threading.Lock()
    totals = {"bytes": 0, "errors": 0, "cut": 0}
    start = time.monotonic()
    deadline = start + time_limit_s

    def reader() -> None:
        buffer = bytearray(chunk_bytes)
        while time.monotonic() <= deadline:
            try:
                entry = pending.get_nowait()
            except queue.Empty:
                return
            try:
                count, finished = _read_whole_file(entry.path, buffer, deadline)
            except OSError as exc:
                log.warning("sequential read of %s failed: %s", entry.path, exc)
                count, finished = 0, True
                with lock:
                    totals["errors"] += 1
            with lock:
                totals["bytes"] += count
                totals["cut"] += not finished

    workers = [threading.Thread(target=reader, name=f"seq-{index}") for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall_s = time.monotonic() - start
    complete = pending.empty() and not totals["cut"]
    # A thread reads one file at a time: fewer files than threads leave some idle.
    return ThroughputResult(min(threads, len(files)), len(files), totals["bytes"], wall_s, complete, totals["errors"])


# -- random pread -----------------------------------------------------------------


def random_offsets(files: Sequence[FileEntry], read_bytes: int, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` (file index, offset) pairs, uniform over the bytes of `files`, aligned to `read_bytes`."""
    rng = random.Random(seed)
    slots = [max(0, entry.size_bytes // read_bytes) for entry in files]
    total_slots = sum(slots)
    if total_slots == 0:
        return []
    picks: list[tuple[int, int]] = []
    for _ in range(count):
        slot = rng.randrange(total_slots)
        for index, file_slots in enumerate(slots):
            if slot < file_slots:
                picks.append((index, slot * read_bytes))
                break
            slot -= file_slots
    return picks


def random_pread(files: Sequence[FileEntry], read_bytes: int, count: int, time_limit_s: float,
                 seed: int = 0) -> LatencyResult:
    """Single-threaded preads of `read_bytes` at random aligned offsets (queue depth 1)."""
    picks = random_offsets(files, read_bytes, count, seed)
    fds: dict[int, int] = {}
    latencies_s: list[float] = []
    bytes_read = errors = 0
    start = time.monotonic()
    deadline = start + time_limit_s
    try:
        for file_index, offset in picks:
            if time.monotonic() > deadline:
                break
            try:
                fd = fds.get(file_index)
                if fd is None:
                    fd = fds[file_index] = os.open(files[file_index].path, os.O_RDONLY)
                began = time.perf_counter()
                data = os.pread(fd, read_bytes, offset)
                latencies_s.append(time.perf_counter() - began)
                bytes_read += len(data)
            except OSError as exc:
                log.warning("pread of %s at %d failed: %s", files[file_index].path, offset, exc)
                errors += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    wall_s = time.monotonic() - start
    millis = [value * 1000 for value in latencies_s]
    return LatencyResult(
        read_bytes=read_bytes,
        reads=len(latencies_s),
        bytes_read=bytes_read,
        wall_s=wall_s,
        p50_ms=percentile(millis, 0.50),
        p99_ms=percentile(millis, 0.99),
        mean_ms=sum(millis) / len(millis) if millis else 0.0,
        max_ms=max(millis, default=0.0),
        complete=len(latencies_s) + errors == len(picks),
        errors=errors,
    )


# -- small files ------------------------------------------------------------------


def tree_walk(root: Path, time_limit_s: float) -> WalkResult:
    """Walk `root` depth first and lstat() every entry, like `find -ls` or a dataset index scan."""
    entries = files = errors = 0
    start = time.monotonic()
    deadline = start + time_limit_s
    stack = [str(root)]
    complete = True
    while stack:
        if time.monotonic() > deadline:
            complete = False
            break
        directory = stack.pop()
        try:
            with os.scandir(directory) as scan:
                children = list(scan)
        except OSError as exc:
            log.warning("cannot list %s: %s", directory, exc)
            errors += 1
            continue
        for child in children:
            try:
                info = os.lstat(child.path)
            except OSError as exc:
                log.warning("cannot stat %s: %s", child.path, exc)
                errors += 1
                continue
            entries += 1
            if stat.S_ISDIR(info.st_mode):
                stack.append(child.path)
            elif stat.S_ISREG(info.st_mode):
                files += 1
    return WalkResult(entries, files, time.monotonic() - start, complete, errors)


def small_read_all(files: Sequence[FileEntry], threads: int, time_limit_s: float,
                   max_files: int | None = None) -> ThroughputResult:
    """Read every small file whole (at most `max_files`), with `threads` readers as a loader would."""
    chosen = list(files[:max_files] if max_files is not None else files)
    start = time.monotonic()
    deadline = start + time_limit_s

    def read_one(entry: FileEntry) -> tuple[int, int, int]:
        """(bytes, files done, errors); skips once past the deadline."""
        if time.monotonic() > deadline:
            return 0, 0, 0
        try:
            with open(entry.path, "rb", buffering=0) as stream:
                return len(stream.read()), 1, 0
        except OSError as exc:
            log.warning("read of %s failed: %s", entry.path, exc)
            return 0, 1, 1

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="small") as pool:
        outcomes = list(pool.map(read_one, chosen))
    wall_s = time.monotonic() - start
    done = sum(outcome[1] for outcome in outcomes)
    return ThroughputResult(
        threads=threads,
        files=done,
        bytes_read=sum(outcome[0] for outcome in outcomes),
        wall_s=wall_s,
        complete=done == len(chosen),
        errors=sum(outcome[2] for outcome in outcomes),
    )
