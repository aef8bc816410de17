"""Read-ahead: fetching what readers will want next before they ask.

- Sequential readers get a per-handle window of blocks fetched ahead of
  them, in runs of up to `COALESCE_BLOCKS` per request. The window starts
  small, doubles while the reader keeps consuming it, and is dropped on a
  seek. When the window reaches the end of a large file, the head of the
  next large file in tree order is asked for too.
- A large file read at random offsets (shuffled samples from a shard) is
  filled in the background, whole, at read-ahead priority, once it has had
  `FILL_AFTER_RANDOM_READS` random reads, if it fits in the cache's free
  room beside the other fills under way (so a fill never displaces cached
  blocks): random readers cannot be predicted, but their file can be
  fetched at link speed instead of one round trip per sample.
- Opening a small file also prefetches the files after it in tree order
  (the rest of its directory, then the next directories), because datasets
  of small files are read in that order far more often than not, and each
  one would otherwise cost a round trip. They are asked for in batches of
  up to `BATCH_FILES` files per request: per-request costs (HTTP on both
  ends, the hub's file opens in a worker thread) were what limited a tree
  of small files, not the link.

All of it runs at read-ahead priority, under the fetcher's `prefetch_slots`
(demand misses always find a connection), at most READAHEAD_RUNS_IN_FLIGHT
requests at once (config.py). The window, the next file and the fill stay
off for files a loader's plan covers (planner.py knows what comes next).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import trio

from ..cache import BlockCache, BlockKey
from ..config import COALESCE_BLOCKS, READAHEAD_RUNS_IN_FLIGHT
from ..fetch.fetcher import Fetcher
from ..fetch.runs import missing_runs
from ..metrics import Stats
from ..namespace.tree import Inode, Namespace

log = logging.getLogger(__name__)

# Read-ahead starts no run while this many fetches wait for the cache writer's
# room with their blocks: the disk is behind the link (a hub on loopback, a
# fast link), and more runs would only wait in memory. Cold, hub on loopback,
# one reader then four (files of 128 MiB): peak RSS 157-166 MiB against
# 197-201 without; at 60 ms the runs wait only for moments, and one reader
# moved 472-510 MB/s against 470-494 with 12 runs and no such wait.
WRITER_BACKLOG_RUNS = 8
# Sequential reads in a row before read-ahead starts (the first read of a
# file says nothing about the next, and two random samples that happen to be
# adjacent do not make a stream: with 2, a loader's chance pairs set off
# read-ahead that the cache then had to make room for).
SEQUENTIAL_THRESHOLD = 3
# Once a stream is established, a read this close to where it stands still
# continues it: the kernel's readahead sends several requests at once, and
# they arrive out of order (treating that as a seek reset the window again
# and again). A stream only starts with a read exactly where the last ended,
# so random readers do not start one by chance.
REORDER_BLOCKS = 4
INITIAL_WINDOW_BLOCKS = 4
# A file read from its first byte on is the clearest sign of a whole-file
# read (a random sampler starts there once in size/sample reads): its stream
# starts with the second read and a larger window, which saves a cold start
# a round trip and two doublings of the window.
FROM_START_THRESHOLD = 2
FROM_START_WINDOW_BLOCKS = 16
# Readers whose stride through the files is remembered, and the largest stride
# (files) that is followed (see _read_ahead_next_file).
PIDS_REMEMBERED = 1024
MAX_STRIDE_FILES = 64
# Files remembered by sibling prefetch (see prefetch_siblings), and the most
# bytes one walk asks for (the WAN a reader that opens one file can cost).
SIBLINGS_REMEMBERED = 4096
SIBLING_PREFETCH_BYTES = 16 * 1024 * 1024
# Small files per batch request: the hub's limit (hubserver/batch.py). A
# batch also holds at most a read-ahead run's bytes (COALESCE_BLOCKS blocks),
# which keeps the memory read-ahead can have in flight where it was; that
# bound, not the count, sets the batch for files of ~100 KiB (40 files).
# Against 16 files a batch: the hub's CPU for a cold read of 20,000 such
# files -12 %, the emulator's -9 %, wall -2.5 %.
BATCH_FILES = 64
BATCH_MAX_BYTES = 8 * 1024 * 1024  # the hub's limit (docs/protocol.md)
# Random reads of a large file before it is filled in the background, and
# the read-ahead runs all fills together keep in flight (8 x 4 MiB: ~500 MB/s
# at 60 ms; read-ahead's limit on connections applies too).
FILL_AFTER_RANDOM_READS = 4
FILL_RUNS_IN_FLIGHT = 8
RANDOM_READS_REMEMBERED = 4096
# A large file's index entries are paged in (in a worker thread) when it is
# opened, and the data of cached small files a walk is about to reach (see
# prefetch_siblings), each at most once in this many seconds: their reads then
# find their pages in memory instead of each waiting for the disk on the event
# loop's thread (after a reboot or a dropped page cache).
PAGE_IN_INTERVAL_S = 10.0


@dataclasses.dataclass
class OpenFile:
    """Per-handle read-ahead state."""

    inode: Inode
    pid: int = 0  # the process (thread) that opened it, from the FUSE request
    next_offset: int = 0
    sequential_reads: int = 0
    stream_start: int = 0  # offset where the current run of sequential reads began
    window_blocks: int = 0
    prefetched_until: int = 0  # first block not yet asked for by read-ahead
    next_file_asked: bool = False  # the window reached the end: the next file was looked for
    next_file: OpenFile | None = None  # that file, whose head the window runs on into
    closed: bool = False


class OpenFiles:
    """The open handles of the mount, by FUSE file handle (trio thread)."""

    def __init__(self) -> None:
        self._handles: dict[int, OpenFile] = {}
        self._next = 1

    def add(self, handle: OpenFile) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> OpenFile | None:
        return self._handles.get(fh)

    def pop(self, fh: int) -> OpenFile | None:
        return self._handles.pop(fh, None)

    def versions(self) -> set[tuple[bytes, bytes]]:
        """(file id, version) of every file open now: their cached blocks are kept."""
        return {(handle.inode.file_id, handle.inode.version) for handle in self._handles.values()}


def _stream_threshold(handle: OpenFile) -> int:
    """Sequential reads that make the handle's run a stream (fewer for a run from the first byte)."""
    return FROM_START_THRESHOLD if handle.stream_start == 0 else SEQUENTIAL_THRESHOLD


