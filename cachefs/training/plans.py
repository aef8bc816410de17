"""One loader's plan: its block uses in order, followed through its readers' reads (head, tail, trail, next uses)."""

from __future__ import annotations

import array
import collections
import logging
import time
from typing import Any

import trio

from ..cache import BlockKey
from ..cache.plan_eviction import INFINITE
from ..config import MIN_BLOCK_SIZE
from ..namespace.tree import Inode, block_length
from . import entries as entry_store
from .entries import EntryStore, PlanFiles

log = logging.getLogger(__name__)

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
# A plan whose uses read less than this share of the blocks they need is advised
# a smaller block size: a cold epoch fetches whole blocks for each use, and its
# first batches need most blocks at once.
ADVISE_BELOW_READ_SHARE = 0.5
_BLOCK_BITS = 32


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
        self.read_bytes = 0  # the planned reads' bytes
        self.use_bytes = 0  # the bytes of the blocks their uses need (consecutive repeats once)
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
        self._recent: collections.deque[BlockKey] = collections.deque(maxlen=RECENT_BLOCKS)
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

    def add_read(self, file_index: int, offset: int, length: int, *, counted: bool = True) -> None:
        """One planned read (already validated): an entry per block, consecutive repeats merged
        (`counted`: False for the later pieces of a read added in several)."""
        self.reads += counted
        self.read_bytes += length
        first, last = offset // self.block_size, (offset + length - 1) // self.block_size
        for blockno in range(first, last + 1):
            key = file_index << _BLOCK_BITS | blockno
            if key != self._last_appended:
                self.store.append(key)
                self._last_appended = key
                self.use_bytes += block_length(self.files.sizes[file_index], blockno, self.block_size)

    def advised_block_size(self) -> int | None:
        """A block size for this plan's reads, if the mount's is much larger than they are (None: it fits).

        The largest power of two no larger than the mean read, when the reads use less than
        ADVISE_BELOW_READ_SHARE of the blocks they need.
        """
        if not self.reads or self.read_bytes >= ADVISE_BELOW_READ_SHARE * self.use_bytes:
            return None
        mean_read = self.read_bytes // self.reads
        advised = max(MIN_BLOCK_SIZE, 1 << (mean_read.bit_length() - 1)) if mean_read else MIN_BLOCK_SIZE
        return advised if advised < self.block_size else None

    # -- keys -----------------------------------------------------------------------

    def covers(self, inode: Inode) -> bool:
        return self.files.index_of(inode.file_id, inode.version) is not None

    def key_of(self, key: BlockKey) -> int | None:
        index = self.files.index_of(key.file_id, key.version)
        return None if index is None else index << _BLOCK_BITS | key.blockno

    def block_key(self, key: int) -> BlockKey:
        index = key >> _BLOCK_BITS
        return BlockKey(self.files.file_id(index), self.files.version(index), key & ((1 << _BLOCK_BITS) - 1))

    def whole_file(self, key: int) -> bool:
        """Whether the entry's block is its file, whole (a file no larger than a block)."""
        return not key & ((1 << _BLOCK_BITS) - 1) and self.files.sizes[key >> _BLOCK_BITS] <= self.block_size

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

    def hear(self, key: BlockKey, reach: int) -> bool | None:
        """A reader asks for block `key`: whether it matched a planned use, or None if it
        is the use already heard (one sample's read split into several FUSE reads).

        A block heard moments ago is heard again only when its next planned use is
        already due (at or behind the head): the plan uses it twice close together,
        and `add_read` merges only consecutive repeats.
        """
        entry = self.key_of(key)
        if key in self._recent:
            if entry is None or self.next_use.get(entry, self.head + 1) > self.head:
                return None
            self._recent.remove(key)
        self._recent.append(key)
        return entry is not None and self.observe(entry, reach)

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
        if self.tail - self._base >= entry_store.CHUNK_ENTRIES and self.tail - self._base >= len(self._keys) // 2:
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
            "read_bytes": self.read_bytes,
            "block_use_bytes": self.use_bytes,
            "block_size": self.block_size,
            "advised_block_size": self.advised_block_size(),
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
            "spilled_bytes": self.store.spilled_chunks * entry_store.CHUNK_ENTRIES * 8,
            "age_s": time.monotonic() - self.created_s,
        }
