"""BlockCache: verified reads, crash-safe inserts, admission and eviction, pins, purge,
and whole-file verification for the kernel's direct reads (passthrough.py)."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from pathlib import Path

import lmdb
import xxhash

from ..buffers import BlockBuffers
from ..db import IndexDb, get_meta, put_meta
from ..errors import CachefsError
from ..metrics import Stats
from .index import BlockIndex, IndexEntry
from .keys import BlockData, BlockKey
from .plan_eviction import EvictionAdvisor, PlanVictims, Victims
from .policy import FrequencySketch
from .share import TenantShare
from .store import BlockStore, SealedDataFile

log = logging.getLogger(__name__)

VICTIM_BATCH = 64
MAX_VICTIM_BATCH = 4096
RESERVE_BYTES = 1 << 30
_SIZE = struct.Struct(">Q")
SKETCH_FILE = "policy.sketch"
_STALE_CHECKED_FOR = "stale_checked_for"  # meta: see BlockCache.stale_checked_for
_CLOSED = "closed"  # meta: "yes" once the last mount closed the cache (BlockCache.close), "no" while one has it open
_SWEEP = "sweep"  # meta: "due" from a mount that found the last one crashed until its sweep is done
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


# Cached blocks are verified in chunks, so a small random read reads and checks
# 16 KiB, not the whole block; smaller chunks made random reads faster at the
# same CPU for sequential ones (docs/performance.md), at 512 bytes of sums per
# 1 MiB block in the index.
CHUNK_BYTES = 16 << 10
# Bump when the index entry layout changes: an older index is dropped at mount.
INDEX_FORMAT = "3"


def chunk_sums(data: BlockData | memoryview) -> bytes:
    """xxh3_64 of each CHUNK_BYTES piece of `data` (~20 GB/s: ~50 us per MiB)."""
    view = memoryview(data)
    return b"".join(xxhash.xxh3_64_digest(view[start : start + CHUNK_BYTES]) for start in range(0, len(view), CHUNK_BYTES))


def _sums_of_range(entry: IndexEntry, start: int, length: int) -> bytes:
    """The entry's checksums of the chunks in [start, start + length), start chunk-aligned."""
    first = start // CHUNK_BYTES
    count = -(-length // CHUNK_BYTES)
    return entry.chunk_sums[first * 8 : (first + count) * 8]


@functools.cache
def boot_id() -> bytes:
    """This boot of the machine: a power loss between a block's write and its
    reaching the disk always starts a new one."""
    try:
        return BOOT_ID_PATH.read_bytes().strip()
    except OSError:
        return os.urandom(16)  # unknown: nothing verified before this process is trusted


class BlockCache:
    """Blocks on local disk, indexed in LMDB, kept under `capacity_bytes`.

    `entry`, `read` and `read_part` run on the trio thread when the bytes
    are in the page cache; otherwise `read` runs in a worker thread, and
    `read_part` too unless the disk is fast (reader.py). `insert_many`
    writes files and does an fsync'd commit, so it runs in a worker thread,
    the only place that evicts: readers never wait for eviction. Any failure
    of the cache is a miss, never a failed read; after a failed write (a full
    disk) the cache stops growing until the disk has room again.

    When the cache is full, a new block is admitted only if the frequency
    sketch saw it, before the use that fetched it, more often than the
    oldest unpinned block (TinyLFU, see policy.py); otherwise it is served
    without being cached. While a loader's plan is active, `advisor` (the
    active plans) decides instead: the block whose next planned use is
    furthest away goes (plan_eviction.py).
    """

    def __init__(
        self,
        db: IndexDb,
        cache_dir: Path,
        capacity_bytes: int,
        block_size: int,
        stats: Stats,
        advisor: EvictionAdvisor | None = None,
        share: TenantShare | None = None,
        buffers: BlockBuffers | None = None,
    ) -> None:
        self._db = db
        self.index = BlockIndex(db)
        self.store = BlockStore(cache_dir, block_size, buffers)
        self._drop_older_index()
        self.capacity_bytes = capacity_bytes
        self._stats = stats
        self._lock = threading.Lock()  # one evicting/admitting thread at a time
        self._disk_reserve_bytes: int | None = None  # set once the disk has been found full
        self._space_returned = False
        self.sketch = FrequencySketch(capacity_bytes // block_size)
        self._sketch_path = cache_dir / SKETCH_FILE
        self.sketch.load(self._sketch_path)
        self._pins = self._load_pins()
        self._advisor = advisor
        self._share = share  # with other mounts on the cache dir: this one's allowance of it (share.py)
        self.pressure = 0  # admissions that found this cache full: the tenant wants more room
        # File versions the kernel reads directly (held) and those a block is
        # being dropped from right now; a file is never both (see hold()).
        self._held_lock = threading.Lock()
        self._held: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        self._dropping: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        # Times data files were removed whole (an operator's evict, stale versions, purge):
        # holding a file keeps its blocks, not its path (see unlinks()).
        self._unlinks = 0
        # File versions found changed on disk whose mark the index could not drop (its
        # commit failed): not verified, whatever the index says, until verified again.
        self._changed: set[tuple[bytes, bytes]] = set()
        # Eviction's walk starts at _victim_floor: every block inserted before it was pinned
        # or held when last walked. Pins are only lifted under the cache lock, which walks
        # hold; a release lifts a hold at any time, so it counts in _unholds and a walk that
        # saw the count change does not move the floor (see _victims).
        self._victim_floor = 0
        self._unholds = 0
        self._verify_small_files = False
        # The last mount of this cache ended without `close` (a SIGKILL, a power loss), or one
        # before it did and its sweep was not done: its data files may hold what the index
        # does not name (see sweep_files).
        if get_meta(db, _CLOSED) == "no":
            put_meta(db, _SWEEP, "due")
        self.sweep_due = get_meta(db, _SWEEP) == "due"
        put_meta(db, _CLOSED, "no")

    def verify_small_files_on_insert(self, on: bool) -> None:
        """Whether a small file (one short block: a short block 0 is its file's last) written
        through the page cache is verified for the kernel's direct reads as it is inserted,
        without the read-back of verify_files: its bytes were checked against the hub's
        checksum and written from that same buffer, so a read-back would read the pages
        that write filled and prove nothing more. Other files are verified by verify_files:
        blocks written with O_DIRECT are read back from the disk."""
        self._verify_small_files = on

    def _drop_older_index(self) -> None:
        """A cache dir from an older cachefs: its block entries cannot be read, so its blocks go."""
        if get_meta(self._db, "index_format") == INDEX_FORMAT:
            return
        dropped = self.index.clear()
        if dropped:
            self.store.delete_all()
            log.warning("the cache dir's block index is from an older cachefs: dropped its %d cached blocks", dropped)
        put_meta(self._db, "index_format", INDEX_FORMAT)

    # -- reads ------------------------------------------------------------------

    def entry(self, key: BlockKey) -> IndexEntry | None:
        """The block's index entry, None if it is not cached."""
        return self.index.get(key)

    def page_in_index(self, file_id: bytes, version: bytes) -> None:
        """Bring a file version's index entries into memory (worker thread; best effort)."""
        try:
            self.index.page_in(file_id, version)
        except lmdb.Error as exc:
            log.debug("cannot page in the index entries of %s: %s", file_id.hex(), exc)

    def page_in_files(self, files: list[tuple[bytes, bytes, int]]) -> None:
        """Start reading cached files (file id, version, bytes) into the page cache (worker thread)."""
        self.store.start_reading(files)

    def read(self, key: BlockKey, entry: IndexEntry, *, nowait: bool = False) -> BlockData | None:
        """The verified bytes of an indexed block; None if they are missing or corrupt (then dropped).

        `nowait` raises BlockingIOError when the bytes are not all in the page
        cache (see BlockStore.read), so the trio thread never waits for the disk.
        """
        return self._read_chunks(key, entry, 0, entry.length, nowait)

    def read_part(self, key: BlockKey, entry: IndexEntry, start: int, stop: int, *, nowait: bool = False) -> memoryview | None:
        """Verified bytes [start, stop) of an indexed block, reading only the chunks they fall in."""
        first = start - start % CHUNK_BYTES
        data = self._read_chunks(key, entry, first, min(entry.length, -(-stop // CHUNK_BYTES) * CHUNK_BYTES), nowait)
        return None if data is None else memoryview(data)[start - first : stop - first]

    def _read_intact(self, key: BlockKey, entry: IndexEntry, start: int, stop: int, nowait: bool, *,
                     from_disk: bool = False) -> BlockData | None:
        """Bytes [start, stop) of a block, chunk-aligned, if they can be read and match
        their chunk sums, else None (the caller decides what a bad block costs).
        `from_disk`: read what the disk holds, not the page cache (BlockStore.read)."""
        try:
            data = self.store.read(key, start, stop - start, nowait=nowait, from_disk=from_disk)
        except BlockingIOError:
            raise
        except OSError as exc:
            log.warning("cannot read cached %s: %s", key, exc)
            return None
        if data is None or chunk_sums(data) != _sums_of_range(entry, start, len(data)):
            return None
        return data

    def _read_chunks(self, key: BlockKey, entry: IndexEntry, start: int, stop: int, nowait: bool, *,
                     from_disk: bool = False) -> BlockData | None:
        """Bytes [start, stop) of a block, chunk-aligned, checked against their chunk sums; a bad block is dropped."""
        data = self._read_intact(key, entry, start, stop, nowait, from_disk=from_disk)
        if data is None:
            if not self._still_indexed(key, entry):
                return None  # evicted (or replaced) while it was being read: a plain miss, no wait for the lock
            with self._lock:  # a write of the same block must not fall between the drop's commit and its punch
                if not self._still_indexed(key, entry):
                    return None
                log.warning("cached %s is missing or corrupt; dropping it", key)
                self._stats.corrupt_blocks += 1
                self._drop(key)
            return None
        return data

    def _still_indexed(self, key: BlockKey, entry: IndexEntry) -> bool:
        """Whether `entry` is still the block's entry: one evicted (or replaced) after it was
        looked up reads as a hole or a missing file, which says nothing about the disk."""
        current = self.index.get(key)
        return current is not None and current.seq == entry.seq

    def contains(self, key: BlockKey) -> bool:
        return self.index.present([key])[0]

    def contains_each(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each block is cached: one index transaction for all of them."""
        return self.index.present(keys)

    # -- inserts, admission, eviction -------------------------------------------

    def insert_many(self, blocks: list[tuple[BlockKey, BlockData, bool]], ahead: Container[BlockKey] = ()) -> int:
        """Store blocks (worker thread): admit, write the files, then commit
        their index entries together. Returns how many were cached; a block
        that cannot be written (e.g. ENOSPC) is skipped and logged once. The
        flag of each block forces its admission (operator warm-ups). Blocks
        in `ahead`, offered or cached, were fetched ahead of their first read
        (read-ahead) and not read yet: the admission policy counts that read,
        which the frequency sketch only records when it happens
        (FrequencySketch.expected), so a block offered is weighed as its
        reader's fetch would be, and a cached one waiting for its reader is
        not evicted for a block further ahead (else on a full cache blocks
        read ahead lost their place and were fetched a second time by their
        reader)."""
        with self._lock:
            with self._admitting():
                try:
                    admitted = self._admit(blocks, ahead)
                except lmdb.Error as exc:  # dropping what they displace failed (a full disk)
                    self._note_store_failure(exc)
                    return 0
                if self._share is not None and admitted:  # claimed before written: the tenants never overshoot together
                    self._share.claim(self.index.used_bytes(), self.pinned_bytes(), sum(len(data) for _key, data in admitted))
            try:
                return self._write_admitted(admitted)
            finally:
                if self._share is not None:  # written or not: a failed write must not keep others' room claimed
                    self._share.note_used(self.index.used_bytes(), self.pinned_bytes())

    def _write_admitted(self, admitted: list[tuple[BlockKey, BlockData]]) -> int:
        """Write admitted blocks and commit their entries (the cache lock held); how many were cached."""
        written = []
        verified: list[BlockKey] = []
        for key, data in admitted:
            buffered = self.store.buffered(len(data))  # before the write, which may turn O_DIRECT off
            try:
                self._write_unless_verified(key, data)
            except SealedDataFile as exc:  # its verified bytes are on disk already
                log.warning("not writing %s: %s", key, exc)
                continue
            except OSError as exc:
                self._note_store_failure(exc)
                continue
            written.append((key, len(data), chunk_sums(data)))
            if self._verify_small_files and key.blockno == 0 and len(data) < self.store.block_size and buffered:
                verified.append(key)
        if not written:
            return 0
        try:
            self.index.add(written, set(verified), boot_id(), time.time())
        except lmdb.Error as exc:
            for key, _length, _sums in written:
                self.store.delete(key)
            self._note_store_failure(exc)
            return 0
        # after the commit, as verify_files does: a crash leaves it unsealed
        self._seal_verified([(key.file_id, key.version) for key in verified])
        self._stats.verified_files += len(verified)
        return len(written)

    def _write_unless_verified(self, key: BlockKey, data: BlockData) -> None:
        """Write a block into its data file, unless the file is sealed and verified. A sealed
        file that is not verified (any more) is unsealed first: a crash between a drop's
        commit and its unseal, or a reboot, left the seal of a verification that no longer
        holds, and the file's missing blocks could otherwise never be cached again."""
        try:
            self.store.write(key, data)
        except SealedDataFile:
            if self.verified(key.file_id, key.version):
                raise
            self.store.unseal(key.file_id, key.version)
            self.store.write(key, data)

    def _admit(
        self, blocks: list[tuple[BlockKey, BlockData, bool]], ahead: Container[BlockKey]
    ) -> list[tuple[BlockKey, BlockData]]:
        """The blocks that get a place, after evicting what they displace (all of it
        with one index commit: one fsync per batch, not one per block evicted)."""
        free = self._limit_bytes() - self.index.used_bytes()
        victims: Victims = _OldestVictims(self)
        if self._advisor is not None and self._advisor.active():
            victims = PlanVictims(self, self._advisor)
        admitted = []
        evicted: list[BlockKey] = []
        try:
            for key, data, force in blocks:
                forced = force or key.file_id in self._pins
                self.pressure += len(data) > free
                while len(data) > free:
                    victim = victims.best()
                    if victim is None:
                        break
                    victim_key, victim_length = victim
                    if not forced and not victims.displaces(key, victim_key, ahead):
                        victims.refused()
                        break
                    victims.take()
                    if self._start_drop(victim_key):  # else its file is held (the kernel reads it)
                        evicted.append(victim_key)
                        free += victim_length
                if len(data) <= free:
                    admitted.append((key, data))
                    free -= len(data)
                else:
                    self._stats.rejected_blocks += 1
        finally:
            self._finish_drops(evicted)
        self._stats.evicted_blocks += len(evicted)
        victims.done()
        return admitted

    def _victims(self) -> Iterator[tuple[BlockKey, int]]:
        """Unpinned, unheld cached blocks, oldest first (the cache lock held), read lazily in
        batches, each from where the last one ended. Pinned or held blocks at the head of the
        order are passed once: the floor moves past them for the next walks."""
        with self._held_lock:
            unholds = self._unholds
        from_seq, limit, at_head = self._victim_floor, VICTIM_BATCH, True
        while True:
            batch = self.index.oldest(limit, from_seq)
            if not batch:
                return
            limit = min(limit * 2, MAX_VICTIM_BATCH)  # fewer transactions past a long pinned head
            for seq, key in batch:
                from_seq = seq + 1
                if key.file_id in self._pins or (key.file_id, key.version) in self._held:
                    continue
                entry = self.index.get(key)
                if entry is None:
                    continue
                if at_head:
                    at_head = False
                    self._raise_floor(seq, unholds)
                yield key, entry.length
            if at_head:
                self._raise_floor(from_seq, unholds)

    def _raise_floor(self, seq: int, unholds: int) -> None:
        """Blocks inserted before `seq` were all pinned or held, unless a hold was lifted since the walk began."""
        with self._held_lock:
            if self._unholds == unholds:
                self._victim_floor = max(self._victim_floor, seq)

    def _drop(self, key: BlockKey) -> bool:
        """Remove a block's entry (and its file's verified mark), then punch out
        its bytes; nothing if the file is held, whose data file must stay whole."""
        if not self._start_drop(key):
            return False
        self._finish_drops([key])
        return True

    def _start_drop(self, key: BlockKey) -> bool:
        """Mark a block's file as being dropped from (a passthrough open waits: `hold`);
        False if the file is held. `_finish_drops` must follow."""
        file = (key.file_id, key.version)
        with self._held_lock:
            if file in self._held:
                return False
            self._dropping[file] += 1
        return True

    def _finish_drops(self, keys: list[BlockKey]) -> None:
        """Drop blocks marked by `_start_drop`: their entries (and their files' verified
        marks) in one commit, then their bytes; then unmark them."""
        try:
            if keys:
                self.index.remove_many(keys)
                for key in keys:
                    self.store.delete(key)
        finally:
            with self._held_lock:
                for key in keys:
                    file = (key.file_id, key.version)
                    self._dropping[file] -= 1
                    if not self._dropping[file]:
                        del self._dropping[file]

    def trim(self, target_bytes: int) -> int:
        """Evict the oldest unpinned blocks until at most `target_bytes` are cached (worker
        thread): a tenant whose allowance shrank gives the room back. Returns the bytes freed."""
        freed = 0
        with self._lock:
            excess = self.index.used_bytes() - target_bytes
            evicted: list[BlockKey] = []
            try:
                for key, length in self._victims():
                    if freed >= excess:
                        break
                    if self._start_drop(key):
                        evicted.append(key)
                        freed += length
            finally:
                self._finish_drops(evicted)
            self._stats.evicted_blocks += len(evicted)
            if evicted and self._share is not None:
                self._share.note_used(self.index.used_bytes(), self.pinned_bytes())
        return freed

    def free_bytes(self) -> int:
        """Room left under the size limit (and the disk reserve, once the disk was found full)."""
        return max(0, self._limit_bytes(fresh=False) - self.index.used_bytes())

    def remove(self, key: BlockKey) -> None:
        """Drop a block (any thread but one holding the cache lock), serialised with the cache's writes."""
        with self._lock:
            self._drop(key)

    # -- whole files for the kernel (FUSE passthrough) ----------------------------

    def verify_files(self, files: list[tuple[bytes, bytes, list[int]]]) -> set[tuple[bytes, bytes]]:
        """Read back every block of each file version (file id, version, block
        lengths) and check it against its sums (worker thread); mark those whose
        blocks are all there and match as verified for this boot, in one commit.
        Returns the (file id, version) marked. A corrupt block is dropped. One
        verified already (a small file, as it was inserted) is not read again."""
        try:
            checked = [blocks for file_id, version, lengths in files
                       if not self.verified(file_id, version) and (blocks := self._check_file(file_id, version, lengths))]
            marked = self.index.mark_verified(checked, boot_id(), time.time()) if checked else []
        except lmdb.Error as exc:  # a full disk: they stay with the daemon, which checks every read
            self._note_store_failure(exc)
            return set()
        self._seal_verified(marked)
        return set(marked)

    def _seal_verified(self, files: list[tuple[bytes, bytes]]) -> None:
        """Seal the data files of file versions just marked verified. A drop of one of
        their blocks (eviction, a corrupt read) may have taken the mark and unsealed the
        file between the commit and the seal: such a file is unsealed again, else the
        block could never be written back and the file never verified again."""
        self._changed.difference_update(files)  # verified again since they were found changed
        for file_id, version in files:
            self.store.seal(file_id, version)
            if not self.verified(file_id, version):  # a drop takes the mark before it unseals
                self.store.unseal(file_id, version)

    def verified_versions(self) -> list[tuple[bytes, bytes, float]]:
        """(file id, version, wall-clock time of the last verification) of the file versions
        verified whole during this boot: those the kernel may read directly."""
        return self.index.verified_during(boot_id())

    def reverified(self, file_id: bytes, version: bytes) -> None:
        """A verified file version matched again: its next re-verification is a period from now
        (if the index cannot record that, a full disk, the next round hashes it again)."""
        try:
            self.index.reverified(file_id, version, boot_id(), time.time())
        except lmdb.Error as exc:
            self._note_store_failure(exc)

    def reverify_blocks(self, file_id: bytes, version: bytes, first_blockno: int,
                        max_bytes: int) -> tuple[int | None, int, list[BlockKey]]:
        """Worker thread: re-hash a verified file version's cached blocks from
        `first_blockno` on, about `max_bytes` of them. Returns the block to go on from
        (None: the end), the bytes read, and the blocks whose bytes no longer match
        (not those evicted meanwhile: a cache that is full evicts verified files too)."""
        entries: list[tuple[BlockKey, IndexEntry]] = []
        next_blockno = None
        planned = 0
        for key, entry in self.index.version_entries(file_id, version, first_blockno):  # no disk read in its transaction
            if planned >= max_bytes:
                next_blockno = key.blockno
                break
            entries.append((key, entry))
            planned += entry.length
        bad = [key for key, entry in entries
               if self._read_intact(key, entry, 0, entry.length, False, from_disk=True) is None
               and self._still_indexed(key, entry)]
        return next_blockno, planned, bad

    def drop_changed(self, keys: list[BlockKey]) -> None:
        """Drop blocks whose bytes changed on disk after their file was verified: their
        entries and the file's verified mark go (so they are fetched again), the data
        file is unsealed, and their bytes punched out unless the kernel holds the file
        open (then the next fetch writes the hub's bytes over them). If the index
        cannot drop them (a full disk), the files are no longer verified all the same:
        later opens are served, and checked, by the daemon."""
        with self._lock:
            self._changed.update((key.file_id, key.version) for key in keys)
            try:
                self.index.remove_many(keys)
            except lmdb.Error as exc:
                self._note_store_failure(exc)
                return
            for file_id, version in {(key.file_id, key.version) for key in keys}:
                self.store.unseal(file_id, version)
            for key in keys:
                if self._start_drop(key):
                    self._finish_drops([key])

    def _check_file(self, file_id: bytes, version: bytes, block_lengths: list[int]) -> list[tuple[BlockKey, int]]:
        """(key, entry seq) of each block if all are cached and match their sums, else []."""
        blocks = []
        for blockno, length in enumerate(block_lengths):
            key = BlockKey(file_id, version, blockno)
            entry = self.index.get(key)
            if entry is None or entry.length != length:
                return []
            blocks.append((key, entry))
        for key, entry in blocks:  # from the disk: the bytes the kernel will read, not a copy in memory
            if self._read_chunks(key, entry, 0, entry.length, False, from_disk=True) is None:
                return []
        return [(key, entry.seq) for key, entry in blocks]

    def verified(self, file_id: bytes, version: bytes) -> bool:
        """Whether every block of the file version is cached and was verified since boot."""
        return (file_id, version) not in self._changed and self.index.verified_boot(file_id, version) == boot_id()

    def hold(self, file_id: bytes, version: bytes) -> bool:
        """Keep a file version's blocks on disk while the kernel reads its data file;
        False if a block of it is being dropped right now. Check `verified` after
        holding: a block dropped before the hold has cleared the mark by then; and
        `unlinks` before that check and after opening the data file."""
        with self._held_lock:
            if (file_id, version) in self._dropping:
                return False
            self._held[(file_id, version)] += 1
        return True

    def unlinks(self) -> int:
        """How many times data files were removed whole. They are removed (with their
        entries, under the cache lock, before a writer can make a new one) whether held
        or not: the kernel's open file keeps its bytes. But a data file opened after its
        verified check may be a new, partly written one at the same path; the same count
        before the check and after the open says it is the file that was verified."""
        return self._unlinks

    def unhold(self, file_id: bytes, version: bytes) -> None:
        with self._held_lock:
            self._held[(file_id, version)] -= 1
            if self._held[(file_id, version)] <= 0:
                del self._held[(file_id, version)]
                self._unholds += 1
                self._victim_floor = 0  # its blocks may lie before the floor

    def _limit_bytes(self, *, fresh: bool = True) -> int:
        """The capacity (with other tenants on the cache dir, this one's allowance: `fresh`, also
        no growth into what they hold now), or after the disk filled up once, what fits while keeping a reserve free.

        The reserve (a quarter of the filesystem, at most 1 GiB) keeps a nearly
        full disk from flapping between caching and failing.
        """
        limit = self.capacity_bytes
        if self._share is not None:
            limit = min(limit, self._share.limit(self.index.used_bytes()) if fresh else self._share.allowance)
        if self._disk_reserve_bytes is None:
            return limit
        try:
            usage = os.statvfs(self.store.data_dir)
        except OSError:
            return self.index.used_bytes()
        free = usage.f_bavail * usage.f_frsize
        if free >= 2 * self._disk_reserve_bytes and not self._space_returned:
            log.info("disk space returned; caching in %s again, keeping %d bytes free",
                     self.store.data_dir, self._disk_reserve_bytes)
            self._space_returned = True
        return min(limit, self.index.used_bytes() + free - self._disk_reserve_bytes)

    def _note_store_failure(self, exc: Exception) -> None:
        """A write failed (a full disk): from now on keep a reserve free on the disk.

        Until space returns, new blocks only get in by displacing less popular
        ones, which keeps the bytes on disk constant; reads are served either way.
        """
        self._stats.store_errors += 1
        if self._disk_reserve_bytes is None or self._space_returned:
            try:
                usage = os.statvfs(self.store.data_dir)
                self._disk_reserve_bytes = min(RESERVE_BYTES, usage.f_blocks * usage.f_frsize // 4)
            except OSError:
                self._disk_reserve_bytes = RESERVE_BYTES
            self._space_returned = False
            log.error("cannot cache more blocks in %s (%s); holding the cache at %d bytes until space returns",
                      self.store.data_dir, exc, self.index.used_bytes())

    # -- operator actions ---------------------------------------------------------

    def evict_file(self, file_id: bytes) -> int:
        """Drop every cached block of a file (all versions); returns the bytes freed."""
        with self._lock:
            blocks = self.index.file_blocks(file_id)
            self.index.remove_many(key for key, _length in blocks)
            self._unlinks += 1
            self.store.delete_file(file_id)
        return sum(length for _key, length in blocks)

    def stale_versions(self, version_of: Callable[[bytes], bytes | None]) -> list[list[BlockKey]]:
        """The cached blocks of file versions the snapshot no longer has, one list per version.
        One `version_of` per file: the index lists a file's blocks together."""
        stale: dict[tuple[bytes, bytes], list[BlockKey]] = {}
        file_id, current = b"", None
        for key in self.index.iter_keys():
            if key.file_id != file_id:
                file_id, current = key.file_id, version_of(key.file_id)
            if current != key.version:
                stale.setdefault((key.file_id, key.version), []).append(key)
        return list(stale.values())

    def drop_versions(self, versions: list[list[BlockKey]]) -> None:
        """Drop these versions' blocks (each list all of a version's) and their data files."""
        with self._lock:
            self.index.remove_many(key for keys in versions for key in keys)
            self._unlinks += 1
            for keys in versions:
                self.store.delete_version(keys[0].file_id, keys[0].version)

    def close(self, timeout_s: float = 10.0) -> None:
        """At unmount, once nothing else writes: the next mount needs no sweep. Waits for a
        batch the cache writer may still be writing (its task is gone, not its thread), at
        most `timeout_s` (a disk that hangs: the next mount sweeps)."""
        if not self._lock.acquire(timeout=timeout_s):
            return
        try:
            put_meta(self._db, _CLOSED, "yes")
        finally:
            self._lock.release()

    def sweep_files(self, files: Sequence[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Free what a crash left in these data files that the index does not name (worker
        thread, in the background, a batch of a sweep at a time): blocks written whose
        entries were never committed (the cache writer writes, then commits), and data files
        without an entry (a drop commits, then removes). One data file at a time under the
        cache lock, so no write of the cache goes on in it meanwhile; verified and held files
        are left alone (every block of them is indexed). Returns (blocks punched out, data
        files removed); `swept` once all of them are done."""
        punched = removed = 0
        for file_id, version in files:
            with self._lock:
                if self.verified(file_id, version) or (file_id, version) in self._held:
                    continue
                indexed = self.index.blocknos(file_id, version)
                if not indexed:
                    self._unlinks += 1
                    self.store.delete_version(file_id, version)
                    removed += 1
                    continue
                for blockno in sorted(self.store.allocated_blocks(file_id, version) - indexed):
                    self.store.delete(BlockKey(file_id, version, blockno))
                    punched += 1
        return punched, removed

    def swept(self) -> None:
        """Every data file was swept (sweep_files): the next mount needs no sweep unless this one crashes."""
        put_meta(self._db, _SWEEP, "done")
        self.sweep_due = False

    def stale_checked_for(self) -> str | None:
        """The generation whose stale versions were last dropped completely (a mount that loaded
        a new manifest, or a refresh cut short by an unmount, has not had that)."""
        return get_meta(self._db, _STALE_CHECKED_FOR)

    def mark_stale_checked(self, generation: str) -> None:
        put_meta(self._db, _STALE_CHECKED_FOR, generation)

    def purge(self) -> int:
        """Drop every cached block and remove the block files; returns the block count."""
        with self._lock:
            count = self.index.clear()
            self._unlinks += 1
            self.store.delete_all()
        return count

    def _admitting(self) -> contextlib.AbstractContextManager[object]:
        """The cache dir's admission lock, when tenants share it (TenantShare.admitting)."""
        return self._share.admitting() if self._share is not None else contextlib.nullcontext()

    def pin(self, files: dict[bytes, int]) -> None:
        """Keep these files (id -> size) out of eviction; refuse if they cannot all fit."""
        # Under the cache dir's admission lock, and published before it is released: another
        # tenant pinning at the same moment sees these pins in its pin_limit (else both fit alone
        # and together pin more than the shared size).
        with self._lock, self._admitting():
            wanted = sum(size for file_id, size in files.items() if file_id not in self._pins)
            limit = self.capacity_bytes if self._share is None else self._share.pin_limit()
            if self.pinned_bytes() + wanted > limit:
                raise CachefsError(
                    f"cannot pin {wanted} more bytes: {self.pinned_bytes()} already pinned "
                    + (f"of a {self.capacity_bytes}-byte cache" if self._share is None
                       else f"of the {limit} bytes the other tenants' minimums and pins leave this one")
                )
            with self._db.env.begin(db=self._db.pins, write=True) as txn:
                for file_id, size in files.items():
                    txn.put(file_id, _SIZE.pack(size))
            self._pins.update(files)
            if self._share is not None:  # no batch is claimed meanwhile: inserts hold self._lock
                self._share.note_used(self.index.used_bytes(), self.pinned_bytes())

    def unpin(self, file_ids: list[bytes]) -> int:
        """Let these files be evicted again; returns how many were pinned."""
        with self._lock, self._db.env.begin(db=self._db.pins, write=True) as txn:
            found = 0
            for file_id in file_ids:
                found += bool(txn.delete(file_id))
                self._pins.pop(file_id, None)
            if found:
                self._victim_floor = 0  # their blocks may lie before the floor
        return found

    def repin(self, size_of: Callable[[bytes], int | None]) -> tuple[int, int]:
        """Bring the pins to the loaded snapshot (worker thread; after a new one is loaded): a
        pinned file it no longer has is unpinned (no path names it any more, so `cachefs unpin`
        could not), a pinned file whose size changed counts its new size (its new version's blocks
        are pinned too: a pin is by file id). Returns (unpinned, resized)."""
        with self._lock, self._admitting():
            gone, resized = [], {}
            for file_id, size in self._pins.items():
                now = size_of(file_id)
                if now is None:
                    gone.append(file_id)
                elif now != size:
                    resized[file_id] = now
            if not gone and not resized:
                return 0, 0
            with self._db.env.begin(db=self._db.pins, write=True) as txn:
                for file_id in gone:
                    txn.delete(file_id)
                    del self._pins[file_id]
                for file_id, size in resized.items():
                    txn.put(file_id, _SIZE.pack(size))
                    self._pins[file_id] = size
            self._victim_floor = 0  # unpinned blocks may lie before the floor
            if self._share is not None:
                self._share.note_used(self.index.used_bytes(), self.pinned_bytes())
        return len(gone), len(resized)

    def pinned_bytes(self) -> int:
        return sum(self._pins.values())

    def pinned_file_ids(self) -> list[bytes]:
        return list(self._pins)

    def is_pinned(self, file_id: bytes) -> bool:
        return file_id in self._pins

    def _load_pins(self) -> dict[bytes, int]:
        with self._db.env.begin(db=self._db.pins) as txn:
            return {bytes(file_id): _SIZE.unpack(size)[0] for file_id, size in txn.cursor()}

    # -- state --------------------------------------------------------------------

    def used_bytes(self) -> int:
        return self.index.used_bytes()

    def cached_since(self) -> int | None:
        """Unix time at or after which the oldest cached block was cached (None: unknown or none)."""
        return self.index.cached_since()

    def block_count(self) -> int:
        return self.index.block_count()

    def save_policy(self) -> None:
        try:
            self.sketch.save(self._sketch_path)
        except OSError as exc:
            log.warning("cannot save policy state to %s: %s", self._sketch_path, exc)


class _OldestVictims:
    """TinyLFU's candidates: the oldest unpinned blocks, one at a time.

    A candidate that keeps its place (more popular than the block offered)
    is passed over: the next block offered is weighed against the next
    oldest, so one popular old block does not freeze the cache.
    """

    def __init__(self, cache: BlockCache) -> None:
        self._sketch = cache.sketch
        self._oldest = cache._victims()
        self._current: tuple[BlockKey, int] | None = None

    def best(self) -> tuple[BlockKey, int] | None:
        if self._current is None:
            self._current = next(self._oldest, None)
        return self._current

    def displaces(self, key: BlockKey, victim: BlockKey, ahead: Container[BlockKey] = ()) -> bool:
        return self._sketch.admits(key, victim, ahead)

    def take(self) -> None:
        self._current = None

    def refused(self) -> None:
        self._current = None

    def done(self) -> None:
        pass
