"""Re-hashes, on a period and at a bounded rate, the cached files the kernel may read directly (passthrough).

The kernel reads such a file's data file without a check (passthrough.py),
so a byte changed on disk after the file's verification (a failing disk, a
stray write by another program) would be served as it is. Each file version
verified in this boot is hashed again block by block against the checksums
in its index entries once its last verification is `interval_s` old (the
time is kept in the index, so a restarted daemon does not start the period
again), reading at most `rate_bytes` a second in a worker thread. A file that no longer matches
loses its verified mark and its bad blocks (BlockCache.drop_changed), and
any copy of them the daemon still holds in memory (so the next read fetches
them from the hub again and the cache is whole again), and is revoked from
passthrough, so later opens are served, and checked, by the daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import trio

from ..cache import BlockCache, BlockKey
from ..metrics import Stats

log = logging.getLogger(__name__)

# Bytes re-hashed per hop to the worker thread: small enough that the pace
# stays smooth and an unmount waits at most a fraction of a second for it.
STEP_BYTES = 8 << 20
# How often, at most, the index is searched for files due: a file verified just
# before a restart is due a period after that, not a period after the restart.
POLL_S = 60.0


class Revocable(Protocol):
    """Passthrough: whether the kernel may read data files directly; stop handing it one."""

    enabled: bool

    def revoke(self, file_id: bytes, version: bytes) -> None: ...


class HeldCopies(Protocol):
    """The fetcher: drops blocks from memory (Fetcher.discard_pending)."""

    def discard_pending(self, predicate: Callable[[BlockKey], bool]) -> None: ...


class Reverifier:
    """Re-verifies each verified data file `interval_s` after its last verification, at most `rate_bytes` a second."""

    def __init__(self, cache: BlockCache, passthrough: Revocable, held: HeldCopies, stats: Stats, *,
                 interval_s: float, rate_bytes: int) -> None:
        self._cache = cache
        self._passthrough = passthrough
        self._held = held
        self._stats = stats
        self._interval_s = interval_s
        self._rate_bytes = rate_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Re-verify the files due, then look again, until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(min(self._interval_s, POLL_S))
            await self.run_round()

    async def run_round(self) -> None:
        """Re-hash every file version verified in this boot whose last verification is a period old, oldest first."""
        if not self._passthrough.enabled:  # the kernel refused passthrough after all: every read is checked
            return
        due_s = time.time() - self._interval_s
        verified = await trio.to_thread.run_sync(self._cache.verified_versions)
        for file_id, version, _at_s in sorted((entry for entry in verified if entry[2] <= due_s), key=lambda e: e[2]):
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
        self._stats.reverified_files += 1
        if not bad:
            await trio.to_thread.run_sync(self._cache.reverified, file_id, version)
            return
        # The mark goes first: from then on no new open is handed the data file.
        await trio.to_thread.run_sync(self._cache.drop_changed, bad)
        # A held copy would be served instead of a fetch, and the block never cached again.
        # After the drop, not before: a read that met the changed bytes before the drop has
        # fetched the block again and the drop took that copy's new entry, so its held copy
        # must go too; a read during the drop costs at most one more fetch.
        changed = set(bad)
        self._held.discard_pending(changed.__contains__)
        self._passthrough.revoke(file_id, version)
        self._stats.reverify_failures += 1
        log.error("cached file %s changed on disk after its verification (%d bad blocks, first %s): "
                  "the daemon serves it again and fetches those blocks from the hub",
                  file_id.hex(), len(bad), bad[0])
