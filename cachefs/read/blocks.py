"""One block's bytes for a reader: held in memory, else its flight, else the disk cache, else the hub.

This is the only place where a read joins a fetch under way. Cached
blocks are read in worker threads unless their pages are in the page
cache; small reads of part of a block are read on the trio thread while
such reads are fast (`SmallDiskReads`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from ..cache import BlockCache, BlockData, BlockKey
from ..fetch.fetcher import Fetcher
from ..metrics import STALL_DURATION, Stats
from .held import HeldBlocks

# Cached blocks read from disk at once (worker threads): enough to overlap
# the kernel's parallel readahead requests on NVMe.
DISK_READ_THREADS = 8
# A small cached read that misses the page cache is done on the trio thread
# while such reads take less than this on average: a hop to a worker thread
# (trio.to_thread) costs more latency and main-thread CPU than an NVMe read.
# A slower disk moves the reads to worker threads, so it does not hold up
# every other request.
INLINE_DISK_READ_S = 0.001

_Read = TypeVar("_Read")


class SmallDiskReads:
    """The recent time of a small disk operation per item (exponentially weighted), and
    whether it is short: reads of part of a block here, page-ins of small files in
    prefetch/siblings.py."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.recent_s = 0.0

    @property
    def fast(self) -> bool:
        return self.recent_s < self.limit_s

    def timed(self, read: Callable[[], _Read], items: int = 1) -> _Read:
        """read() of `items` items, folding its duration per item into the recent time (any thread)."""
        started = time.perf_counter()
        try:
            return read()
        finally:
            self.recent_s += ((time.perf_counter() - started) / items - self.recent_s) / 8


class BlockSource:
    """Gets whole blocks (and parts of cached ones) for the reader, trio thread only."""

    def __init__(self, held: HeldBlocks, cache: BlockCache, fetcher: Fetcher, stats: Stats) -> None:
        self._held = held
        self._cache = cache
        self._fetcher = fetcher
        self._stats = stats
        self._disk_readers = trio.CapacityLimiter(DISK_READ_THREADS)
        self._small_reads = SmallDiskReads(INLINE_DISK_READ_S)

    def read_by_kernel(self, file_id: bytes, version: bytes) -> list[BlockKey]:
        """A file version is read by the kernel from the cache (passthrough): the blocks read
        ahead for it are no longer held for a read of ours. Returns their keys."""
        return self._held.drop_read_ahead(file_id, version)

    async def get(self, key: BlockKey, start: int, length: int) -> BlockData:
        """The block at byte `start` of its file, `length` bytes long (raises HubError when the hub cannot give it)."""
        data = self._held.use(key, trio.current_time())
        if data is not None:
            self._stats.block_hits += 1
            return data
        deadline = self._fetcher.deadline()  # the read's own fetch timeout starts here
        while True:
            flight = self._fetcher.flight(key)
            if flight is not None:
                stalled = not flight.done.is_set()  # done: fetched and being written, no wait
                started = trio.current_time()
                try:
                    data = await self._fetcher.join(key, flight, deadline)  # no second request
                finally:
                    if stalled:
                        self._note_stall(trio.current_time() - started)
                if data is not None:
                    self._stats.block_hits += 1
                    return data
                if self._fetcher.flight(key) not in (None, flight):
                    continue  # another reader started it again
            else:
                data = await self._cached(key)
                if data is not None:
                    self._held.remember(key, data, trio.current_time())
                    self._stats.block_hits += 1
                    return data
                if self._fetcher.flight(key) is not None:
                    continue  # a fetch started while the disk was read
            break
        self._stats.block_misses += 1  # (also a joined fetch that ended without the bytes: fetched again)
        started = trio.current_time()
        try:
            return await self._fetcher.fetch(key, start, length, deadline)
        finally:
            self._note_stall(trio.current_time() - started)

    async def part(self, key: BlockKey, start: int, stop: int) -> bytes | memoryview | None:
        """Bytes [start, stop) of a cached block neither held nor in flight, reading only the
        chunks that hold them (not kept in memory: a random reader rarely comes back to the
        same block soon); None if the block is not like that."""
        if key in self._held or self._fetcher.flight(key) is not None:
            return None
        entry = self._cache.entry(key)
        if entry is None:
            return None
        part = await self._from_disk(functools.partial(self._cache.read_part, key, entry, start, stop), small=True)
        if part is not None:
            self._stats.block_hits += 1
        return part

    async def _cached(self, key: BlockKey) -> BlockData | None:
        """A block from the local cache, None if it is not there."""
        entry = self._cache.entry(key)
        if entry is None:
            return None
        return await self._from_disk(functools.partial(self._cache.read, key, entry))

    async def _from_disk(self, read: Callable[..., _Read], *, small: bool = False) -> _Read:
        """`read(nowait=True)` when its bytes are in the page cache; else `read()`
        in a worker thread (several at once keep the NVMe busy), or, if it is
        `small` and small disk reads have been fast, on the trio thread."""
        try:
            return read(nowait=True)
        except BlockingIOError:
            self._stats.disk_reads += 1
        if not small:
            return await trio.to_thread.run_sync(read, limiter=self._disk_readers)
        if self._small_reads.fast:
            self._stats.disk_reads_inline += 1
            return self._small_reads.timed(read)
        return await trio.to_thread.run_sync(self._small_reads.timed, read, limiter=self._disk_readers)

    def _note_stall(self, waited_s: float) -> None:
        self._stats.stall_seconds += waited_s
        self._stats.stalled_blocks += 1
        STALL_DURATION.observe(waited_s)
