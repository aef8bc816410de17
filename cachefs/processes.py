"""Waiting, bounded, for a process (by pid, not necessarily our child) to exit."""

from __future__ import annotations

import os
import time

_POLL_S = 0.05


def wait_for_pid(pid: int, timeout_s: float) -> bool:
    """Whether the process `pid` exited within `timeout_s` (polled: another's child cannot be waited for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(_POLL_S)
    return False
