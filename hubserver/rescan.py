"""New generations: rescanning the root on a signal, on an interval, or on request.

The hub serves one snapshot at a time, held in a `SnapshotHolder`; a rescan
builds the next one in a worker thread and swaps it in whole, so every
request sees one generation. Spokes move to it with `cachefs refresh`
(files that changed in between are refused with 412 until they do).
Rescans run one at a time, and requests for one (`POST /v1/rescan`) are
answered with the current generation when the last scan ended less than
`MIN_INTERVAL_S`, or `IDLE_PER_SCAN` times its own duration, ago: a client
cannot keep the hub scanning (requests at most keep it scanning a fifth of
the time). A root given as a symlink is resolved again at each rescan, so
switching it to another tree (`ln -sfn v2 current`) publishes that tree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

from aiohttp import web

from hubserver.metrics import HubMetrics
from hubserver.scan import scan
from hubserver.snapshot import Snapshot

log = logging.getLogger(__name__)

MIN_INTERVAL_S: Final = 1.0
IDLE_PER_SCAN: Final = 4.0


class SnapshotHolder:
    """The snapshot being served, replaced whole by a rescan of `root` (as configured)."""

    def __init__(self, snapshot: Snapshot, metrics: HubMetrics, root: Path) -> None:
        self.current = snapshot
        self._metrics = metrics
        self._root = root
        self._lock = asyncio.Lock()
        self.scanned_at = float("-inf")  # when the last rescan finished (the startup scan does not count)
        self._scan_s = 0.0  # how long it took

    async def rescan(self, *, unless_recent: bool = False) -> tuple[Snapshot, bool]:
        """Scan the root again; returns (snapshot, whether a scan ran). Raises OSError
        if the root cannot be scanned (the current snapshot stays)."""
        async with self._lock:
            pause_s = max(MIN_INTERVAL_S, IDLE_PER_SCAN * self._scan_s)
            if unless_recent and time.monotonic() - self.scanned_at < pause_s:
                return self.current, False
            previous = self.current
            started = time.monotonic()
            try:
                snapshot = await asyncio.get_running_loop().run_in_executor(None, scan, self._root)
            finally:
                self.scanned_at = time.monotonic()
                self._scan_s = self.scanned_at - started
            self.current = snapshot
            publish(self._metrics, snapshot, self._scan_s)
            log.info("rescanned %s: generation %s -> %s, %d files (%.2f s)", snapshot.root,
                     previous.generation, snapshot.generation, snapshot.file_count, self._scan_s)
            return snapshot, True

    async def rescan_logged(self) -> None:
        """Rescan (a signal, the interval); a failure is logged and the current snapshot stays."""
        try:
            await self.rescan()
        except OSError as exc:
            log.error("rescan of %s failed: %s; still serving generation %s", self._root, exc.strerror or exc,
                      self.current.generation)


SNAPSHOT_KEY: Final = web.AppKey("snapshot", SnapshotHolder)


def publish(metrics: HubMetrics, snapshot: Snapshot, scan_s: float) -> None:
    metrics.set_snapshot(
        generation=snapshot.generation,
        files=snapshot.file_count,
        size_bytes=snapshot.total_bytes,
        entries=snapshot.entry_count,
        scan_s=scan_s,
        finished_at_s=time.time(),
    )


async def rescan_periodically(holder: SnapshotHolder, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await holder.rescan_logged()


async def interval_ctx(app: web.Application, interval_s: float | None) -> AsyncIterator[None]:
    """Run the periodic rescan for the app's lifetime (if configured)."""
    task = asyncio.create_task(rescan_periodically(app[SNAPSHOT_KEY], interval_s)) if interval_s else None
    yield
    if task is not None:
        task.cancel()
