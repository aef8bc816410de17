"""Mount a real spoke (``python -m cachefs mount``) for tests, and always unmount it.

    with mounted_spoke(hub.url, tmp_path) as spoke:
        data = (spoke.mountpoint / "file").read_bytes()
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hub_helpers import hub_env

from cachefs.processes import wait_for_pid

MOUNT_TIMEOUT_S = 60.0


def cachefs_command(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "cachefs", *map(os.fspath, args)]


def run_cachefs(*args: str | os.PathLike[str], timeout_s: float = MOUNT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run the cachefs CLI; returns the completed process (never raises on exit code)."""
    return subprocess.run(
        cachefs_command(*args), capture_output=True, text=True, timeout=timeout_s, env=hub_env(), stdin=subprocess.DEVNULL
    )


def mountinfo_path(field: str) -> str:
    """A path as /proc/self/mountinfo writes it, with its octal escapes (\\040 for a space,
    \\011, \\012, \\134) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def is_mounted(path: Path) -> bool:
    """Whether something is mounted exactly at `path`."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        return any(mountinfo_path(line.split()[4]) == target for line in table)


def daemon_pid(cache_dir: Path) -> int | None:
    try:
        return int((cache_dir / "lock").read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass
class SpokeMount:
    mountpoint: Path
    cache_dir: Path
    pid: int | None

    def stats(self) -> dict[str, Any]:
        return json.loads(os.getxattr(self.mountpoint, "user.cachefs.stats"))

    def log_text(self) -> str:
        try:
            return (self.cache_dir / "cachefs.log").read_text(errors="replace")
        except OSError:
            return ""

    def unmount(self) -> None:
        """Unmount cleanly; fall back to a lazy unmount and killing the daemon."""
        if is_mounted(self.mountpoint):
            result = run_cachefs("unmount", self.mountpoint)
            if result.returncode != 0 and is_mounted(self.mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        if self.pid is not None:
            _wait_or_kill(self.pid)


def _wait_or_kill(pid: int, timeout_s: float = 15.0) -> None:
    if wait_for_pid(pid, timeout_s):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def mount_spoke(url: str, mountpoint: Path, cache_dir: Path, extra_args: Sequence[str] = ()) -> SpokeMount:
    """Mount and return; raises AssertionError with the CLI's output on failure."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    result = run_cachefs("mount", url, mountpoint, "--cache-dir", cache_dir, *extra_args)
    if result.returncode != 0:
        spoke = SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir))
        spoke.unmount()
        raise AssertionError(f"cachefs mount failed ({result.returncode}): {result.stderr}\nlog:\n{spoke.log_text()}")
    return SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir))


@contextmanager
def mounted_spoke(
    url: str, workdir: Path, extra_args: Sequence[str] = (), *, cache_dir: Path | None = None, name: str = "mnt"
) -> Iterator[SpokeMount]:
    """A spoke mounted at workdir/name for the duration of the block, always unmounted after."""
    spoke = mount_spoke(url, workdir / name, cache_dir or workdir / f"{name}-cache", extra_args)
    try:
        yield spoke
    finally:
        spoke.unmount()


def cache_data_files(cache_dir: Path) -> list[Path]:
    """The spoke's block data files (one sparse file per hub file version)."""
    return [path for path in (cache_dir / "data").rglob("*") if path.is_file()]


def cache_disk_bytes(cache_dir: Path) -> int:
    """Disk space the cached blocks really use (holes of evicted blocks excluded)."""
    return sum(path.stat().st_blocks * 512 for path in cache_data_files(cache_dir))


def wait_for_stats(spoke: SpokeMount, predicate: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """Stats once `predicate(stats)` holds: blocks are written to the cache just after
    they are served, so a test that looks at the cache waits (bounded) for the writer."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = spoke.stats()
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"stats never satisfied the condition: {stats}"
        time.sleep(0.05)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: Path) -> int:
    """How many pages of a file are in the page cache (mincore(2) on a read-only map)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
            if _libc.mincore(address, size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in pages.raw)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def evict_from_page_cache(paths: list[Path], timeout_s: float = 2.0) -> bool:
    """Write back and drop the page cache of files, so reading them needs the disk.

    Pages still being read in (readahead under way) survive a drop, so this
    drops again until none is left; returns False if some still were after
    `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if not any(resident_pages(path) for path in paths):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def read_uncached(path: Path, offset: int = 0, length: int | None = None, timings: list[float] | None = None) -> bytes:
    """pread through the mount after dropping the kernel's page cache for the file,
    so the bytes come from the daemon, not from an earlier read. `timings` gets
    the duration of each pread (each one is a bounded FUSE request)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if length is None:
            length = os.fstat(fd).st_size - offset
        chunks = []
        while length > 0:
            started = time.monotonic()
            chunk = os.pread(fd, length, offset)
            if timings is not None:
                timings.append(time.monotonic() - started)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def assert_clean_failure(result, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: `name{labels}` as written -> value."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def spoke_metrics(port: int) -> dict[str, float]:
    """A spoke's metrics at 127.0.0.1:`port`."""
    return parse_metrics(metrics_text(f"http://127.0.0.1:{port}/metrics"))
