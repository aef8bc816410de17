"""Serve a file read: split it into blocks and get each from the BlockSource, once read-ahead and the plans have seen it.

This is the data path below FUSE: `read` -> `_block` -> BlockSource.get
(held in memory | flight | disk cache | hub). Small random reads of a
cached block read only the chunks they touch (BlockSource.part).
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from ..cache import BlockData, BlockKey
from ..cache.policy import FrequencySketch
from ..errors import HubError, RemoteFileChanged
from ..metrics import Stats
from ..namespace.tree import Inode
from ..prefetch.readahead import ReadAhead
from ..prefetch.streams import SEQUENTIAL_THRESHOLD
from .blocks import BlockSource
from .claims import ReadAheadClaims
from .handles import OpenFile

log = logging.getLogger(__name__)


class PlanFollower(Protocol):
    """What the reader tells a loader's plans (planner.py): every block a reader asks for."""

    def observe(self, key: BlockKey) -> None: ...


class Reader:
    """Serves byte ranges of snapshot files (trio thread)."""

    def __init__(
        self,
        source: BlockSource,
        sketch: FrequencySketch,
        claims: ReadAheadClaims,
        plans: PlanFollower,
        readahead: ReadAhead,
        stats: Stats,
        *,
        block_size: int,
    ) -> None:
        self._source = source
        self._sketch = sketch  # admission's count of block uses
        self._claims = claims
        self._plans = plans
        self._readahead = readahead  # shown every open and read; fetches what comes next
        self._stats = stats
        self.block_size = block_size

    def open(self, inode: Inode, pid: int, *, passthrough: bool) -> OpenFile:
        """A new handle of a file (`passthrough`: the kernel reads its data file itself)."""
        self._readahead.opened(inode, passthrough=passthrough)
        if passthrough:
            # The kernel reads it: what read-ahead fetched for it is used, and need not be held
            # (small files fetched ahead are verified as they are cached, before their first open).
            used = set(self._source.read_by_kernel(inode.file_id, inode.version))
            if inode.block_count(self.block_size) == 1:
                used.add(BlockKey(inode.file_id, inode.version, 0))  # its writer may not have settled it yet
            for key in used:
                self._claim_spent(key)
        return OpenFile(inode, pid=pid)

    async def read(self, handle: OpenFile, offset: int, size: int) -> bytes | memoryview:
        """Up to `size` bytes at `offset` (short only at end of file)."""
        self._stats.reads += 1
        inode = handle.inode
        end = min(offset + size, inode.size)
        if offset >= end:
            return b""
        self._stats.read_bytes += end - offset
        first, last = offset // self.block_size, (end - 1) // self.block_size
        self._readahead.on_read(handle, offset, end, last)
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
        key = self._used(inode, blockno)
        data = await self._source.get(key, blockno * self.block_size, inode.block_length(blockno, self.block_size))
        self._claim_spent(key)
        return data

    async def _block_part(self, inode: Inode, blockno: int, start: int, stop: int) -> bytes | memoryview:
        """Bytes [start, stop) of a block, for a small random read."""
        key = self._used(inode, blockno)
        part = await self._source.part(key, start, stop)
        if part is None:
            part = _view(await self._source.get(key, blockno * self.block_size,
                                                inode.block_length(blockno, self.block_size)), start, stop)
        self._claim_spent(key)
        return part

    def _used(self, inode: Inode, blockno: int) -> BlockKey:
        """A reader asks for a block: admission's sketch, the plans and read-ahead's claims hear of it."""
        key = BlockKey(inode.file_id, inode.version, blockno)
        self._sketch.record(key)
        self._plans.observe(key)
        self._claim_spent(key)
        return key

    def _claim_spent(self, key: BlockKey) -> None:
        """The block's read came: a read-ahead claim on it is spent (counted as read-ahead used).
        Asked again once the read has its bytes: read-ahead may claim the block while the read
        waits (on disk, or for a fetch it joins), and a claim outliving its read would make
        admission count that read twice."""
        if self._claims.pop(key):
            self._stats.readahead_used += 1


def _view(data: BlockData, start: int, stop: int) -> bytes | memoryview:
    """data[start:stop] without a copy (pyfuse3 copies it into the reply)."""
    if isinstance(data, bytes) and start == 0 and stop == len(data):
        return data
    return memoryview(data)[start:stop]
