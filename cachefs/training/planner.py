"""Training-aware caching, daemon side: follow a loader's plan of reads, prefetch along it, evict by it.

A loader knows the order in which it will read its samples. `cachefs.plan`
(the client) sends that order for an epoch as (file, offset, length) reads
over the control socket; here each read becomes the blocks it touches, one
*entry* per block use, kept compactly (8 bytes an entry, spilled to
`<cache-dir>/plans/` beyond `MEMORY_CHUNKS` chunks, so a plan larger than
memory costs disk, not RAM).

- **Position.** The reader calls `observe` for every block it serves. A
  block matches its next unconsumed planned use within reach of the
  frontier; the plan's *head* is the furthest use matched, its *tail* the
  first use not yet consumed, and the tail never lags the head by more than
  `trail` uses (uses served from the kernel's page cache never reach the
  daemon; workers read out of order). A reader that comes for a use the
  tail passed (a DataLoader's workers each read a batch of their own, so
  8 x 64 samples are in progress at once) grows the trail to twice its
  lag, and later plans start with that trail. Readers that skipped a
  stretch the daemon never saw (the page cache served it; a resumed epoch
  skipped its first batches) are found again: `RESYNC_READS` unmatched
  reads in a row whose uses lie close together beyond reach move the plan
  to them. Reads a plan does not expect are
  counted and otherwise ignored, so a plan that lies costs at most one
  lookahead window of wasted prefetch, also counted.
- **Prefetch.** Blocks of the next `lookahead_blocks` uses after the head
  that are neither cached nor in flight are fetched in runs of contiguous
  blocks, holding the fetcher's `prefetch_slots` like read-ahead, so demand
  misses always find a connection. Of those slots, only as many are used
  as keep the link busy: twice the bandwidth-delay
  product, from the shortest one-block fetch (the RTT) and the highest
  delivery rate of the last `LINK_WINDOW_S`. More would only share the
  link among more blocks and delay the one needed next. The lookahead
  is sized from measurement:
  the blocks readers consume during two fetch latencies (which hold the
  link's RTT and transfer time) plus `LOOKAHEAD_MARGIN_S` of jitter, doubled for
  a while whenever readers overtake the prefetch frontier, and bounded by
  the plan's share of the memory budget (config.MemoryBudget.plan_bytes):
  prefetched blocks are held in memory until their planned use, so blocks
  in flight plus blocks held stay within it.
- **Eviction.** The cache asks `distance(key)`: planned uses until the
  block's next use (infinite if none in any plan); for a block held for
  its next use, the use after that one, since the held copy covers the
  next. So prefetching never displaces a cached block that is needed
  before the prefetched one is needed again, and the cache's contents
  follow Belady's rule as if there were no prefetch. See
  cache/plan_admission.py for the rule (over the plan's horizon).

A plan lives as long as its control connection: closing it (or the
process ending) cancels the plan, which stops its prefetch at once (runs
still waiting for a connection are dropped; at most `prefetch_slots`
requests finish). A plan whose every use was served ends by itself.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from ..cache import BlockCache, BlockKey
from ..cache.plan_eviction import INFINITE
from ..cache.store import punch_hole
from ..config import COALESCE_BLOCKS, MemoryBudget
from ..control.server import Lines, Progress
from ..errors import CachefsError
from ..fetch.fetcher import Fetcher
from ..fetch.runs import missing_runs
from ..metrics import Stats
from ..namespace.tree import Inode, Namespace, block_length
from ..prefetch.readahead import logging_failure
from ..read.held import HeldBlocks, Owner
from .stats import TrainingStats

log = logging.getLogger(__name__)

PLANS_DIR = "plans"
MAX_PLANS = 64
# Plan lines carry up to a few thousand reads; a line that long is no plan.
MAX_LINE_BYTES = 8 << 20
# While a plan is being sent, the longest pause between two of its lines.
LINE_TIMEOUT_S = 120.0
CHUNK_ENTRIES = 1 << 16  # 512 KiB of entries
MEMORY_CHUNKS = 8  # 512 K entries (4 MiB) per plan in memory; the rest waits on disk
# Entries indexed ahead of the tail for next-use lookups, shared by all
# plans: up to ~180 bytes each (when every use is of another block), so
# 512 K entries cost 90 MiB at most. Beyond the horizon a block counts as
# not used again.
HORIZON_BUDGET_ENTRIES = 1 << 19
MIN_HORIZON_ENTRIES = 4096
# Lookahead bounds, in blocks. The initial value covers 60 ms of a 500 MB/s
# link before anything is measured.
MIN_LOOKAHEAD_BLOCKS = 8
INITIAL_LOOKAHEAD_BLOCKS = 32
MAX_LOOKAHEAD_BLOCKS = 4096
MAX_BOOST = 8.0
# A read matches a planned use at most this far beyond the prefetch frontier.
MATCH_SLACK_ENTRIES = 256
MIN_TRAIL_ENTRIES = 256
# The trail grows to cover the readers seen furthest behind the head (DataLoader
# workers each read a batch of their own: 8 workers x 64 samples are 512 uses
# in progress at once), up to this. Uses passed unread are remembered this long.
MAX_TRAIL_ENTRIES = 1 << 16
PASSED_MEMORY_ENTRIES = 4096
# Reads in a row, none matched, whose next uses lie beyond reach but close
# together: the readers are there (they skipped a stretch the daemon never
# saw: the page cache served it, or a resumed epoch skipped its first
# batches), and the plan moves to them.
RESYNC_READS = 8
RECENT_BLOCKS = 16  # one sample's read split into several FUSE reads is one use
TICK_S = 0.25
# A plan whose readers matched nothing for this long gives up the blocks held
# for it when another plan needs the prefetch budget (an abandoned or paused
# plan must not starve the others; it keeps them while alone).
IDLE_PLAN_S = 10.0
RATE_SMOOTHING = 0.3  # weight of the newest tick in the rate averages
# Consumption covered beyond two fetch latencies: a pause of the link or of
# this process (GC, a busy CPU) must not reach the readers.
LOOKAHEAD_MARGIN_S = 0.5
INITIAL_LATENCY_S = 0.1
# Bytes in flight before the link is measured: about the bandwidth-delay
# product of 1 Gbit/s at 60 ms. More would share the link among more blocks
# and delay the first batch, which a cold epoch waits for.
INITIAL_INFLIGHT_BYTES = 8 << 20
MIN_CONCURRENCY_BLOCKS = 2
LINK_WINDOW_S = 10.0
_BLOCK_BITS = 32


class EntryStore:
    """An append-only sequence of plan entries: chunks in memory, later chunks in a spill file."""

    def __init__(self, spill_path: Path) -> None:
        self._spill_path = spill_path
        self._fd: int | None = None
        self._memory: dict[int, array.array[int]] = {}
        self._loaded: collections.OrderedDict[int, array.array[int]] = collections.OrderedDict()
        self._current: array.array[int] = array.array("Q")
        self.length = 0
        self.spilled_chunks = 0
        self._punched_chunks = 0  # chunks [0, this) are punched out of the spill file

    def append(self, value: int) -> None:
        self._current.append(value)
        self.length += 1
        if len(self._current) == CHUNK_ENTRIES:
            number = self.length // CHUNK_ENTRIES - 1
            if len(self._memory) < MEMORY_CHUNKS:
                self._memory[number] = self._current
            else:
                self._spill(number, self._current)
            self._current = array.array("Q")

    def entries(self, start: int, stop: int) -> Iterator[int]:
        """Entries [start, stop) in order."""
        index = start
        while index < stop:
            number, offset = divmod(index, CHUNK_ENTRIES)
            chunk = self._chunk(number)
            end = min(len(chunk), offset + stop - index)
            yield from chunk[offset:end]
            index += end - offset

    def drop_before(self, index: int) -> None:
        """Forget the chunks wholly before `index`: from memory, and from the spill file (punched
        out, so a plan of many millions of uses holds only the disk space of what is still ahead)."""
        for number in [n for n in self._memory if (n + 1) * CHUNK_ENTRIES <= index]:
            del self._memory[number]
        for number in [n for n in self._loaded if (n + 1) * CHUNK_ENTRIES <= index]:
            del self._loaded[number]
        done = index // CHUNK_ENTRIES
        if self._fd is not None and done > self._punched_chunks:
            chunk_bytes = CHUNK_ENTRIES * array.array("Q").itemsize
            try:
                punch_hole(self._fd, self._punched_chunks * chunk_bytes, (done - self._punched_chunks) * chunk_bytes)
            except OSError as exc:
                log.debug("cannot free the spilled plan entries before %d: %s", index, exc)
            self._punched_chunks = done

    def close(self) -> None:
        self._memory.clear()
        self._loaded.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._spill_path.unlink(missing_ok=True)

    def _chunk(self, number: int) -> array.array[int]:
        if number == self.length // CHUNK_ENTRIES:
            return self._current
        chunk = self._memory.get(number) or self._loaded.get(number)
        if chunk is None:
            assert self._fd is not None
            chunk = array.array("Q")
            data = os.pread(self._fd, CHUNK_ENTRIES * chunk.itemsize, number * CHUNK_ENTRIES * chunk.itemsize)
            if len(data) != CHUNK_ENTRIES * chunk.itemsize:
                raise CachefsError(f"spilled plan entries in {self._spill_path} are cut short")
            chunk.frombytes(data)
            self._loaded[number] = chunk
            while len(self._loaded) > 2:
                self._loaded.popitem(last=False)
        return chunk

    def _spill(self, number: int, chunk: array.array[int]) -> None:
        """Write a chunk to the spill file, whole; raises CachefsError (the plan is refused) if it cannot."""
        data, offset = memoryview(chunk.tobytes()), number * CHUNK_ENTRIES * chunk.itemsize
        try:
            if self._fd is None:
                self._spill_path.parent.mkdir(mode=0o700, exist_ok=True)
                self._fd = os.open(self._spill_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            while data:  # a nearly full disk writes part of it, then fails with ENOSPC
                written = os.pwrite(self._fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:
            raise CachefsError(f"plan rejected: cannot spill its entries to {self._spill_path.parent}: "
                               f"{exc.strerror or exc}") from None
        self.spilled_chunks += 1


class PlanFiles:
    """A plan's file table, compact: a plan may name millions of files (an Inode and a
    dict entry each took ~490 bytes; this takes 24 per file, plus 12 once sealed).

    Files are appended while the plan is received; `seal` (when it is complete)
    sorts their ids for lookups, which until then find nothing. A file named
    twice is found at its first index.
    """

    def __init__(self) -> None:
        self._ids = array.array("Q")
        self._versions = array.array("Q")
        self.sizes = array.array("Q")
        self._sorted_ids = array.array("Q")  # set whole by seal (the cache writer's thread reads it)
        self._order = array.array("L")  # file index of each sorted id

    def __len__(self) -> int:
        return len(self._ids)

    def append(self, inode: Inode) -> None:
        self._ids.append(int.from_bytes(inode.file_id, "big"))
        self._versions.append(int.from_bytes(inode.version, "big"))
        self.sizes.append(inode.size)

    def seal(self) -> None:
        """Make the files findable (sorting by id; the first of equal ids first)."""
        order = sorted(range(len(self._ids)), key=self._ids.__getitem__)
        sorted_ids = array.array("Q", (self._ids[index] for index in order))
        self._order = array.array("L", order)
        self._sorted_ids = sorted_ids

    def index_of(self, file_id: bytes, version: bytes) -> int | None:
        sorted_ids, order = self._sorted_ids, self._order
        wanted = int.from_bytes(file_id, "big")
        at = bisect.bisect_left(sorted_ids, wanted)
        if at == len(sorted_ids) or sorted_ids[at] != wanted:
            return None
        index = order[at]
        return index if self._versions[index] == int.from_bytes(version, "big") else None

    def file_id(self, index: int) -> bytes:
        return self._ids[index].to_bytes(8, "big")

    def version(self, index: int) -> bytes:
        return self._versions[index].to_bytes(8, "big")


class Plan:
    """One loader's planned block uses and how far its readers have come.

    Entries are `file index << 32 | block number`; the file table maps an
    index to the snapshot's inode. Positions are absolute entry numbers;
    the window arrays hold [base, horizon).
    """

    def __init__(self, plan_id: int, store: EntryStore, block_size: int) -> None:
        self.id = plan_id
        self.epoch: int | None = None  # set once the plan is accepted: a rejected plan starts no epoch
        self.generation: str | None = None  # the snapshot shown when it started arriving
        self.store = store
        self.block_size = block_size
        self.created_s = self.progress_s = time.monotonic()  # progress: the last use matched
        self.files = PlanFiles()
        self.reads = 0
        self.complete = False  # the client sent all of it (mark_complete)
        self.cancelled = False
        self.finished = trio.Event()
        self.tail = self.head = self.issued = self.horizon = 0
        self.trail = MIN_TRAIL_ENTRIES
        self.min_trail = MIN_TRAIL_ENTRIES  # grows when a reader comes for a use the tail passed
        self._passed: collections.OrderedDict[int, int] = collections.OrderedDict()  # key -> use passed unread
        self.late_reads = 0
        self._beyond: list[int] = []  # next uses beyond reach of the reads since the last match
        self.resyncs = 0
        self._base = 0
        self._keys: array.array[int] = array.array("Q")
        self._following: array.array[int] = array.array("q")
        self._consumed = bytearray()
        # Read from the cache writer's thread too: single dict reads, never iterated there.
        self.next_use: dict[int, int] = {}
        self._last_use: dict[int, int] = {}
        self.released: collections.deque[int] = collections.deque(maxlen=1 << 16)
        # Blocks this plan saw read last: one sample's read split into several
        # FUSE reads is one use. Per plan, so a read from before a plan began
        # (the previous epoch's last samples) never hides one of its uses.
        self.recent: collections.deque[BlockKey] = collections.deque(maxlen=RECENT_BLOCKS)
        self.prefetched_blocks = self.used_blocks = self.wasted_blocks = self.matched_blocks = 0
        self.reported_used = self.reported_wasted = 0  # already added to the mount's counters
        self.skipped_uses = 0
        self._last_appended = -1

    # -- building -------------------------------------------------------------------

    def add_file(self, inode: Inode) -> None:
        self.files.append(inode)

    def mark_complete(self) -> None:
        """The client sent all of it: its files can be looked up from now on."""
        self.files.seal()
        self.complete = True

    def add_read(self, file_index: int, offset: int, length: int) -> None:
        """One planned read (already validated): an entry per block, consecutive repeats merged."""
        self.reads += 1
        first, last = offset // self.block_size, (offset + length - 1) // self.block_size
        for blockno in range(first, last + 1):
            key = file_index << _BLOCK_BITS | blockno
            if key != self._last_appended:
                self.store.append(key)
                self._last_appended = key

    # -- keys -----------------------------------------------------------------------

    def covers(self, inode: Inode) -> bool:
        return self.files.index_of(inode.file_id, inode.version) is not None

    def key_of(self, key: BlockKey) -> int | None:
        index = self.files.index_of(key.file_id, key.version)
        return None if index is None else index << _BLOCK_BITS | key.blockno

    def block_key(self, key: int) -> BlockKey:
        index = key >> _BLOCK_BITS
        return BlockKey(self.files.file_id(index), self.files.version(index), key & ((1 << _BLOCK_BITS) - 1))

    def block_length(self, key: int) -> int:
        return block_length(self.files.sizes[key >> _BLOCK_BITS], key & ((1 << _BLOCK_BITS) - 1), self.block_size)

    def key_at(self, position: int) -> int:
        return self._keys[position - self._base]

    def is_consumed(self, position: int) -> bool:
        return bool(self._consumed[position - self._base])

    def consumed_at(self, position: int) -> bool:
        """Whether a reader used the block at `position` (False once forgotten, behind the window)."""
        return position >= self._base and position < self.horizon and self.is_consumed(position)

    # -- next uses --------------------------------------------------------------------

    def distance(self, key: BlockKey) -> int:
        """Planned uses from the tail to the block's next unconsumed use (INFINITE: none in the horizon)."""
        entry = self.key_of(key)
        position = self.next_use.get(entry) if entry is not None else None
        return INFINITE if position is None else max(0, position - self.tail)

    def distance_after(self, position: int, key: BlockKey) -> int:
        """For a block held for its use at `position`: planned uses to the use after that one (the held
        copy covers that one). Once the tail has passed `position` the copy covers nothing: `distance`."""
        if position < self.tail:
            return self.distance(key)
        after = self.next_use_after(position)
        return INFINITE if after is None else max(0, after - self.tail)

    def extend_horizon(self, entries: int) -> None:
        """Index the uses up to `entries` past the tail (as far as the plan has arrived)."""
        stop = min(self.store.length, self.tail + entries)
        if stop <= self.horizon:
            return
        for position, key in zip(range(self.horizon, stop), self.store.entries(self.horizon, stop), strict=True):
            self._keys.append(key)
            self._following.append(-1)
            self._consumed.append(0)
            last = self._last_use.get(key)
            if last is not None:
                self._following[last - self._base] = position
            if key not in self.next_use:
                self.next_use[key] = position
            self._last_use[key] = position
        self.horizon = stop

    # -- following the readers ------------------------------------------------------------

    def observe(self, key: int, reach: int) -> bool:
        """A reader used block `key`: consume its next planned use if within `reach` of the frontier.

        A read of a block whose use the tail passed unread moments ago, and that
        has no other use within reach, is that use read late (a slow worker):
        the trail grows to cover readers that far behind.
        """
        passed = self._passed.pop(key, None)
        position = self.next_use.get(key)
        if position is None or position >= max(self.head, self.issued) + reach:
            if passed is None:
                return position is not None and self._resync(position, reach)
            self.late_reads += 1
            self.min_trail = min(MAX_TRAIL_ENTRIES, max(self.min_trail, 2 * (self.head - passed)))
            self.trail = max(self.trail, self.min_trail)
            return True
        self._consume(position)
        self.matched_blocks += 1
        self.progress_s = time.monotonic()
        self._beyond.clear()
        return True

    def _resync(self, position: int, reach: int) -> bool:
        """An unmatched read whose next use is at `position`, beyond reach. After RESYNC_READS of them
        in a row within `reach + trail` of each other, consume them all: the frontier moves there."""
        self._beyond.append(position)
        if len(self._beyond) < RESYNC_READS:
            return False
        beyond, self._beyond = self._beyond, []
        if max(beyond) - min(beyond) >= reach + self.trail:
            return False
        for use in sorted(set(beyond)):  # ascending: the tail never passes one still to consume
            if not self.is_consumed(use):
                self._consume(use)
        self._passed.clear()  # the uses jumped over were not read late: nobody is coming for them
        self.issued = max(self.issued, min(beyond))  # nor are they worth prefetching
        self.resyncs += 1
        self.matched_blocks += len(beyond)
        self.progress_s = time.monotonic()
        log.info("plan %d: its readers are at use %d (%d uses skipped since the last match)",
                 self.id, max(beyond), self.skipped_uses)
        return True

    def _consume(self, position: int) -> None:
        self._consumed[position - self._base] = 1
        key = self._keys[position - self._base]
        if self.next_use.get(key) == position:
            self._advance_next_use(key, position)
        self.head = max(self.head, position + 1)
        self.advance_tail()

    def _advance_next_use(self, key: int, position: int) -> None:
        following = self._following[position - self._base]
        while following != -1 and self._consumed[following - self._base]:
            following = self._following[following - self._base]
        if following == -1:
            del self.next_use[key]
            self.released.append(key)
        else:
            self.next_use[key] = following

    def advance_tail(self) -> None:
        """Move the tail over consumed uses, and over any more than `trail` behind the head."""
        limit = self.head - self.trail
        while self.tail < self.horizon and (self._consumed[self.tail - self._base] or self.tail < limit):
            self._pass(self.tail)
            self.tail += 1
        if self.complete and self.tail >= self.store.length:
            self.finished.set()
        if self.tail - self._base >= CHUNK_ENTRIES and self.tail - self._base >= len(self._keys) // 2:
            drop = self.tail - self._base
            del self._keys[:drop]
            del self._following[:drop]
            del self._consumed[:drop]
            self._base = self.tail
            self.store.drop_before(self.tail)

    def _pass(self, position: int) -> None:
        offset = position - self._base
        key = self._keys[offset]
        if not self._consumed[offset]:
            self.skipped_uses += 1
            self._passed[key] = position
            self._passed.move_to_end(key)
            if len(self._passed) > PASSED_MEMORY_ENTRIES:
                self._passed.popitem(last=False)
            if self.next_use.get(key) == position:
                self._advance_next_use(key, position)
        if self._last_use.get(key) == position:
            del self._last_use[key]

    def next_use_after(self, position: int) -> int | None:
        """The first unconsumed use of the block at `position` after it (any thread: may answer None)."""
        if position < self._base:
            return None  # forgotten: behind the window
        try:
            following = self._following[position - self._base]
            while following != -1 and self._consumed[following - self._base]:
                following = self._following[following - self._base]
        except IndexError:  # the window moved meanwhile
            return None
        return None if following == -1 else following

    def end(self) -> None:
        """Cancel: no more prefetch, no more advice."""
        self.cancelled = True
        self.finished.set()
        self.next_use.clear()
        self.released.clear()
        self.store.close()

    def summary(self) -> dict[str, Any]:
        return {
            "plan": self.id,
            "epoch": self.epoch,
            "files": len(self.files),
            "reads": self.reads,
            "blocks": self.store.length,
            "complete": self.complete,
            "position": self.tail,
            "head": self.head,
            "prefetched_blocks": self.prefetched_blocks,
            "prefetch_used_blocks": self.used_blocks,
            "prefetch_wasted_blocks": self.wasted_blocks,
            "skipped_uses": self.skipped_uses,
            "late_reads": self.late_reads,
            "resyncs": self.resyncs,
            "trail": self.trail,
            "spilled_bytes": self.store.spilled_chunks * CHUNK_ENTRIES * 8,
            "age_s": time.monotonic() - self.created_s,
        }


