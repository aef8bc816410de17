"""Re-hashes, on a period and at a bounded rate, the cached files the kernel may read directly (passthrough).

The kernel reads such a file's data file without a check (passthrough.py),
so a byte changed on disk after the file's verification (a failing disk, a
stray write by another program) would be served as it is. Every
`interval_s` this walks every file version verified in this boot, block by
block against the checksums in its index entries, reading at most
`rate_bytes` a second in a worker thread. A file that no longer matches
loses its verified mark and its bad blocks (BlockCache.drop_changed: the
next read fetches them from the hub again), and is revoked from
passthrough, so later opens are served, and checked, by the daemon.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from ..cache import BlockCache
from ..metrics import Stats

log = logging.getLogger(__name__)

# Bytes re-hashed per hop to the worker thread: small enough that the pace
# stays smooth and an unmount waits at most a fraction of a second for it.
STEP_BYTES = 8 << 20


class Revocable(Protocol):
    """Passthrough: stop handing a file version's data file to the kernel."""

    def revoke(self, file_id: bytes, version: bytes) -> None: ...


class Reverifier:
    """Re-verifies the verified data files every `interval_s`, at most `rate_bytes` a second."""

    def __init__(self, cache: BlockCache, passthrough: Revocable, stats: Stats, *,
                 interval_s: float, rate_bytes: int) -> None:
        self._cache = cache
        self._passthrough = passthrough
        self._stats = stats
        self._interval_s = interval_s
        self._rate_bytes = rate_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A round every interval, until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self._interval_s)
            await self.run_round()

    async def run_round(self) -> None:
        """Re-hash every file version verified in this boot, once."""
        for file_id, version in await trio.to_thread.run_sync(self._cache.verified_versions):
            await self._reverify(file_id, version)

    async def _reverify(self, file_id: bytes, version: bytes) -> None:
        blockno: int | None = 0
        bad = []
        while blockno is not None:
            started = trio.current_time()
            blockno, read, step_bad = await trio.to_thread.run_sync(
                self._cache.reverify_blocks, file_id, version, blockno, STEP_BYTES)
            bad.extend(step_bad)
            await trio.sleep_until(started + read / self._rate_bytes)
        if bad:
            # The mark goes first: from then on no new open is handed the data file.
            await trio.to_thread.run_sync(self._cache.drop_changed, bad)
            self._passthrough.revoke(file_id, version)
            self._stats.reverify_failures += 1
        self._stats.reverified_files += 1
        if not bad:
            return
        log.error("cached file %s changed on disk after its verification (%d bad blocks, first %s): "
                  "the daemon serves it again and fetches those blocks from the hub",
                  file_id.hex(), len(bad), bad[0])
