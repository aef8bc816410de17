"""Sibling prefetch: opening a small file fetches the files after it in tree order, in batches; cached ones are paged in."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Iterator

import trio

from ..cache import BlockCache
from ..config import COALESCE_BLOCKS
from ..fetch.fetcher import Fetcher
from ..fetch.hub_client import BATCH_MAX_BYTES, BATCH_MAX_FILES
from ..namespace.tree import Inode, Namespace
from ..read.blocks import SmallDiskReads
from ..read.handles import OpenFile
from .bounded import remember
from .queue import PrefetchQueue, head_key

# Files remembered by sibling prefetch (see prefetch_siblings), and the most
# bytes one walk asks for (the WAN a reader that opens one file can cost).
SIBLINGS_REMEMBERED = 4096
SIBLING_PREFETCH_BYTES = 16 * 1024 * 1024
# Small files per batch request: the hub's limit, BATCH_MAX_FILES. A batch
# also holds at most a read-ahead run's bytes (COALESCE_BLOCKS blocks), which
# keeps the memory read-ahead can have in flight where it was; that bound, not
# the count, sets the batch for files of ~100 KiB (40 files). Larger batches
# cost the hub less CPU per file (docs/performance.md).
# A large file's index entries are paged in (in a worker thread) when it is
# opened, and the data of cached small files a walk is about to reach (see
# prefetch_siblings), each at most once in this many seconds: their reads then
# find their pages in memory instead of each waiting for the disk on the event
# loop's thread (after a reboot or a dropped page cache).
PAGE_IN_INTERVAL_S = 10.0
PAGED_IN_REMEMBERED = 4096
# Small files are paged in on the trio thread while that takes less than this
# per file on average (an open and a POSIX_FADV_WILLNEED: ~50 us on a virtio
# disk with the dentry cache dropped, a walk's ~64 files in 2-3 ms): done in a
# worker thread, they start later and cost the loop more, and a warm read of
# many small files takes longer (docs/performance.md). A disk that needs
# longer (a seek per inode) moves them to a worker thread, so that a walk's
# batch does not hold up other requests.
INLINE_PAGE_IN_S_PER_FILE = 0.0002
# A walk that starts inside the last one (a reader's walks overlap by half)
# goes on from its followers instead of reading them from the namespace again,
# while that walk is this recent: a refresh may have replaced them since, which
# costs at most a wasted prefetch (reads use the inode of their own open).
WALK_REUSE_S = 2.0


class Siblings:
    """The small-file policy: sibling prefetch on open, and page-ins of what is cached."""

    def __init__(self, namespace: Namespace, cache: BlockCache, fetcher: Fetcher, queue: PrefetchQueue, *,
                 block_size: int, sibling_prefetch_files: int) -> None:
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._queue = queue
        self._block_size = block_size
        self._sibling_prefetch_files = sibling_prefetch_files
        self._batch_bytes = min(COALESCE_BLOCKS * block_size, BATCH_MAX_BYTES)
        # Files asked for by sibling prefetch -> how many files after them were too.
        self._siblings_ahead: collections.OrderedDict[int, int] = collections.OrderedDict()
        # ino -> when a large file's index entries or a small file's data were last paged in
        self._paged_in: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._page_ins = SmallDiskReads(INLINE_PAGE_IN_S_PER_FILE)
        # The last walk's followers (before the byte limit) and when it ran.
        self._last_walk: list[Inode] = []
        self._last_walk_at = -math.inf

    def page_in_index(self, inode: Inode) -> None:
        """On open of a large file, bring its index entries into memory in a worker thread."""
        if inode.size <= self._block_size or not self._page_in_due(inode, trio.current_time()):
            return
        self._in_worker_thread(functools.partial(self._cache.page_in_index, inode.file_id, inode.version))

    def _in_worker_thread(self, page_in: Callable[[], object]) -> None:
        """Run a best-effort page-in in a worker thread, in the background (abandoned at unmount)."""
        self._queue.nursery.start_soon(functools.partial(trio.to_thread.run_sync, page_in, abandon_on_cancel=True))

    def _paged_in_recently(self, inode: Inode, now: float) -> bool:
        last = self._paged_in.get(inode.ino)
        return last is not None and now - last < PAGE_IN_INTERVAL_S

    def _page_in_due(self, inode: Inode, now: float) -> bool:
        """Whether a file was not paged in for PAGE_IN_INTERVAL_S; if so, it counts as paged in now."""
        if self._paged_in_recently(inode, now):
            return False
        remember(self._paged_in, inode.ino, now, PAGED_IN_REMEMBERED)
        return True

    def prefetch_siblings(self, inode: Inode) -> None:
        """On open of a small file, fetch the files after it in tree order, and
        start reading those already cached into the page cache.

        At most `sibling_prefetch_files` files and SIBLING_PREFETCH_BYTES.
        Skipped while the file was itself asked for by a recent walk with at
        least half that walk still ahead of it: readers going through a
        directory then walk once per half window, not once per file.
        """
        count = self._sibling_prefetch_files
        if count == 0 or inode.size > self._block_size or self._siblings_ahead.get(inode.ino, -1) >= 0:
            return
        now = trio.current_time()
        followers = self._covered(self._walk(inode, count, now))
        small: list[Inode] = []
        for index, sibling in enumerate(followers):
            # Files ahead of it in this walk, less half the walk: >= 0 while a walk would add little.
            ahead = len(followers) - 1 - index - len(followers) // 2
            remember(self._siblings_ahead, sibling.ino, ahead, SIBLINGS_REMEMBERED)
            # One paged in by the last walk was cached then: it needs neither a fetch nor a page-in.
            if 0 < sibling.size <= self._block_size and not self._paged_in_recently(sibling, now):
                small.append(sibling)
        heads = [head_key(sibling) for sibling in small]
        wanted: list[Inode] = []
        cached: list[Inode] = []
        for sibling, head, is_cached in zip(small, heads, self._cache.contains_each(heads), strict=True):
            if is_cached:
                cached.append(sibling)
            elif not self._queue.asked(head):
                wanted.append(sibling)
        self._page_in_small_files(cached)
        batchable: list[Inode] = []
        for sibling in wanted:
            if self._fetcher.batches and sibling.size <= self._batch_bytes:
                batchable.append(sibling)
            else:  # the hub takes no batches, or the file is too large for one
                self._queue.start_run(OpenFile(sibling), 0, 1)
        for batch in self._batches(batchable):
            self._queue.start_files(batch)

    def _walk(self, inode: Inode, count: int, now: float) -> list[Inode]:
        """Up to `count` files after `inode` in tree order: the rest of the last walk if it
        ran within WALK_REUSE_S and `inode` is in it, then what the namespace has after them."""
        recent = self._last_walk if now - self._last_walk_at < WALK_REUSE_S else []
        position = next((index for index, follower in enumerate(recent) if follower.ino == inode.ino), None)
        reused = recent[position + 1 :] if position is not None else []
        if not reused:
            followers = self._namespace.files_after(inode, count)
        elif len(reused) < count:
            followers = reused + self._namespace.files_after(reused[-1], count - len(reused))
        else:
            followers = reused[:count]
        self._last_walk = followers
        self._last_walk_at = now
        return followers

    def _page_in_small_files(self, files: list[Inode]) -> None:
        """Start reading cached small files into the page cache: a walk's reads then find
        them in memory instead of each waiting for the disk on the event loop's thread, one
        after the other. On the trio thread while that is fast, else in a worker thread."""
        now = trio.current_time()
        fresh = [(inode.file_id, inode.version, inode.size) for inode in files if self._page_in_due(inode, now)]
        if not fresh:
            return
        page_in = functools.partial(self._page_ins.timed, functools.partial(self._cache.page_in_files, fresh), len(fresh))
        if self._page_ins.fast:
            page_in()
        else:
            self._in_worker_thread(page_in)

    @staticmethod
    def _covered(followers: list[Inode]) -> list[Inode]:
        """The first of `followers` that fit in SIBLING_PREFETCH_BYTES (at least one)."""
        room = SIBLING_PREFETCH_BYTES
        for index, follower in enumerate(followers):
            room -= follower.size
            if room < 0:
                return followers[: max(1, index)]
        return followers

    def _batches(self, files: list[Inode]) -> Iterator[list[Inode]]:
        """Small files in groups of at most BATCH_MAX_FILES and a read-ahead run's bytes."""
        batch: list[Inode] = []
        batch_bytes = 0
        for inode in files:
            if batch and (len(batch) == BATCH_MAX_FILES or batch_bytes + inode.size > self._batch_bytes):
                yield batch
                batch, batch_bytes = [], 0
            batch.append(inode)
            batch_bytes += inode.size
        if batch:
            yield batch
