"""Split a file read into blocks: memory, then local cache, else the hub.

This is the data path below FUSE: `read` -> `_block` -> memory | cache.lookup
| fetcher.fetch. A sequential reader also starts read-ahead of the blocks
after the one it is reading, so the next requests find them cached or in
flight.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import trio

from .cache import BlockCache, BlockKey
from .errors import HubError
from .fetcher import Fetcher
from .metrics import Stats
from .namespace import Inode

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OpenFile:
    """Per-handle state: where the next sequential read would start."""

    inode: Inode
    next_offset: int = 0
    sequential_reads: int = 0
    readahead_until_block: int = 0


class MemoryBlocks:
    """A small LRU of recently used blocks, bounded in count."""

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._blocks: collections.OrderedDict[BlockKey, bytes] = collections.OrderedDict()

    def get(self, key: BlockKey) -> bytes | None:
        data = self._blocks.get(key)
        if data is not None:
            self._blocks.move_to_end(key)
        return data

    def put(self, key: BlockKey, data: bytes) -> None:
        self._blocks[key] = data
        self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)


class Reader:
    """Serves byte ranges of snapshot files."""

    def __init__(
        self,
        cache: BlockCache,
        fetcher: Fetcher,
        stats: Stats,
        *,
        block_size: int,
        memory_blocks: int,
        readahead_blocks: int,
        nursery: trio.Nursery,
    ) -> None:
        self._cache = cache
        self._fetcher = fetcher
        self._stats = stats
        self.block_size = block_size
        self._memory = MemoryBlocks(memory_blocks)
        self._readahead_blocks = readahead_blocks
        self._nursery = nursery
        # Read-ahead may use at most this many concurrent fetches, leaving
        # connections free for demand misses.
        self._readahead_slots = trio.CapacityLimiter(max(1, readahead_blocks))

    async def read(self, handle: OpenFile, offset: int, size: int) -> bytes:
        """Up to `size` bytes at `offset` (short only at end of file)."""
        self._stats.reads += 1
        inode = handle.inode
        end = min(offset + size, inode.size)
        if offset >= end:
            return b""
        self._stats.read_bytes += end - offset
        first, last = offset // self.block_size, (end - 1) // self.block_size
        self._note_access(handle, offset, end, last)
        if first == last:
            data = await self._block(inode, first)
            base = first * self.block_size
            return data[offset - base : end - base]
        parts: dict[int, bytes] = {}
        async with trio.open_nursery() as nursery:
            for blockno in range(first, last + 1):
                nursery.start_soon(self._block_into, inode, blockno, parts)
        joined = b"".join(parts[b] for b in range(first, last + 1))
        base = first * self.block_size
        return joined[offset - base : end - base]

    async def _block_into(self, inode: Inode, blockno: int, parts: dict[int, bytes]) -> None:
        parts[blockno] = await self._block(inode, blockno)

    async def _block(self, inode: Inode, blockno: int) -> bytes:
        key = BlockKey(inode.file_id, inode.version, blockno)
        data = self._memory.get(key)
        if data is None and not self._fetcher.in_flight(key):
            data = self._cache.lookup(key)
            if data is not None:
                self._memory.put(key, data)
        if data is not None:
            self._stats.block_hits += 1
            return data
        self._stats.block_misses += 1
        data = await self._fetch(inode, blockno)
        self._memory.put(key, data)
        return data

    async def _fetch(self, inode: Inode, blockno: int) -> bytes:
        key = BlockKey(inode.file_id, inode.version, blockno)
        start = blockno * self.block_size
        length = min(self.block_size, inode.size - start)
        return await self._fetcher.fetch(key, start, length)

    def _note_access(self, handle: OpenFile, offset: int, end: int, last_block: int) -> None:
        """Track sequential access and start read-ahead beyond `last_block`."""
        if offset == handle.next_offset:
            handle.sequential_reads += 1
        else:
            handle.sequential_reads = 0
            handle.readahead_until_block = 0
        handle.next_offset = end
        if handle.sequential_reads < 2 or self._readahead_blocks == 0:
            return
        inode = handle.inode
        blocks_in_file = (inode.size + self.block_size - 1) // self.block_size
        start = max(last_block + 1, handle.readahead_until_block)
        stop = min(last_block + 1 + self._readahead_blocks, blocks_in_file)
        for blockno in range(start, stop):
            self._nursery.start_soon(self._readahead, inode, blockno)
        handle.readahead_until_block = max(handle.readahead_until_block, stop)

    async def _readahead(self, inode: Inode, blockno: int) -> None:
        key = BlockKey(inode.file_id, inode.version, blockno)
        async with self._readahead_slots:
            if self._fetcher.in_flight(key) or self._cache.index.get(key) is not None:
                return
            self._stats.readahead_fetches += 1
            try:
                await self._fetch(inode, blockno)
            except HubError as exc:
                log.debug("read-ahead of %s failed: %s", key, exc)
