"""The processes a benchmark run starts (servers, mounts) and what it reads about them from /proc.

Everything here is bounded in time and is stopped by its `stop()`/`unmount()`,
which the caller registers on an ExitStack so that a failure or Ctrl-C still
cleans up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from cachefs.processes import wait_for_pid

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` (all its threads) from /proc/PID/stat."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid`'s main thread alone: the daemon's event loop, which
    serves every FUSE request, apart from its worker threads (disk, hashing)."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


def _stat_cpu_seconds(path: Path) -> float | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as table:
        return any(line.split()[4] == target for line in table)


def wait_for_exit(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM is assumed sent; wait, then SIGKILL the process group."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not exit within %g s; killing it", proc.pid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout_s)


def python_command(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, *(os.fspath(arg) for arg in args)]


# -- servers -------------------------------------------------------------------------


class _Lines:
    """Drains a pipe in a thread, keeping its lines."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.closed = False
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wait_for_prefix(self, prefix: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                remaining = deadline - time.monotonic()
                if self.closed or remaining <= 0:
                    return None
                self.changed.wait(remaining)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


@dataclasses.dataclass
class Server:
    """A subprocess that announces `<prefix>http://HOST:PORT` on stdout."""

    name: str
    proc: subprocess.Popen[str]
    url: str
    output: _Lines
    log_path: Path

    @property
    def hostport(self) -> str:
        return self.url.removeprefix("http://")

    def stop(self) -> list[str]:
        """SIGTERM, bounded wait, SIGKILL; returns everything it printed on stdout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            wait_for_exit(self.proc, STOP_TIMEOUT_S)
        self.output.join(STOP_TIMEOUT_S)
        return self.output.lines


def start_server(name: str, argv: Sequence[str], prefix: str, log_path: Path, timeout_s: float = 30.0) -> Server:
    """Start `argv` (own process group, stderr to `log_path`) and wait for its listening line."""
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                start_new_session=True)
    assert proc.stdout is not None
    output = _Lines(proc.stdout)
    line = output.wait_for_prefix(prefix, timeout_s)
    if line is None:
        server = Server(name, proc, "", output, log_path)
        server.stop()
        raise RuntimeError(f"{name} did not start within {timeout_s:g} s; see {log_path}")
    url = line[len(prefix) :].strip()
    log.info("%s listening on %s (pid %d)", name, url, proc.pid)
    return Server(name, proc, url, output, log_path)


def wan_bytes_from_summary(lines: Sequence[str]) -> int | None:
    """Downstream bytes from the emulator's exit line `wan carried N bytes downstream, ...`."""
    for line in reversed(lines):
        if line.startswith("wan carried "):
            return int(line.split()[2])
    return None


# -- mounts --------------------------------------------------------------------------


class CachefsMount:
    """A cachefs spoke, mounted with the project's CLI."""

    system = "cachefs"

    def __init__(self, hub_url: str, mountpoint: Path, cache_dir: Path, options: Sequence[str],
                 timeout_s: float = 300.0) -> None:
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        mountpoint.mkdir(parents=True, exist_ok=True)
        argv = python_command("-m", "cachefs", "mount", hub_url, mountpoint, "--cache-dir", cache_dir,
                              "--mount-timeout", str(timeout_s), *options)
        result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s + 30)
        if result.returncode != 0:
            self.unmount()
            raise RuntimeError(f"cachefs mount failed: {result.stderr.strip()}")

    def stats(self) -> dict[str, Any] | None:
        try:
            return json.loads(os.getxattr(self.mountpoint, "user.cachefs.stats"))
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        stats = self.stats()
        return stats["pid"] if stats else None

    def crash_reason(self, pid: int | None) -> str | None:
        """Why the daemon `pid` is gone, or None while it runs."""
        if pid is None:
            return "daemon not found"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"daemon pid {pid} exited during the run; see {self.cache_dir / 'cachefs.log'}"
        return None

    def unmount(self) -> None:
        pid = self.pid()
        if is_mounted(self.mountpoint):
            result = subprocess.run(python_command("-m", "cachefs", "unmount", self.mountpoint),
                                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90)
            if result.returncode != 0 and is_mounted(self.mountpoint):
                log.warning("cachefs unmount failed (%s); lazy unmount", result.stderr.strip())
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        if pid is not None:
            _wait_pid_or_kill(pid, STOP_TIMEOUT_S)


class PeerMount:
    """A FUSE filesystem run in the foreground as our child (rclone, httpdirfs)."""

    def __init__(self, system: str, argv: Sequence[str], mountpoint: Path, log_path: Path,
                 timeout_s: float = 60.0) -> None:
        self.system = system
        self.mountpoint = mountpoint
        self.log_path = log_path
        mountpoint.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not is_mounted(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"{system} did not mount within {timeout_s:g} s; see {log_path}")
            time.sleep(0.1)
        log.info("%s mounted on %s (pid %d)", system, mountpoint, self.proc.pid)

    def stats(self) -> dict[str, Any] | None:
        return None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None else None

    def crash_reason(self, pid: int | None) -> str | None:
        """Why the filesystem process is gone (its first fatal log line), or None while it runs."""
        if self.proc.poll() is None:
            return None
        fatal = next((line.strip() for line in _log_lines(self.log_path)
                      if "fatal" in line.lower() or "panic" in line.lower()), "")
        return f"{self.system} exited ({self.proc.returncode}) during the run" + (f": {fatal}" if fatal else "")

    def unmount(self) -> None:
        if is_mounted(self.mountpoint):
            result = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True, timeout=60)
            if result.returncode != 0 and is_mounted(self.mountpoint):
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, timeout=30)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        wait_for_exit(self.proc, STOP_TIMEOUT_S)


def _log_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _wait_pid_or_kill(pid: int, timeout_s: float) -> None:
    if wait_for_pid(pid, timeout_s):
        return
    log.warning("daemon pid %d did not exit within %g s; killing it", pid, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
