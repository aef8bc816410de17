"""A cachefs daemon's peak resident memory, over a run and per workload, from /proc."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def status_kib(pid: int, field: str) -> int | None:
    """A KiB field of /proc/PID/status (VmHWM, VmRSS, RssAnon, ...); None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM (peak resident set) of `pid` in KiB; None if it cannot be read."""
    return status_kib(pid, "VmHWM")


def _is_cachefs_mount(pid: int) -> bool:
    """Whether `pid` runs `cachefs mount` (`python -m cachefs mount ...` or the `cachefs` script)."""
    try:
        argv = [os.fsdecode(arg) for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return False
    return "mount" in argv and any(arg == "cachefs" or arg.endswith("/cachefs") for arg in argv)


class PhasePeaks:
    """The peak RSS of a daemon in each workload: its VmHWM is reset to its current RSS
    (`clear_refs` 5) as a workload starts and read as it ends. Every reading also goes into
    `highest`, so the peak of the whole run is still known after the resets.

    Resetting needs the right to write /proc/PID/clear_refs (root, or the daemon's user);
    without it a workload's peak is None, not the run's so far."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._resettable = True
        self.highest = peak_rss_kib(pid)

    @classmethod
    def of_mount(cls, stats: dict[str, Any] | None) -> PhasePeaks | None:
        """For the daemon whose counters these are, if its pid here is a cachefs daemon
        (a mount's pid from another pid namespace would name some other process)."""
        pid = (stats or {}).get("pid")
        if not isinstance(pid, int) or not _is_cachefs_mount(pid):
            return None
        return cls(pid)

    def start(self) -> None:
        self._note(peak_rss_kib(self._pid))
        try:
            Path(f"/proc/{self._pid}/clear_refs").write_text("5")
        except OSError:
            self._resettable = False

    def end(self) -> int | None:
        """The peak since `start`, in KiB."""
        peak = peak_rss_kib(self._pid)
        self._note(peak)
        return peak if self._resettable else None

    def _note(self, peak: int | None) -> None:
        if peak is not None and (self.highest is None or peak > self.highest):
            self.highest = peak
