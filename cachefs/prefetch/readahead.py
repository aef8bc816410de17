"""Read-ahead: fetching what readers will want next before they ask, by three policies behind one face.

- Sequential readers (streams.py) get a per-handle window of blocks fetched ahead of
  them, in runs of up to `COALESCE_BLOCKS` per request. The window starts
  small, doubles while the reader keeps consuming it, and is dropped on a
  seek. When the window reaches the end of a large file, the head of the
  next large file in tree order is asked for too.
- A large file read at random offsets (fill.py: shuffled samples from a shard) is
  filled in the background, whole, at read-ahead priority, once it has had
  `FILL_AFTER_RANDOM_READS` random reads, if it fits in the cache's free
  room beside the other fills under way (so a fill never displaces cached
  blocks): random readers cannot be predicted, but their file can be
  fetched at link speed instead of one round trip per sample.
- Opening a small file (siblings.py) also prefetches the files after it in tree order
  (the rest of its directory, then the next directories), because datasets
  of small files are read in that order far more often than not, and each
  one would otherwise cost a round trip. They are asked for in batches of
  up to `BATCH_MAX_FILES` files per request: per-request costs (HTTP on both
  ends, the hub's file opens in a worker thread) were what limited a tree
  of small files, not the link.

All of it runs at read-ahead priority, under the fetcher's `prefetch_slots`
(demand misses always find a connection), at most READAHEAD_RUNS_IN_FLIGHT
requests at once (config.py; queue.py). The window, the next file and the fill stay off
for files a loader's plan covers (training/planner.py knows what comes next).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..cache import BlockCache
from ..fetch.fetcher import Fetcher
from ..metrics import Stats
from ..namespace.tree import Inode, Namespace
from ..read.handles import OpenFile
from .coverage import PlanCoverage
from .fill import RandomFills
from .queue import PrefetchQueue
from .siblings import Siblings
from .streams import Streams


class ReadAhead:
    """The read-ahead policies of one mount, shown every open and read (fs.py -> reader.py)."""

    def __init__(
        self,
        namespace: Namespace,
        cache: BlockCache,
        fetcher: Fetcher,
        plans: PlanCoverage,
        stats: Stats,
        *,
        block_size: int,
        readahead_blocks: int,
        sibling_prefetch_files: int,
        nursery: trio.Nursery,
        on_filled: Callable[[Inode], None],
    ) -> None:
        """`on_filled`: told of each file read at random that a background fill went through."""
        self._plans = plans
        queue = PrefetchQueue(fetcher, stats, block_size=block_size, nursery=nursery)
        self._streams = Streams(namespace, plans, queue, block_size=block_size, readahead_blocks=readahead_blocks)
        self._fills = RandomFills(cache, queue, block_size=block_size, enabled=readahead_blocks > 0,
                                  on_filled=on_filled)
        self._siblings = Siblings(namespace, cache, fetcher, queue, block_size=block_size,
                                  sibling_prefetch_files=sibling_prefetch_files)

    def opened(self, inode: Inode, *, passthrough: bool) -> None:
        """A file was opened: prefetch the small files after it; page in a large one's index
        entries (unless the kernel reads its data file itself: `passthrough`)."""
        self._siblings.prefetch_siblings(inode)
        if not passthrough:
            self._siblings.page_in_index(inode)

    def on_read(self, handle: OpenFile, offset: int, end: int, last_block: int) -> None:
        """Every read, before it is served (files a loader's plan covers are left to the plan's prefetch)."""
        if self._plans.covers(handle.inode):
            return
        if not self._streams.on_read(handle, offset, end, last_block):
            self._fills.note_random_read(handle.inode)