@dataclasses.dataclass(slots=True)
class PlanHold:
    """The note of a block prefetched for a plan's use at `position` and held for it (HeldBlocks)."""

    plan: Plan
    position: int

    def wanted(self) -> bool:
        """Still to come: the plan neither ended nor moved past the use, nor did a reader consume it."""
        plan = self.plan
        return not plan.cancelled and self.position >= plan.tail and not plan.consumed_at(self.position)

    def used(self) -> None:
        self.plan.used_blocks += 1

    def wasted(self) -> None:
        self.plan.wasted_blocks += 1


class ActivePlans:
    """The plans being followed, and what they tell the cache about a block's next use.

    The cache's eviction advisor (cache/plan_admission.py) and read-ahead's
    judge of which files a plan covers. The planner adds and ends plans on
    the trio thread; the cache writer's worker thread reads them
    (`distance`, `victim_hints`, `requeue_hints`) through copies of the
    dict's values and single dict reads, never iterating a live dict.
    """

    def __init__(self, held: HeldBlocks) -> None:
        self.plans: dict[int, Plan] = {}
        self._held = held

    def active(self) -> bool:
        return bool(self.plans)

    def covers(self, inode: Inode) -> bool:
        """Whether an active plan reads this file (read-ahead then stays off it)."""
        return any(plan.covers(inode) for plan in self.plans.values())

    def distance(self, key: BlockKey) -> int:
        """The cache asks (any thread): planned uses until the block's next use, over all plans.

        For a block held in memory for its planned use, that use is covered:
        what counts for the cache is the use after it.
        """
        hold = self._held.note_of(key, Owner.PLAN)
        best = INFINITE
        for plan in list(self.plans.values()):
            if isinstance(hold, PlanHold) and hold.plan is plan:
                best = min(best, plan.distance_after(hold.position, key))
            else:
                best = min(best, plan.distance(key))
        return best

    def victim_hints(self) -> Iterator[BlockKey]:
        """The cache asks (any thread): blocks the plans have finished with, oldest first."""
        for plan in list(self.plans.values()):
            while True:
                try:
                    entry = plan.released.popleft()
                except IndexError:
                    break
                yield plan.block_key(entry)

    def requeue_hints(self, keys: list[BlockKey]) -> None:
        """Hints taken but not used as victims, for a later decision (any thread)."""
        for key in keys:
            for plan in list(self.plans.values()):
                entry = plan.key_of(key)
                if entry is not None:
                    plan.released.append(entry)
                    break


