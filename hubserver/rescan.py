"""New generations: rescanning the root on a signal, on an interval, or on request.

The hub serves one snapshot at a time, held in a `SnapshotHolder`; a rescan
builds the next one in a worker thread and swaps it in whole, so every
request sees one generation. Spokes move to it with `cachefs refresh`
(files that changed in between are refused with 412 until they do).
Rescans run one at a time, and requests for one (`POST /v1/rescan`) within
`MIN_INTERVAL_S` of the last are answered with the current generation, so
a client cannot keep the hub scanning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from hubserver.handlers import SNAPSHOT_KEY
from hubserver.manifest import Snapshot, scan
from hubserver.metrics import HubMetrics

LOG = logging.getLogger(__name__)

MIN_INTERVAL_S: Final = 1.0


class SnapshotHolder:
    """The snapshot being served, replaced whole by a rescan."""

    def __init__(self, snapshot: Snapshot, metrics: HubMetrics) -> None:
        self.current = snapshot
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self.scanned_at = float("-inf")  # when the last rescan finished (the startup scan does not count)

    async def rescan(self, *, unless_recent: bool = False) -> tuple[Snapshot, bool]:
        """Scan the root again; returns (snapshot, whether a scan ran)."""
        async with self._lock:
            if unless_recent and time.monotonic() - self.scanned_at < MIN_INTERVAL_S:
                return self.current, False
            previous = self.current
            started = time.monotonic()
            snapshot = await asyncio.get_running_loop().run_in_executor(None, scan, previous.root)
            self.scanned_at = time.monotonic()
            self.current = snapshot
            publish(self._metrics, snapshot, self.scanned_at - started)
            LOG.info("rescanned %s: generation %s -> %s, %d files (%.2f s)", snapshot.root,
                     previous.generation, snapshot.generation, snapshot.file_count, self.scanned_at - started)
            return snapshot, True


def publish(metrics: HubMetrics, snapshot: Snapshot, scan_s: float) -> None:
    metrics.set_snapshot(
        generation=snapshot.generation,
        files=snapshot.file_count,
        size_bytes=snapshot.total_bytes,
        entries=len(snapshot.entries),
        scan_s=scan_s,
        finished_at_s=time.time(),
    )


async def rescan_periodically(holder: SnapshotHolder, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await holder.rescan()
        except OSError as exc:
            LOG.error("rescan of %s failed: %s; still serving generation %s", holder.current.root, exc,
                      holder.current.generation)


async def rescan_request(request: web.Request) -> web.Response:
    """``POST /v1/rescan``: publish a new generation now (at most every MIN_INTERVAL_S)."""
    holder: SnapshotHolder = request.app[SNAPSHOT_KEY]
    snapshot, scanned = await holder.rescan(unless_recent=True)
    return web.json_response({"generation": snapshot.generation, "files": snapshot.file_count, "rescanned": scanned})


async def interval_ctx(app: web.Application, interval_s: float | None) -> AsyncIterator[None]:
    """Run the periodic rescan for the app's lifetime (if configured)."""
    task = asyncio.create_task(rescan_periodically(app[SNAPSHOT_KEY], interval_s)) if interval_s else None
    yield
    if task is not None:
        task.cancel()
