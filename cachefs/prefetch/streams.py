"""Read-ahead of streams: a per-handle window that doubles while the reader keeps up, running on into the process's next file."""

from __future__ import annotations

import collections
import dataclasses

from ..config import COALESCE_BLOCKS
from ..namespace.tree import Inode, Namespace
from ..read.handles import OpenFile
from .bounded import remember
from .coverage import PlanCoverage
from .queue import PrefetchQueue

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


class Streams:
    """The sequential-read policy: each handle's window, and the next file of each process's walk."""

    def __init__(self, namespace: Namespace, plans: PlanCoverage, queue: PrefetchQueue, *, block_size: int,
                 readahead_blocks: int) -> None:
        self._namespace = namespace
        self._plans = plans
        self._queue = queue
        self._block_size = block_size
        self._max_window_blocks = readahead_blocks
        self._walks: collections.OrderedDict[int, _PidWalk] = collections.OrderedDict()

    def on_read(self, handle: OpenFile, offset: int, end: int, last_block: int) -> bool:
        """Every read, before it is served: track the stream; keep the window ahead of `last_block`
        asked for. False if the read did not continue the handle's run (a seek)."""
        if self._continues(handle, offset):
            handle.sequential_reads += 1
            handle.next_offset = max(handle.next_offset, end)
        else:
            handle.sequential_reads = 1
            handle.stream_start = offset
            handle.window_blocks = 0
            handle.prefetched_until = 0
            handle.next_offset = end
        continued = handle.sequential_reads > 1
        if handle.sequential_reads < _stream_threshold(handle) or self._max_window_blocks == 0:
            return continued
        if handle.window_blocks == 0:
            from_start = handle.stream_start == 0
            if from_start:
                self._note_stream_start(handle)
            initial = FROM_START_WINDOW_BLOCKS if from_start else INITIAL_WINDOW_BLOCKS
            handle.window_blocks = min(initial, self._max_window_blocks)
        elif last_block < handle.prefetched_until:
            # The reader is consuming what was read ahead: it keeps up, so grow.
            handle.window_blocks = min(handle.window_blocks * 2, self._max_window_blocks)
        overflow = last_block + 1 + handle.window_blocks - handle.inode.block_count(self._block_size)
        if overflow > 0:
            self._read_ahead_next_file(handle, overflow)
        block_count = handle.inode.block_count(self._block_size)
        target = min(last_block + 1 + handle.window_blocks, block_count)
        start = max(last_block + 1, handle.prefetched_until)
        # Ask in whole runs, as soon as a run's worth of the window is free (the file's last
        # blocks as soon as the window reaches its end: no whole run of them may be left).
        if start < target and (target - start >= min(COALESCE_BLOCKS, handle.window_blocks) or target >= block_count):
            self._ask_runs(handle, start, target)
        return continued

    def _continues(self, handle: OpenFile, offset: int) -> bool:
        """Whether a read at `offset` continues the handle's sequential run (with slack once it is a stream)."""
        slack = REORDER_BLOCKS * self._block_size if handle.sequential_reads >= _stream_threshold(handle) else 0
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
        stop = min(max(blocks, COALESCE_BLOCKS), head.inode.block_count(self._block_size))
        if stop - head.prefetched_until < COALESCE_BLOCKS:
            return  # asked in whole runs, as the window is
        self._ask_runs(head, head.prefetched_until, stop)

    def _ask_runs(self, handle: OpenFile, start: int, stop: int) -> None:
        """Queue read-ahead of the handle's blocks [start, stop) in runs of COALESCE_BLOCKS;
        the handle has then asked for everything before `stop`."""
        for run_start in range(start, stop, COALESCE_BLOCKS):
            self._queue.start_run(handle, run_start, min(run_start + COALESCE_BLOCKS, stop))
        handle.prefetched_until = stop

    def _next_file(self, handle: OpenFile) -> OpenFile | None:
        """The large file the handle's process will read next (see _read_ahead_next_file), if any."""
        walk = self._walks.get(handle.pid)
        step = walk.next_step if walk is not None else 1
        following = self._namespace.files_after(handle.inode, step)
        if len(following) < step:
            return None
        target = following[step - 1]
        if target.size <= self._block_size * COALESCE_BLOCKS or self._plans.covers(target):
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
        remember(self._walks, handle.pid, _PidWalk(handle.inode, step, step if confirmed else 1), PIDS_REMEMBERED)