@dataclasses.dataclass
class _PidWalk:
    """How one reader (a FUSE request pid) goes through the files it reads from their first byte."""

    last: Inode  # the last of them
    step: int  # files from the one before to it, in one directory (0: none, or another directory)
    stride: int  # the step seen twice in a row, else 1

    @property
    def on_course(self) -> bool:
        """Whether its last move went as far as its stride: then its next file is a good bet."""
        return self.step >= 1 and self.step == self.stride

    @property
    def next_step(self) -> int:
        """How far ahead its next file most likely is: as far as its last move, if that was
        forward in one directory (confirmed or not: a rank that takes every k-th file gets
        its third file's head on time, not only its fourth's), else the next file."""
        return self.step if 1 <= self.step <= MAX_STRIDE_FILES else 1


class PlanCoverage(Protocol):
    """Whether a loader's plan covers a file (planner.py): its prefetch then replaces read-ahead's guesses."""

    def covers(self, inode: Inode) -> bool: ...


class ReadAhead:
    """The read-ahead policies of one mount (sequential window, next file, random fill, siblings)."""

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
    ) -> None:
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._plans = plans
        self._stats = stats
        self.block_size = block_size
        self._max_window_blocks = readahead_blocks
        self._sibling_prefetch_files = sibling_prefetch_files
        self._batch_bytes = min(COALESCE_BLOCKS * block_size, BATCH_MAX_BYTES)
        self._nursery = nursery
        self._queued: set[BlockKey] = set()  # read-ahead asked for, not started yet
        # Files asked for by sibling prefetch -> how many files after them were too.
        self._siblings_ahead: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Large files -> random reads seen (until filled), and the files being filled.
        self._random_reads: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._filling: set[int] = set()
        self._fill_reserved = 0  # bytes of the files being filled: each fill must fit beside the others
        self._filled: collections.OrderedDict[int, None] = collections.OrderedDict()  # fills that completed
        self._fill_slots = trio.Semaphore(FILL_RUNS_IN_FLIGHT)
        self._runs = trio.CapacityLimiter(READAHEAD_RUNS_IN_FLIGHT)
        self._walks: collections.OrderedDict[int, _PidWalk] = collections.OrderedDict()
        # ino -> when a large file's index entries or a small file's data were last paged in
        self._paged_in: collections.OrderedDict[int, float] = collections.OrderedDict()

    def opened(self, inode: Inode, *, passthrough: bool) -> None:
        """A file was opened: prefetch the small files after it; page in a large one's index
        entries (unless the kernel reads its data file itself: `passthrough`)."""
        self.prefetch_siblings(inode)
        if not passthrough:
            self.page_in_index(inode)

    def on_read(self, handle: OpenFile, offset: int, end: int, last_block: int) -> None:
        """Every read, before it is served: track the stream; keep the window ahead of `last_block` asked for."""
        if self._planned(handle.inode):
            return
        if self._continues(handle, offset):
            handle.sequential_reads += 1
            handle.next_offset = max(handle.next_offset, end)
        else:
            handle.sequential_reads = 1
            handle.stream_start = offset
            handle.window_blocks = 0
            handle.prefetched_until = 0
            handle.next_offset = end
            self._note_random_read(handle.inode)
        if handle.sequential_reads < _stream_threshold(handle):
            return
        if self._max_window_blocks == 0:
            return
        if handle.window_blocks == 0:
            from_start = handle.stream_start == 0
            if from_start:
                self._note_stream_start(handle)
            initial = FROM_START_WINDOW_BLOCKS if from_start else INITIAL_WINDOW_BLOCKS
            handle.window_blocks = min(initial, self._max_window_blocks)
        elif last_block < handle.prefetched_until:
            # The reader is consuming what was read ahead: it keeps up, so grow.
            handle.window_blocks = min(handle.window_blocks * 2, self._max_window_blocks)
        overflow = last_block + 1 + handle.window_blocks - handle.inode.block_count(self.block_size)
        if overflow > 0:
            self._read_ahead_next_file(handle, overflow)
        block_count = handle.inode.block_count(self.block_size)
        target = min(last_block + 1 + handle.window_blocks, block_count)
        start = max(last_block + 1, handle.prefetched_until)
        # Ask in whole runs, as soon as a run's worth of the window is free (the file's last
        # blocks as soon as the window reaches its end: no whole run of them may be left).
        if start >= target or (target - start < min(COALESCE_BLOCKS, handle.window_blocks) and target < block_count):
            return
        self._ask_runs(handle, start, target)

    def _continues(self, handle: OpenFile, offset: int) -> bool:
        """Whether a read at `offset` continues the handle's sequential run (with slack once it is a stream)."""
        slack = REORDER_BLOCKS * self.block_size if handle.sequential_reads >= _stream_threshold(handle) else 0
        return handle.next_offset - slack <= offset <= handle.next_offset + slack

    def _read_ahead_next_file(self, handle: OpenFile, blocks: int) -> None:
        """A sequential reader near the end of a large file: ask for the head of the
        large file it will read next, so the link does not drain and ramp up again
        at every file boundary. That is the next file in tree order (shards
        streamed one after the other), or the k-th one for a reader whose last
        move went k files on (a rank of a job that shares shards out round
        robin). If the move before went that far too, its window runs on
        into that file: `blocks` blocks of it; else only its first run is asked
        for (readers taking files from a shared queue move irregularly)."""
        if not handle.next_file_asked:
            handle.next_file_asked = True
            handle.next_file = self._next_file(handle)
        head = handle.next_file
        if head is None:
            return
        walk = self._walks.get(handle.pid)
        if walk is None or not walk.on_course:
            blocks = COALESCE_BLOCKS
        stop = min(max(blocks, COALESCE_BLOCKS), head.inode.block_count(self.block_size))
        if stop - head.prefetched_until < COALESCE_BLOCKS:
            return  # asked in whole runs, as the window is
        self._ask_runs(head, head.prefetched_until, stop)

    def _ask_runs(self, handle: OpenFile, start: int, stop: int) -> None:
        """Queue read-ahead of the handle's blocks [start, stop) in runs of COALESCE_BLOCKS;
        the handle has then asked for everything before `stop`."""
        for run_start in range(start, stop, COALESCE_BLOCKS):
            self._start_prefetch(handle, run_start, min(run_start + COALESCE_BLOCKS, stop))
        handle.prefetched_until = stop

    def _next_file(self, handle: OpenFile) -> OpenFile | None:
        """The large file the handle's process will read next (see _read_ahead_next_file), if any."""
        walk = self._walks.get(handle.pid)
        step = walk.next_step if walk is not None else 1
        following = self._namespace.files_after(handle.inode, step)
        if len(following) < step:
            return None
        target = following[step - 1]
        if target.size <= self.block_size * COALESCE_BLOCKS or self._planned(target):
            return None
        return OpenFile(target)

    def _note_stream_start(self, handle: OpenFile) -> None:
        """A reader started reading a file from its first byte: learn how many files it
        moved on from the last one it did that with, in the same directory (its next
        file is guessed from that; a move seen twice in a row is its stride)."""
        previous = self._walks.pop(handle.pid, None)
        step = 0
        if previous is not None and previous.last.parent == handle.inode.parent:
            step = handle.inode.position - previous.last.position
        confirmed = previous is not None and step == previous.step and 1 <= step <= MAX_STRIDE_FILES
        _remember(self._walks, handle.pid, _PidWalk(handle.inode, step, step if confirmed else 1), PIDS_REMEMBERED)

    def _planned(self, inode: Inode) -> bool:
        """Whether a loader's plan covers the file (its prefetch then replaces these guesses)."""
        return self._plans.covers(inode)

    def _spawn(self, task: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Start a read-ahead task in the background (see logging_failure)."""
        self._nursery.start_soon(logging_failure, task, *args)

    # -- background fill of randomly read files ------------------------------------

    def _note_random_read(self, inode: Inode) -> None:
        """Count a random read of a large file; start filling it after enough of them."""
        if self._max_window_blocks == 0 or inode.size <= self.block_size * COALESCE_BLOCKS:
            return  # read-ahead off, or a small file
        if inode.ino in self._filling or inode.ino in self._filled:
            return
        count = self._random_reads.pop(inode.ino, 0) + 1
        if count < FILL_AFTER_RANDOM_READS:
            _remember(self._random_reads, inode.ino, count, RANDOM_READS_REMEMBERED)
            return
        if self._cache.free_bytes() - self._fill_reserved < inode.size:
            return  # it would not fit beside the fills under way: it would only displace what is cached
        self._filling.add(inode.ino)
        self._fill_reserved += inode.size
        self._spawn(self._fill, inode)

    async def _fill(self, inode: Inode) -> None:
        """Fetch every block of a file not cached, in runs, at read-ahead priority."""
        handle = OpenFile(inode)
        log.debug("filling %s (%d bytes) in the background: it is read at random", inode.ino, inode.size)
        try:
            async with trio.open_nursery() as runs:
                for run_start in range(0, inode.block_count(self.block_size), COALESCE_BLOCKS):
                    if self._cache.free_bytes() < COALESCE_BLOCKS * self.block_size:
                        log.debug("stopped filling %s: the cache is full", inode.ino)
                        return
                    await self._fill_slots.acquire()
                    runs.start_soon(self._fill_run, handle, run_start)
            _remember(self._filled, inode.ino, None, RANDOM_READS_REMEMBERED)
        finally:
            self._filling.discard(inode.ino)
            self._fill_reserved -= inode.size

    async def _fill_run(self, handle: OpenFile, first: int) -> None:
        try:
            stop = min(first + COALESCE_BLOCKS, handle.inode.block_count(self.block_size))
            keys = self._keys(handle.inode, first, stop)
            self._queued.update(keys)
            await self._prefetch_run(handle, first, stop, keys)
        finally:
            self._fill_slots.release()

    def page_in_index(self, inode: Inode) -> None:
        """On open of a large file, bring its index entries into memory in a worker thread."""
        if inode.size <= self.block_size or not self._page_in_due(inode, trio.current_time()):
            return
        self._in_worker_thread(functools.partial(self._cache.page_in_index, inode.file_id, inode.version))

    def _in_worker_thread(self, page_in: Callable[[], object]) -> None:
        """Run a best-effort page-in in a worker thread, in the background (abandoned at unmount)."""
        self._nursery.start_soon(functools.partial(trio.to_thread.run_sync, page_in, abandon_on_cancel=True))

    def _page_in_due(self, inode: Inode, now: float) -> bool:
        """Whether a file was not paged in for PAGE_IN_INTERVAL_S; if so, it counts as paged in now."""
        last = self._paged_in.get(inode.ino)
        if last is not None and now - last < PAGE_IN_INTERVAL_S:
            return False
        _remember(self._paged_in, inode.ino, now, RANDOM_READS_REMEMBERED)
        return True

    # -- sibling prefetch -------------------------------------------------------------

    def prefetch_siblings(self, inode: Inode) -> None:
        """On open of a small file, fetch the files after it in tree order, and
        start reading those already cached into the page cache.

        At most `sibling_prefetch_files` files and SIBLING_PREFETCH_BYTES.
        Skipped while the file was itself asked for by a recent walk with at
        least half that walk still ahead of it: readers going through a
        directory then walk once per half window, not once per file.
        """
        count = self._sibling_prefetch_files
        if count == 0 or inode.size > self.block_size or self._siblings_ahead.get(inode.ino, -1) >= 0:
            return
        followers = self._covered(self._namespace.files_after(inode, count))
        wanted: list[Inode] = []
        cached: list[Inode] = []
        for index, sibling in enumerate(followers):
            # Files ahead of it in this walk, less half the walk: >= 0 while a walk would add little.
            ahead = len(followers) - 1 - index - len(followers) // 2
            _remember(self._siblings_ahead, sibling.ino, ahead, SIBLINGS_REMEMBERED)
            if 0 < sibling.size <= self.block_size:
                head = self._head(sibling)
                if self._cache.contains(head):
                    cached.append(sibling)
                elif not self._asked(head):
                    wanted.append(sibling)
        self._page_in_small_files(cached)
        batchable: list[Inode] = []
        for sibling in wanted:
            if self._fetcher.batches and sibling.size <= self._batch_bytes:
                batchable.append(sibling)
            else:  # the hub takes no batches, or the file is too large for one
                self._start_prefetch(OpenFile(sibling), 0, 1)
        for batch in self._batches(batchable):
            keys = [self._head(sibling) for sibling in batch]
            self._queued.update(keys)
            self._spawn(self._prefetch_batch, batch, keys)

    def _page_in_small_files(self, files: list[Inode]) -> None:
        """Start reading cached small files into the page cache, in a worker thread: a walk's
        reads then find them in memory instead of each waiting for the disk on the event
        loop's thread, one after the other."""
        now = trio.current_time()
        fresh = [(inode.file_id, inode.version, inode.size) for inode in files if self._page_in_due(inode, now)]
        if fresh:
            self._in_worker_thread(functools.partial(self._cache.page_in_files, fresh))

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
        """Small files in groups of at most BATCH_FILES and a read-ahead run's bytes."""
        batch: list[Inode] = []
        batch_bytes = 0
        for inode in files:
            if batch and (len(batch) == BATCH_FILES or batch_bytes + inode.size > self._batch_bytes):
                yield batch
                batch, batch_bytes = [], 0
            batch.append(inode)
            batch_bytes += inode.size
        if batch:
            yield batch

    async def _prefetch_batch(self, files: list[Inode], queued: list[BlockKey]) -> None:
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
            self._queued.difference_update(queued)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of read-ahead's runs in flight and one of the fetcher's prefetch slots, once
        the cache writer is not too far behind (WRITER_BACKLOG_RUNS)."""
        async with self._runs, self._fetcher.prefetch_slot(writer_backlog_below=WRITER_BACKLOG_RUNS):
            yield

    @staticmethod
    def _keys(inode: Inode, first: int, stop: int) -> list[BlockKey]:
        return [BlockKey(inode.file_id, inode.version, blockno) for blockno in range(first, stop)]

    @staticmethod
    def _head(inode: Inode) -> BlockKey:
        return BlockKey(inode.file_id, inode.version, 0)

    def _asked(self, key: BlockKey) -> bool:
        """Queued by read-ahead, in flight or cached."""
        return key in self._queued or self._fetcher.in_flight_or_cached(key)

    def _start_prefetch(self, handle: OpenFile, first: int, stop: int) -> bool:
        """Queue read-ahead of blocks [first, stop), unless they are cached, in flight or queued.

        The check comes before queueing: opening many small files in one
        directory asks for the same siblings again and again. Returns
        whether anything was queued.
        """
        keys = self._keys(handle.inode, first, stop)
        if all(self._asked(key) for key in keys):
            return False
        self._queued.update(keys)
        self._spawn(self._prefetch_run, handle, first, stop, keys)
        return True

    async def _prefetch_run(self, handle: OpenFile, first: int, stop: int, queued: list[BlockKey]) -> None:
        """Fetch the blocks of [first, stop) that are neither cached nor in flight (contiguous runs, one request each)."""
        try:
            async with self._slot():
                if handle.closed:
                    return
                inode = handle.inode
                for run in missing_runs(range(first, stop), lambda blockno: not self._asked_or_cached(inode, blockno)):
                    keys = self._keys(inode, run[0], run[-1] + 1)
                    self._stats.readahead_fetches += len(keys)
                    lengths = [inode.block_length(blockno, self.block_size) for blockno in run]
                    if not await self._fetcher.read_ahead(keys, run[0] * self.block_size, lengths):
                        log.debug("read-ahead of %s failed", keys[0])
        finally:
            self._queued.difference_update(queued)

    def _asked_or_cached(self, inode: Inode, blockno: int) -> bool:
        return self._fetcher.in_flight_or_cached(BlockKey(inode.file_id, inode.version, blockno))


async def logging_failure(task: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Await a prefetch task; an unexpected error is logged with its traceback and ends only
    that task, never the mount (what it would have fetched is fetched on demand)."""
    try:
        await task(*args)
    except Exception:
        log.exception("prefetch task %s failed; reads go on without it", task.__qualname__)


_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def _remember(memory: collections.OrderedDict[_Key, _Value], key: _Key, value: _Value, limit: int) -> None:
    """Store `key` as the most recent entry of `memory`, forgetting the oldest beyond `limit`."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > limit:
        memory.popitem(last=False)
