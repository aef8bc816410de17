"""Split a file read into blocks: memory, then a flight, then the local cache, else the hub.

This is the data path below FUSE: `read` -> `_block` -> memory | flight |
cache (page cache, else a disk read) | fetcher.fetch. Small random reads
of a cached block read only the chunks they touch, on the event loop's
thread while the disk is fast. Every read is shown to the read-ahead
(readahead.py), which fetches what comes next.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from .cache import BlockCache, BlockData, BlockKey
from .errors import HubError, RemoteFileChanged
from .fetcher import Fetcher
from .metrics import STALL_DURATION, Stats
from .namespace import Inode
from .readahead import SEQUENTIAL_THRESHOLD, OpenFile, ReadAhead

log = logging.getLogger(__name__)

# Cached blocks read from disk at once (worker threads): enough to overlap
# the kernel's parallel readahead requests on NVMe.
DISK_READ_THREADS = 8
# A small cached read that misses the page cache is done on the trio thread
# while such reads take less than this on average: a hop to a worker thread
# (trio.to_thread) costs ~0.2 ms of latency and of main-thread CPU here, more
# than an NVMe read. A slower disk moves the reads to worker threads, so it
# does not hold up every other request.
INLINE_DISK_READ_S = 0.001

_Read = TypeVar("_Read")


class MemoryBlocks:
    """A small LRU of recently used blocks, bounded in count."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: collections.OrderedDict[BlockKey, BlockData] = collections.OrderedDict()

    def get(self, key: BlockKey) -> BlockData | None:
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def put(self, key: BlockKey, data: BlockData) -> None:
        self._blocks[key] = data
        self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class SmallDiskReads:
    """The recent time of a small disk read (exponentially weighted), and whether it is short."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.recent_s = 0.0

    @property
    def fast(self) -> bool:
        return self.recent_s < self.limit_s

    def timed(self, read: Callable[[], _Read]) -> _Read:
        """read(), folding its duration into the recent time (any thread)."""
        started = time.perf_counter()
        try:
            return read()
        finally:
            self.recent_s += (time.perf_counter() - started - self.recent_s) / 8


class Reader:
    """Serves byte ranges of snapshot files."""

    def __init__(
        self, cache: BlockCache, fetcher: Fetcher, stats: Stats, readahead: ReadAhead, *, memory_blocks: int
    ) -> None:
        self._cache = cache
        self._fetcher = fetcher
        self._stats = stats
        self.block_size = readahead.block_size
        self._memory = MemoryBlocks(memory_blocks)
        self._disk_readers = trio.CapacityLimiter(DISK_READ_THREADS)
        self._small_reads = SmallDiskReads(INLINE_DISK_READ_S)
        self.readahead = readahead  # shown every read; fetches what comes next
        # Told of every block a reader asks for; may hand back its bytes (planner.py
        # follows a loader's plan with it and holds blocks prefetched along it).
        self.on_block: Callable[[BlockKey], BlockData | None] | None = None

    def forget_memory(self) -> None:
        """Drop the in-memory blocks (after an evict or purge)."""
        self._memory = MemoryBlocks(self._memory.capacity)

    # -- the read path ------------------------------------------------------------

    async def read(self, handle: OpenFile, offset: int, size: int) -> bytes | memoryview:
        """Up to `size` bytes at `offset` (short only at end of file)."""
        self._stats.reads += 1
        inode = handle.inode
        end = min(offset + size, inode.size)
        if offset >= end:
            return b""
        self._stats.read_bytes += end - offset
        first, last = offset // self.block_size, (end - 1) // self.block_size
        self.readahead.on_read(handle, offset, end, last)
        if first == last:
            base = first * self.block_size
            if handle.sequential_reads < SEQUENTIAL_THRESHOLD and end - offset <= self.block_size // 4:
                return await self._block_part(inode, first, offset - base, end - base)
            return _view(await self._block(inode, first), offset - base, end - base)
        parts: dict[int, BlockData] = {}
        errors: list[HubError] = []
        async with trio.open_nursery() as nursery:
            for blockno in range(first, last + 1):
                nursery.start_soon(self._block_into, inode, blockno, parts, errors)
        if errors:  # the file changed on the hub, if any block says so; else the first failure
            raise next((error for error in errors if isinstance(error, RemoteFileChanged)), errors[0])
        pieces = []
        for blockno in range(first, last + 1):
            base = blockno * self.block_size
            lo, hi = max(offset, base) - base, min(end, base + self.block_size) - base
            pieces.append(memoryview(parts[blockno])[lo:hi])
        return b"".join(pieces)

    async def _block_into(self, inode: Inode, blockno: int, parts: dict[int, BlockData], errors: list[HubError]) -> None:
        """One block of a read across several: a failure is kept, not raised, so the other
        blocks' fetches (which other readers may be waiting for) go on."""
        try:
            parts[blockno] = await self._block(inode, blockno)
        except HubError as exc:
            errors.append(exc)

    async def _block(self, inode: Inode, blockno: int) -> BlockData:
        key = BlockKey(inode.file_id, inode.version, blockno)
        return await self._obtain(inode, key, self._note_used(key))

    async def _block_part(self, inode: Inode, blockno: int, start: int, stop: int) -> bytes | memoryview:
        """Bytes [start, stop) of a block, for a small random read.

        When the block is cached but not in memory, only the chunks holding
        the range are read from disk (and not kept in memory: a random reader
        rarely comes back to the same block soon). Otherwise as `_block`.
        """
        key = BlockKey(inode.file_id, inode.version, blockno)
        planned = self._note_used(key)
        if planned is None and self._memory.get(key) is None and self._fetcher.flight(key) is None:
            entry = self._cache.entry(key)
            if entry is not None:
                part = await self._from_disk(functools.partial(self._cache.read_part, key, entry, start, stop), small=True)
                if part is not None:
                    self._stats.block_hits += 1
                    return part
        return _view(await self._obtain(inode, key, planned), start, stop)

    def _note_used(self, key: BlockKey) -> BlockData | None:
        """Tell the frequency sketch and the planner that a block is read. Returns its
        bytes if they are at hand: held by the planner, or fetched ahead and not yet read."""
        self._cache.sketch.record(key)
        planned = self.on_block(key) if self.on_block is not None else None
        if self._fetcher.prefetched.pop(key):
            self._stats.readahead_used += 1
            unread = self._fetcher.take_unread(key)
            return planned if planned is not None else unread
        return planned

    async def _obtain(self, inode: Inode, key: BlockKey, planned: BlockData | None) -> BlockData:
        """A whole block: from memory, the planner, a flight, the cache, else the hub."""
        data = self._memory.get(key)
        if data is None and planned is not None:
            data = planned
            self._memory.put(key, data)
        if data is None:
            deadline = self._fetcher.deadline()  # the read's own fetch timeout starts here
            flight = self._fetcher.flight(key)
            if flight is not None:
                if flight.done.is_set():
                    data = await self._fetcher.join(flight, deadline)  # fetched, being written: no second request
                else:
                    started = trio.current_time()
                    try:
                        data = await self._fetcher.join(flight, deadline)  # being fetched: no second request
                    finally:
                        self._note_stall(trio.current_time() - started)
            else:
                data = await self._cached(key)
            if data is not None:
                self._memory.put(key, data)
        if data is not None:
            self._stats.block_hits += 1
            return data
        self._stats.block_misses += 1  # (also a joined fetch that ended without the bytes: fetched again)
        started = trio.current_time()
        try:
            start, length = key.blockno * self.block_size, inode.block_length(key.blockno, self.block_size)
            data = await self._fetcher.fetch(key, start, length, deadline)
        finally:
            self._note_stall(trio.current_time() - started)
        self._memory.put(key, data)
        return data

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


def _view(data: BlockData, start: int, stop: int) -> bytes | memoryview:
    """data[start:stop] without a copy (pyfuse3 copies it into the reply)."""
    if isinstance(data, bytes) and start == 0 and stop == len(data):
        return data
    return memoryview(data)[start:stop]