class Planner:
    """Follows the active plans: matches reads to them, prefetches along them, keeps the training statistics."""

    def __init__(
        self,
        namespace: Namespace,
        cache: BlockCache,
        fetcher: Fetcher,
        held: HeldBlocks,
        active: ActivePlans,
        stats: Stats,
        *,
        budget: MemoryBudget,
        cache_dir: Path,
    ) -> None:
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._held = held
        self._stats = stats
        block_size = self._block_size = budget.block_size_bytes
        self._plans_dir = cache_dir / PLANS_DIR
        shutil.rmtree(self._plans_dir, ignore_errors=True)  # left over by a crash
        self._plans = active.plans  # this adds and ends them; ActivePlans answers the cache
        self._next_id = 1
        self.training = TrainingStats(stats)
        capacity_blocks = max(1, cache.capacity_bytes // block_size)
        self.max_lookahead_blocks = max(MIN_LOOKAHEAD_BLOCKS,
                                        min(MAX_LOOKAHEAD_BLOCKS, budget.plan_bytes // block_size))
        self.lookahead_blocks = min(INITIAL_LOOKAHEAD_BLOCKS, self.max_lookahead_blocks)
        self._horizon_entries = min(HORIZON_BUDGET_ENTRIES, max(MIN_HORIZON_ENTRIES, 4 * capacity_blocks))
        self._slots = int(fetcher.prefetch_slots.total_tokens)
        self._learned_trail = MIN_TRAIL_ENTRIES  # how far behind the head readers were seen: the next plan starts there
        self._inflight_blocks = 0
        # Blocks of runs started and not finished (a run waits for a connection before its
        # blocks are in flight): another plan's `_issue` must not ask for them again.
        self._scheduled: collections.Counter[BlockKey] = collections.Counter()
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        # Measurements behind the lookahead.
        self.latency_s = INITIAL_LATENCY_S
        self.consume_blocks_per_s = 0.0  # planned uses served
        self.fetch_bytes_per_s = 0.0  # fetched by plan prefetch
        self.concurrency_blocks = max(MIN_CONCURRENCY_BLOCKS, min(INITIAL_INFLIGHT_BYTES // block_size,
                                                                  self._slots))
        self.rtt_s: float | None = None
        self.link_bytes_per_s: float | None = None
        self._rtt_samples: collections.deque[tuple[float, float]] = collections.deque()
        self._rate_samples: collections.deque[tuple[float, float]] = collections.deque()
        self._tick_link_bytes = stats.fetched_bytes
        self._boost = 1.0
        self._overtaken = False
        self._tick_s = time.monotonic()
        self._tick_consumed = 0
        self._tick_fetched = 0
        self._consumed_total = 0
        self._fetched_total = 0

    # -- hooks ------------------------------------------------------------------------

    def observe(self, key: BlockKey) -> None:
        """A reader asks for a block (trio thread; cheap): the plans that expect it move on."""
        reach = self.lookahead_blocks + MATCH_SLACK_ENTRIES
        fresh = matched = False
        for plan in self._plans.values():
            if key in plan.recent:
                continue
            fresh = True
            plan.recent.append(key)
            entry = plan.key_of(key)
            if entry is not None and plan.observe(entry, reach):
                matched = True
                self._learned_trail = max(self._learned_trail, plan.min_trail)
                self._consumed_total += 1
                if plan.head > plan.issued:
                    self._overtaken = True
        if fresh:
            if not matched:
                self._stats.plan_unplanned_blocks += 1
            self._wake.set()

    def cancel_all(self, reason: str, keep_generation: str | None = None) -> None:
        """End every plan (the snapshot changed under them), except those that started
        arriving while `keep_generation` was already shown (resolved against it only)."""
        for plan in list(self._plans.values()):
            if keep_generation is not None and plan.generation == keep_generation:
                continue
            log.info("cancelling plan %d: %s", plan.id, reason)
            self._end(plan)

    # -- the background task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prefetch along the plans and keep the statistics, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            next_tick = trio.current_time()
            while True:
                with trio.move_on_after(TICK_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                if trio.current_time() >= next_tick:
                    next_tick = trio.current_time() + TICK_S
                    self._tick()
                    self._drop_passed()
                    self._reclaim_from_idle_plans()
                for plan in list(self._plans.values()):
                    try:
                        self._issue(plan)
                    except CachefsError as exc:  # its spilled entries cannot be read back
                        log.error("plan %d: %s; cancelling it", plan.id, exc)
                        self._end(plan)

    def _drop_passed(self) -> None:
        """Forget held blocks their plan moved past (or ended) without reading them: wasted."""
        self._drop_held(lambda hold: hold.plan.cancelled or hold.position < hold.plan.tail)

    def _reclaim_from_idle_plans(self) -> None:
        """When the prefetch budget is full and several plans are open, drop the blocks held for
        plans idle for IDLE_PLAN_S (wasted): the others prefetch again."""
        if len(self._plans) < 2 or self._inflight_blocks + self._held_blocks() < self.lookahead_blocks:
            return
        idle_since = time.monotonic() - IDLE_PLAN_S
        self._drop_held(lambda hold: hold.plan.progress_s < idle_since)

    def _drop_held(self, unwanted: Callable[[PlanHold], bool]) -> None:
        """Forget the held blocks `unwanted` picks (counted wasted for their plans); those on
        their way to the cache are judged once written (PlanHold.wanted)."""
        for key, held in self._held.keys_of(Owner.PLAN):
            if not held.writing and isinstance(held.note, PlanHold) and unwanted(held.note):
                self._held.drop(key)

    def _held_blocks(self) -> int:
        """Blocks' worth of memory held for the plans."""
        return -(-self._held.bytes_of(Owner.PLAN) // self._block_size)

    def _tick(self) -> None:
        """Update the rates and the lookahead; judge the hit ratio window."""
        now = time.monotonic()
        elapsed = max(1e-3, now - self._tick_s)
        consumed = (self._consumed_total - self._tick_consumed) / elapsed
        fetched = (self._fetched_total - self._tick_fetched) / elapsed
        delivered = (self._stats.fetched_bytes - self._tick_link_bytes) / elapsed  # demand fetches too
        self._tick_s, self._tick_consumed, self._tick_fetched = now, self._consumed_total, self._fetched_total
        self._tick_link_bytes = self._stats.fetched_bytes
        self._measure_link(now, delivered)
        if self._plans:
            # Rates are averaged over ticks with consumption only: a pause (evaluation,
            # checkpoints, the gap between epochs) keeps the lookahead for the restart,
            # and a plan nobody follows never grows past its first window.
            if consumed > 0:
                self.consume_blocks_per_s = _smoothed(self.consume_blocks_per_s, consumed)
                self.fetch_bytes_per_s = _smoothed(self.fetch_bytes_per_s, fetched)
            if self._overtaken:
                self._boost = min(MAX_BOOST, self._boost * 2)
            else:
                self._boost = max(1.0, self._boost * 0.9)
            self._overtaken = False
            if self.consume_blocks_per_s > 0:
                wanted = self.consume_blocks_per_s * (2 * self.latency_s + LOOKAHEAD_MARGIN_S) * self._boost
                self.lookahead_blocks = max(MIN_LOOKAHEAD_BLOCKS, min(self.max_lookahead_blocks, math.ceil(wanted)))
            for plan in self._plans.values():
                self._sync_counters(plan)
        self.training.tick()

    def _measure_link(self, now: float, delivered: float) -> None:
        """RTT and link rate over the last LINK_WINDOW_S; the prefetch concurrency from them."""
        if delivered > 0:
            self._rate_samples.append((now, delivered))
        for samples in (self._rate_samples, self._rtt_samples):
            while samples and samples[0][0] < now - LINK_WINDOW_S:
                samples.popleft()
        if not self._rate_samples or not self._rtt_samples:
            return
        self.link_bytes_per_s = max(rate for _t, rate in self._rate_samples)
        self.rtt_s = min(rtt for _t, rtt in self._rtt_samples)
        wanted = 2 * self.link_bytes_per_s * self.rtt_s / self._block_size + 1
        self.concurrency_blocks = max(MIN_CONCURRENCY_BLOCKS, min(self._slots, math.ceil(wanted)))

    def _issue(self, plan: Plan) -> None:
        """Ask for the blocks of the plan's next `lookahead_blocks` uses that are not cached or in flight."""
        if plan.cancelled:
            return
        plan.trail = max(plan.min_trail, 2 * self.lookahead_blocks)
        plan.extend_horizon(max(self._horizon_entries // max(1, len(self._plans)), MIN_HORIZON_ENTRIES,
                                plan.head - plan.tail + self.lookahead_blocks))
        target = min(plan.head + self.lookahead_blocks, plan.horizon)
        position = max(plan.issued, plan.tail)
        run: list[tuple[int, int]] = []  # (entry key, position)
        asked: set[int] = set()
        held_blocks = self._held_blocks()
        memory_blocks = self._inflight_blocks + held_blocks + self._readahead_blocks()
        while (position < target and self._inflight_blocks + len(run) < self.concurrency_blocks
               and self._inflight_blocks + held_blocks + len(run) < self.lookahead_blocks
               and memory_blocks + len(run) < self.max_lookahead_blocks):
            entry = plan.key_at(position)
            if not plan.is_consumed(position) and entry not in asked:
                key = plan.block_key(entry)
                if key not in self._scheduled and not self._at_hand(key):
                    if run and (entry != run[-1][0] + 1 or len(run) >= COALESCE_BLOCKS):
                        self._start_run(plan, run)
                        run = []
                    run.append((entry, position))
                    asked.add(entry)
            position += 1
        if run:
            self._start_run(plan, run)
        plan.issued = position

    def _readahead_blocks(self) -> int:
        """Blocks' worth of memory read-ahead holds (other files' streams, fills, small files):
        plan prefetch leaves it out of its share of the memory budget, which bounds both together."""
        return -(-self._fetcher.readahead_memory_bytes() // self._block_size)

    def _start_run(self, plan: Plan, run: list[tuple[int, int]]) -> None:
        assert self._nursery is not None
        self._inflight_blocks += len(run)
        self._scheduled.update(plan.block_key(entry) for entry, _position in run)
        self._nursery.start_soon(logging_failure, self._prefetch_run, plan, run)

    async def _prefetch_run(self, plan: Plan, run: list[tuple[int, int]]) -> None:
        """Fetch a run of contiguous blocks (one request) for `plan`, at read-ahead priority."""
        try:
            async with self._fetcher.prefetch_slots:
                if plan.cancelled:
                    return
                # Readers may have read or fetched some meanwhile: fetch the first stretch still
                # needed; what follows becomes runs of their own.
                def missing(item: tuple[int, int]) -> bool:
                    entry, position = item
                    return position >= plan.tail and not plan.consumed_at(position) and not self._at_hand(
                        plan.block_key(entry))

                stretches = list(missing_runs(run, missing))
                if not stretches:
                    return
                wanted = stretches[0]
                for stretch in stretches[1:]:
                    self._start_run(plan, stretch)
                keys = [plan.block_key(entry) for entry, _position in wanted]
                lengths = [plan.block_length(entry) for entry, _position in wanted]
                notes = [PlanHold(plan, position) for _entry, position in wanted]

                started = trio.current_time()
                fetched = await self._fetcher.plan_prefetch(keys, keys[0].blockno * self._block_size, lengths, notes)
                if not fetched:
                    log.debug("plan %d: prefetch of %s failed", plan.id, keys[0])
                    return
                latency_s = trio.current_time() - started
                self.latency_s += RATE_SMOOTHING * (latency_s - self.latency_s)
                if len(keys) == 1:
                    self._rtt_samples.append((time.monotonic(), latency_s))
                self._fetched_total += sum(lengths)
                self._stats.plan_prefetch_blocks += len(keys)
                plan.prefetched_blocks += len(keys)
        finally:
            self._inflight_blocks -= len(run)
            for entry, _position in run:
                key = plan.block_key(entry)
                self._scheduled[key] -= 1
                if self._scheduled[key] <= 0:
                    del self._scheduled[key]
            self._sync_counters(plan)

    def _at_hand(self, key: BlockKey) -> bool:
        """Held in memory, in flight or cached: no prefetch needed."""
        return key in self._held or self._fetcher.in_flight_or_cached(key)

    def _sync_counters(self, plan: Plan) -> None:
        """Carry a plan's used/wasted counts into the mount's counters."""
        self._stats.plan_prefetch_used_blocks += plan.used_blocks - plan.reported_used
        self._stats.plan_prefetch_wasted_blocks += plan.wasted_blocks - plan.reported_wasted
        plan.reported_used, plan.reported_wasted = plan.used_blocks, plan.wasted_blocks

    # -- plans over the control socket ---------------------------------------------------------

    async def handle_plan(self, request: dict[str, Any], progress: Progress, lines: Lines) -> dict[str, Any]:
        """The `plan` command: receive a plan, follow it until the client closes the connection or it is done."""
        if len(self._plans) >= MAX_PLANS:
            raise CachefsError(f"too many plans at once (at most {MAX_PLANS}); close finished ones")
        epoch = request.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
            raise CachefsError("epoch must be a non-negative integer")
        plan_id = self._next_id
        self._next_id += 1
        plan = Plan(plan_id, EntryStore(self._plans_dir / f"{plan_id}.entries"), self._block_size)
        shown = self._namespace.summary()
        plan.generation = shown.generation if shown is not None else None
        plan.min_trail = plan.trail = self._learned_trail
        self._plans[plan.id] = plan
        try:
            if not await self._receive(plan, lines):
                log.info("plan %d: the client went away before sending all of it", plan.id)
                return plan.summary()
            plan.mark_complete()
            plan.epoch = self.training.start_epoch(epoch)
            plan.advance_tail()
            log.info("plan %d (epoch %d): %d reads of %d files, %d block uses",
                     plan.id, plan.epoch, plan.reads, len(plan.files), plan.store.length)
            await progress({"state": "active", **plan.summary()})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_closed, lines, nursery.cancel_scope)
                await plan.finished.wait()
                nursery.cancel_scope.cancel()
            done = plan.complete and plan.tail >= plan.store.length
            return {"state": "finished" if done else "cancelled", **plan.summary()}
        finally:
            self._end(plan)

    async def _receive(self, plan: Plan, lines: Lines) -> bool:
        """Read the plan's lines up to its end marker; False if the client closed the connection first."""
        directories: dict[str, Inode | None] = {}
        while True:
            try:
                with trio.fail_after(LINE_TIMEOUT_S):
                    line = await lines.receive_line(MAX_LINE_BYTES)
            except trio.TooSlowError:
                raise CachefsError(f"plan rejected: no line for {LINE_TIMEOUT_S:g} s before its end marker") from None
            if line is None:
                return False
            if plan.cancelled:  # cancel_all while it was being sent: its entry store is closed
                raise CachefsError("plan cancelled while it was being sent: the mount moved to a new snapshot; "
                                   "send it again")
            try:
                message = json.loads(line)
            except ValueError:
                raise CachefsError("malformed plan line: not JSON") from None
            if not isinstance(message, dict):
                raise CachefsError("malformed plan line: expected an object")
            if message.get("end"):
                return True
            if "files" in message:
                self._add_files(plan, message["files"], directories)
            if "reads" in message:
                _add_reads(plan, message["reads"])
            self._wake.set()
            await trio.lowlevel.checkpoint()

    def _add_files(self, plan: Plan, paths: Any, directories: dict[str, Inode | None]) -> None:
        if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
            raise CachefsError("malformed plan line: files must be a list of paths")
        for path in paths:
            parent_path, _slash, name = path.strip("/").rpartition("/")
            if parent_path not in directories:  # a dataset of many files has few directories
                directories[parent_path] = self._namespace.resolve(parent_path)
            parent = directories[parent_path]
            inode = None
            if parent is not None and parent.is_dir:
                inode = self._namespace.lookup(parent.ino, os.fsencode(name)) if name not in ("", ".") else parent
            if inode is None:
                raise CachefsError(f"plan rejected: no such file in the mounted snapshot: {path or '/'}")
            if not inode.is_file:
                raise CachefsError(f"plan rejected: not a regular file: {path or '/'}")
            plan.add_file(inode)

    def _end(self, plan: Plan) -> None:
        if self._plans.pop(plan.id, None) is None:
            return
        plan.end()
        self._drop_passed()
        self._sync_counters(plan)
        log.info("plan %d ended: %d blocks prefetched, %d used, %d wasted",
                 plan.id, plan.prefetched_blocks, plan.used_blocks, plan.wasted_blocks)

    # -- reporting ----------------------------------------------------------------------------

    def snapshot(self, judge: bool = True) -> dict[str, Any]:
        """Plans, lookahead, link estimates, epochs. Only the trio thread may `judge` (tick the statistics)."""
        if judge:
            self.training.tick()  # judge the reads since the last tick, if there are enough
        plans = list(self._plans.values())  # a copy: the metrics thread reads this too
        return {
            "plans_active": len(plans),
            "plans": [plan.summary() for plan in plans],
            "lookahead_blocks": self.lookahead_blocks,
            "max_lookahead_blocks": self.max_lookahead_blocks,
            "prefetch_latency_s": self.latency_s,
            "prefetch_concurrency_blocks": self.concurrency_blocks,
            "link_rtt_s": self.rtt_s,
            "link_rate_bytes_per_s": self.link_bytes_per_s,
            "consume_rate_blocks_per_s": self.consume_blocks_per_s,
            "prefetch_rate_bytes_per_s": self.fetch_bytes_per_s,
            **self.training.snapshot(),
        }


def _smoothed(average: float, sample: float) -> float:
    """A rate average moved towards the newest tick's sample (the first sample sets it)."""
    return average + (RATE_SMOOTHING if average else 1.0) * (sample - average)


def _add_reads(plan: Plan, reads: Any) -> None:
    """Validate and add reads [file index, offset, length or null]."""
    if not isinstance(reads, list):
        raise CachefsError("malformed plan line: reads must be a list")
    sizes = plan.files.sizes
    for read in reads:
        if not isinstance(read, list) or len(read) != 3:
            raise CachefsError("malformed plan read: expected [file, offset, length]")
        index, offset, length = read
        if not isinstance(index, int) or not 0 <= index < len(sizes):
            raise CachefsError(f"malformed plan read: unknown file index {index!r}")
        if not isinstance(offset, int) or offset < 0:
            raise CachefsError(f"malformed plan read: bad offset {offset!r}")
        size = sizes[index]
        if length is None:
            length = size - offset
        elif not isinstance(length, int) or length < 0:
            raise CachefsError(f"malformed plan read: bad length {length!r}")
        length = min(length, size - offset)
        if length > 0:
            plan.add_read(index, offset, length)
        elif offset > size:
            raise CachefsError(f"plan rejected: offset {offset} is beyond the end of a {size}-byte file "
                               f"(file {index} of the plan)")


async def _cancel_when_closed(lines: Lines, scope: trio.CancelScope) -> None:
    """Wait for the client to close the connection (or send {"cancel": true}), then cancel `scope`."""
    while True:
        line = await lines.receive_line(MAX_LINE_BYTES)
        if line is None:
            break
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("cancel"):
            break
    scope.cancel()
