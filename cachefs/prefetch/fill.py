"""Background fill of large files read at random: fetched whole at link speed, when they fit in the cache's free room."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import trio

from ..cache import BlockCache
from ..config import COALESCE_BLOCKS, run_blocks
from ..namespace.tree import Inode
from ..read.handles import OpenFile
from .bounded import remember
from .queue import PrefetchQueue

log = logging.getLogger(__name__)

# Random reads of a large file before it is filled in the background, and
# the read-ahead runs all fills together keep in flight (8 runs of
# config.RUN_BYTES, whatever the block size: ~500 MB/s at 60 ms; read-ahead's
# limit on connections applies too).
FILL_AFTER_RANDOM_READS = 4
FILL_RUNS_IN_FLIGHT = 8
RANDOM_READS_REMEMBERED = 4096


class RandomFills:
    """Counts random reads of large files and fills those read at random often enough."""

    def __init__(self, cache: BlockCache, queue: PrefetchQueue, *, block_size: int, enabled: bool,
                 on_filled: Callable[[Inode], None]) -> None:
        self._cache = cache
        self._queue = queue
        self._on_filled = on_filled  # told of each file a fill went through: passthrough verifies it
        self._block_size = block_size
        self._enabled = enabled
        # Large files -> random reads seen (until filled), and the files being filled.
        self._random_reads: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._filling: set[int] = set()
        self._fill_reserved = 0  # bytes of the files being filled: each fill must fit beside the others
        self._filled: collections.OrderedDict[int, None] = collections.OrderedDict()  # fills that completed
        self._fill_slots = trio.Semaphore(FILL_RUNS_IN_FLIGHT)
        self._run_blocks = run_blocks(block_size)

    def note_random_read(self, inode: Inode) -> None:
        """Count a random read of a large file; start filling it after enough of them."""
        if not self._enabled or inode.size <= self._block_size * COALESCE_BLOCKS:
            return  # read-ahead off, or a small file
        if inode.ino in self._filling or inode.ino in self._filled:
            return
        count = self._random_reads.pop(inode.ino, 0) + 1
        if count < FILL_AFTER_RANDOM_READS:
            remember(self._random_reads, inode.ino, count, RANDOM_READS_REMEMBERED)
            return
        if self._cache.free_bytes() - self._fill_reserved < inode.size:
            return  # it would not fit beside the fills under way: it would only displace what is cached
        self._filling.add(inode.ino)
        self._fill_reserved += inode.size
        self._queue.spawn(self._fill, inode)

    async def _fill(self, inode: Inode) -> None:
        """Fetch every block of a file not cached, in runs, at read-ahead priority."""
        handle = OpenFile(inode)
        log.debug("filling %s (%d bytes) in the background: it is read at random", inode.ino, inode.size)
        try:
            async with trio.open_nursery() as runs:
                for run_start in range(0, inode.block_count(self._block_size), self._run_blocks):
                    if self._cache.free_bytes() < self._run_blocks * self._block_size:
                        log.debug("stopped filling %s: the cache is full", inode.ino)
                        return
                    await self._fill_slots.acquire()
                    runs.start_soon(self._fill_run, handle, run_start)
            remember(self._filled, inode.ino, None, RANDOM_READS_REMEMBERED)
            self._on_filled(inode)
        finally:
            self._filling.discard(inode.ino)
            self._fill_reserved -= inode.size

    async def _fill_run(self, handle: OpenFile, first: int) -> None:
        try:
            stop = min(first + self._run_blocks, handle.inode.block_count(self._block_size))
            await self._queue.fetch_run(handle, first, stop)
        finally:
            self._fill_slots.release()
