"""Read-ahead's requests: asked for once, started in the background, within its runs and the prefetch slots."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from ..cache import BlockKey
from ..config import READAHEAD_RUNS_IN_FLIGHT
from ..fetch.fetcher import Fetcher
from ..fetch.runs import missing_runs
from ..metrics import Stats
from ..namespace.tree import Inode
from ..read.handles import OpenFile

log = logging.getLogger(__name__)

# Read-ahead starts no run while this many fetches wait for the cache writer's
# room with their blocks: the disk is behind the link (a hub on loopback, a
# fast link), and more runs would only wait in memory.
WRITER_BACKLOG_RUNS = 8


class PrefetchQueue:
    """What read-ahead asked for and has not started yet, and the tasks that fetch it."""

    def __init__(self, fetcher: Fetcher, stats: Stats, *, block_size: int, nursery: trio.Nursery) -> None:
        self._fetcher = fetcher
        self._stats = stats
        self._block_size = block_size
        self.nursery = nursery
        # Asked for, not started yet: the handle that asked (None: no handle's, a batch of small files).
        # A closed handle's run fetches nothing, so its keys count as asked no more.
        self._queued: dict[BlockKey, OpenFile | None] = {}
        self._runs = trio.CapacityLimiter(READAHEAD_RUNS_IN_FLIGHT)

    def asked(self, key: BlockKey) -> bool:
        """Queued by read-ahead for a handle still open, in flight or cached."""
        if key in self._queued:
            handle = self._queued[key]
            if handle is None or not handle.closed:
                return True
        return self._fetcher.in_flight_or_cached(key)

    def spawn(self, task: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Start a read-ahead task in the background (see logging_failure)."""
        self.nursery.start_soon(logging_failure, task, *args)

    def start_run(self, handle: OpenFile, first: int, stop: int) -> bool:
        """Queue read-ahead of blocks [first, stop), unless they are cached, in flight or queued.

        The check comes before queueing: opening many small files in one
        directory asks for the same siblings again and again. Returns
        whether anything was queued.
        """
        keys = block_keys(handle.inode, first, stop)
        if all(self.asked(key) for key in keys):
            return False
        self._queue(keys, handle)
        self.spawn(self._fetch_run, handle, first, stop, keys)
        return True

    async def fetch_run(self, handle: OpenFile, first: int, stop: int) -> None:
        """Fetch blocks [first, stop) now (a fill's run, which has its own bound)."""
        keys = block_keys(handle.inode, first, stop)
        self._queue(keys, handle)
        await self._fetch_run(handle, first, stop, keys)

    def start_files(self, files: list[Inode]) -> None:
        """Queue read-ahead of whole small files with one batch request."""
        keys = [head_key(inode) for inode in files]
        self._queue(keys, None)
        self.spawn(self._fetch_files, files, keys)

    def _queue(self, keys: list[BlockKey], handle: OpenFile | None) -> None:
        self._queued.update(dict.fromkeys(keys, handle))

    def _done(self, keys: list[BlockKey], handle: OpenFile | None) -> None:
        """A run ended: those of `keys` still queued for `handle` are no more (another handle may have queued them since)."""
        for key in keys:
            if key in self._queued and self._queued[key] is handle:
                del self._queued[key]

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of read-ahead's runs in flight and one of the fetcher's prefetch slots, once
        the cache writer is not too far behind (WRITER_BACKLOG_RUNS)."""
        async with self._runs, self._fetcher.prefetch_slot(writer_backlog_below=WRITER_BACKLOG_RUNS):
            yield

    async def _fetch_run(self, handle: OpenFile, first: int, stop: int, queued: list[BlockKey]) -> None:
        """Fetch the blocks of [first, stop) that are neither cached nor in flight (contiguous runs, one request each)."""
        try:
            async with self._slot():
                if handle.closed:
                    return
                inode = handle.inode
                for run in missing_runs(range(first, stop), lambda blockno: not self._fetcher.in_flight_or_cached(
                        BlockKey(inode.file_id, inode.version, blockno))):
                    keys = block_keys(inode, run[0], run[-1] + 1)
                    self._stats.readahead_fetches += len(keys)
                    lengths = [inode.block_length(blockno, self._block_size) for blockno in run]
                    if not await self._fetcher.read_ahead(keys, run[0] * self._block_size, lengths):
                        log.debug("read-ahead of %s failed", keys[0])
        finally:
            self._done(queued, handle)

    async def _fetch_files(self, files: list[Inode], queued: list[BlockKey]) -> None:
        """Fetch the small files of `files` (`queued`: their block 0, in order) that are neither
        cached nor in flight, with one request."""
        try:
            async with self._slot():
                fetched = self._fetcher.in_flight_or_cached
                missing = [(key, inode) for key, inode in zip(queued, files, strict=True) if not fetched(key)]
                if missing:
                    self._stats.readahead_fetches += len(missing)
                    keys, sizes = [key for key, _ in missing], [inode.size for _, inode in missing]
                    if not await self._fetcher.read_ahead_files(keys, sizes):
                        log.debug("sibling prefetch of %d files failed", len(missing))
        finally:
            self._done(queued, None)


def block_keys(inode: Inode, first: int, stop: int) -> list[BlockKey]:
    return [BlockKey(inode.file_id, inode.version, blockno) for blockno in range(first, stop)]


def head_key(inode: Inode) -> BlockKey:
    return BlockKey(inode.file_id, inode.version, 0)


async def logging_failure(task: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Await a prefetch task; an unexpected error is logged with its traceback and ends only
    that task, never the mount (what it would have fetched is fetched on demand)."""
    try:
        await task(*args)
    except Exception:
        log.exception("prefetch task %s failed; reads go on without it", task.__qualname__)
