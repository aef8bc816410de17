"""The block index in LMDB: which blocks are cached, their length, checksums and age,
and which file versions were verified whole since the machine booted."""

from __future__ import annotations

import bisect
import dataclasses
import struct
from collections.abc import Container, Generator, Iterable, Iterator, Sequence

from ..db import IndexDb
from .keys import BlockKey

# An entry: length and insertion sequence, then one xxh3_64 per chunk of the
# block (see BlockCache), so a small read verifies only the chunks it reads.
_ENTRY_HEAD = struct.Struct(">IQ")
_SEQ = struct.Struct(">Q")
_USED = b"used_bytes"
_COUNT = b"block_count"
_NEXT_SEQ = b"next_seq"
# When blocks were cached: (insertion number, unix time) marks, one per CLOCK_STEP_S at
# most; a block numbered from a mark on was cached at or after its time. Marks older than
# the oldest block are dropped, and past CLOCK_MAX_MARKS every other old one (coarser).
_CLOCK = b"seq_clock"
_MARK = struct.Struct(">QQ")
CLOCK_STEP_S = 600
CLOCK_MAX_MARKS = 8192
_FILE_VERSION_BYTES = 16  # a packed BlockKey starts with file id + version


@dataclasses.dataclass(frozen=True, slots=True)
class IndexEntry:
    length: int
    seq: int
    chunk_sums: bytes  # 8 bytes (big-endian xxh3_64) per chunk

    @classmethod
    def unpack(cls, value: bytes) -> IndexEntry:
        length, seq = _ENTRY_HEAD.unpack_from(value)
        return cls(length, seq, value[_ENTRY_HEAD.size :])

    def pack(self) -> bytes:
        return _ENTRY_HEAD.pack(self.length, self.seq) + self.chunk_sums


class BlockIndex:
    """Index operations; each call is one short LMDB transaction."""

    def __init__(self, db: IndexDb) -> None:
        self._db = db

    def get(self, key: BlockKey) -> IndexEntry | None:
        with self._db.env.begin(db=self._db.blocks) as txn:
            value = txn.get(key.packed())
        return IndexEntry.unpack(value) if value is not None else None

    def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each block is indexed, in one transaction (no entry unpacked)."""
        with self._db.env.begin(db=self._db.blocks) as txn:
            return [txn.get(key.packed()) is not None for key in keys]

    def add(self, entries: list[tuple[BlockKey, int, bytes]], verified: Container[BlockKey] = (),
            boot_id: bytes = b"", at_s: float = 0.0) -> None:
        """Record blocks (key, length, chunk checksums) whose data is already on disk.

        One transaction, so one fsync for the whole batch; it is committed only
        after the block files were written. A block in `verified` is its file
        version's only block, verified as it was written: the version is recorded
        verified during boot `boot_id` at `at_s` (see mark_verified); any other
        block's version loses its record.
        """
        with self._db.env.begin(write=True) as txn:
            if entries and at_s > 0:
                _mark_time(txn, self._db, _counter(txn, self._db, _NEXT_SEQ), int(at_s))
            for key, length, chunk_sums in entries:
                packed = key.packed()
                old = txn.get(packed, db=self._db.blocks)
                if old is not None:
                    self._forget(txn, packed, IndexEntry.unpack(old))
                if key in verified:
                    txn.put(packed[:_FILE_VERSION_BYTES], _verified_value(boot_id, at_s), db=self._db.verified)
                else:
                    txn.delete(packed[:_FILE_VERSION_BYTES], db=self._db.verified)
                seq = _counter(txn, self._db, _NEXT_SEQ)
                txn.put(_NEXT_SEQ, _SEQ.pack(seq + 1), db=self._db.meta)
                txn.put(packed, IndexEntry(length, seq, chunk_sums).pack(), db=self._db.blocks)
                txn.put(_SEQ.pack(seq), packed, db=self._db.fifo)
                _bump(txn, self._db, _USED, length)
                _bump(txn, self._db, _COUNT, 1)

    def remove(self, key: BlockKey) -> int:
        """Drop a block's entry; returns the bytes it accounted for (0 if absent)."""
        return self.remove_many([key])

    def remove_many(self, keys: Iterable[BlockKey]) -> int:
        """Drop blocks' entries in one transaction (one fsync); returns the bytes they accounted for."""
        freed = 0
        with self._db.env.begin(write=True) as txn:
            for key in keys:
                packed = key.packed()
                old = txn.get(packed, db=self._db.blocks)
                if old is not None:
                    entry = IndexEntry.unpack(old)
                    self._forget(txn, packed, entry)
                    freed += entry.length
        return freed

    def mark_verified(self, files: list[list[tuple[BlockKey, int]]], boot_id: bytes,
                      at_s: float) -> list[tuple[bytes, bytes]]:
        """Record, in one transaction, that each file version's blocks (key, entry seq),
        all of them, were verified during boot `boot_id` at wall-clock time `at_s`; a file
        whose entries changed since they were read is left out. Returns the (file id,
        version) recorded. Any later change of an entry drops its file's record."""
        marked = []
        with self._db.env.begin(write=True) as txn:
            for checked in files:
                if all(_has_seq(txn, self._db, key, seq) for key, seq in checked):
                    key = checked[0][0]
                    txn.put(key.file_id + key.version, _verified_value(boot_id, at_s), db=self._db.verified)
                    marked.append((key.file_id, key.version))
        return marked

    def reverified(self, file_id: bytes, version: bytes, boot_id: bytes, at_s: float) -> None:
        """Move a still verified file version's verification time to `at_s` (nothing if its mark is gone)."""
        with self._db.env.begin(write=True, db=self._db.verified) as txn:
            value = txn.get(file_id + version)
            if value is not None and _parse_verified(value)[0] == boot_id:
                txn.put(file_id + version, _verified_value(boot_id, at_s))

    def verified_during(self, boot_id: bytes) -> list[tuple[bytes, bytes, float]]:
        """(file id, version, verified at) of the file versions verified during boot `boot_id`."""
        found = []
        with self._db.env.begin(db=self._db.verified) as txn:
            for packed, value in txn.cursor():
                boot, at_s = _parse_verified(value)
                if boot == boot_id:
                    found.append((packed[:8], packed[8:16], at_s))
        return found

    def version_entries(self, file_id: bytes, version: bytes, first_blockno: int) -> Iterator[tuple[BlockKey, IndexEntry]]:
        """A file version's entries from block `first_blockno` on, in block order (one
        read transaction, held while iterating: consume it promptly)."""
        prefix = file_id + version
        with self._db.env.begin(db=self._db.blocks) as txn:
            cursor = txn.cursor()
            if cursor.set_range(BlockKey(file_id, version, first_blockno).packed()):
                for packed, value in cursor:
                    if not packed.startswith(prefix):
                        return
                    yield BlockKey.unpack(packed), IndexEntry.unpack(value)

    def verified_boot(self, file_id: bytes, version: bytes) -> bytes | None:
        """The boot during which the file version was last verified whole, if it was."""
        with self._db.env.begin(db=self._db.verified) as txn:
            value = txn.get(file_id + version)
        return _parse_verified(value)[0] if value is not None else None

    def oldest(self, limit: int, from_seq: int = 0) -> list[tuple[int, BlockKey]]:
        """Up to `limit` (seq, key) in insertion order, oldest first, from insertion number `from_seq` on."""
        found: list[tuple[int, BlockKey]] = []
        with self._db.env.begin(db=self._db.fifo) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_SEQ.pack(from_seq)):
                return found
            for seq, packed in cursor:
                found.append((_SEQ.unpack(seq)[0], BlockKey.unpack(packed)))
                if len(found) >= limit:
                    break
        return found

    def iter_oldest(self) -> Generator[BlockKey, None, None]:
        """Every key in insertion order, oldest first, read as the caller goes (one read
        transaction for the walk: close the iterator when done)."""
        with self._db.env.begin(db=self._db.fifo) as txn:
            for _seq, packed in txn.cursor():
                yield BlockKey.unpack(packed)

    def file_blocks(self, file_id: bytes) -> list[tuple[BlockKey, int]]:
        """Every cached block of a file (all versions), with its length."""
        return [(BlockKey.unpack(packed), IndexEntry.unpack(value).length) for packed, value in self._with_prefix(file_id)]

    def blocknos(self, file_id: bytes, version: bytes) -> set[int]:
        """The block numbers of a file version that have an entry."""
        return {BlockKey.unpack(packed).blockno for packed, _value in self._with_prefix(file_id + version)}

    def page_in(self, file_id: bytes, version: bytes) -> int:
        """Read through a file version's entries (their pages come into the page
        cache); returns how many there are."""
        return sum(1 for _entry in self._with_prefix(file_id + version))

    def _with_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """(packed key, value) of the entries whose key starts with `prefix`, in key order."""
        with self._db.env.begin(db=self._db.blocks) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for packed, value in cursor:
                    if not packed.startswith(prefix):
                        return
                    yield packed, value

    def iter_lengths(self) -> Iterator[tuple[BlockKey, int]]:
        """Every block cached and its length, in key order (a file's blocks together)."""
        with self._db.env.begin(db=self._db.blocks) as txn:
            for packed, value in txn.cursor():
                yield BlockKey.unpack(packed), _ENTRY_HEAD.unpack_from(value)[0]

    def cached_since(self) -> int | None:
        """Unix time at or after which the oldest cached block was cached; None without blocks,
        or for blocks cached before these times were kept."""
        with self._db.env.begin() as txn:
            cursor = txn.cursor(db=self._db.fifo)
            if not cursor.first():
                return None
            oldest = _SEQ.unpack(cursor.key())[0]
            marks = _marks(txn, self._db)
        at = bisect.bisect_right([seq for seq, _at in marks], oldest) - 1
        return marks[at][1] if at >= 0 else None

    def iter_keys(self) -> Iterator[BlockKey]:
        with self._db.env.begin(db=self._db.blocks) as txn:
            for packed in txn.cursor().iternext(keys=True, values=False):
                yield BlockKey.unpack(packed)

    def clear(self) -> int:
        """Forget every block; returns how many there were."""
        with self._db.env.begin(write=True) as txn:
            count = _counter(txn, self._db, _COUNT)
            txn.drop(self._db.blocks, delete=False)
            txn.drop(self._db.fifo, delete=False)
            txn.drop(self._db.verified, delete=False)
            txn.put(_USED, _SEQ.pack(0), db=self._db.meta)
            txn.put(_COUNT, _SEQ.pack(0), db=self._db.meta)
        return count

    def used_bytes(self) -> int:
        with self._db.env.begin() as txn:
            return _counter(txn, self._db, _USED)

    def block_count(self) -> int:
        with self._db.env.begin() as txn:
            return _counter(txn, self._db, _COUNT)

    def _forget(self, txn: object, packed: bytes, entry: IndexEntry) -> None:
        txn.delete(packed, db=self._db.blocks)  # type: ignore[attr-defined]
        txn.delete(packed[:_FILE_VERSION_BYTES], db=self._db.verified)  # type: ignore[attr-defined]
        txn.delete(_SEQ.pack(entry.seq), db=self._db.fifo)  # type: ignore[attr-defined]
        _bump(txn, self._db, _USED, -entry.length)
        _bump(txn, self._db, _COUNT, -1)


def _verified_value(boot_id: bytes, at_s: float) -> bytes:
    """A verified mark: the boot id, then the wall-clock second of the verification."""
    return boot_id + b" " + str(int(at_s)).encode()


def _parse_verified(value: bytes) -> tuple[bytes, float]:
    """(boot id, verified at) of a mark; a mark without a time (an older cachefs) is due at once."""
    boot, _space, at_s = value.partition(b" ")
    return boot, float(at_s) if at_s.isdigit() else 0.0


def _has_seq(txn: object, db: IndexDb, key: BlockKey, seq: int) -> bool:
    value = txn.get(key.packed(), db=db.blocks)  # type: ignore[attr-defined]
    return value is not None and IndexEntry.unpack(value).seq == seq


def _marks(txn: object, db: IndexDb) -> list[tuple[int, int]]:
    return _unpacked_marks(txn.get(_CLOCK, db=db.meta))  # type: ignore[attr-defined]


def _unpacked_marks(value: bytes | None) -> list[tuple[int, int]]:
    return list(_MARK.iter_unpack(value)) if value else []


def _mark_time(txn: object, db: IndexDb, seq: int, at_s: int) -> None:
    """Note that blocks from insertion number `seq` on are cached at or after `at_s`."""
    value = txn.get(_CLOCK, db=db.meta)  # type: ignore[attr-defined]
    if value and at_s < _MARK.unpack_from(value, len(value) - _MARK.size)[1] + CLOCK_STEP_S:
        return  # a batch of an insert: only the last mark is read
    marks = _unpacked_marks(value)
    cursor = txn.cursor(db=db.fifo)  # type: ignore[attr-defined]
    if cursor.first():  # what no cached block needs: every mark but the last at or before the oldest
        oldest = _SEQ.unpack(cursor.key())[0]
        while len(marks) > 1 and marks[1][0] <= oldest:
            del marks[0]
    marks.append((seq, at_s))
    if len(marks) > CLOCK_MAX_MARKS:
        half = len(marks) // 2
        marks = marks[:half:2] + marks[half:]
    txn.put(_CLOCK, b"".join(_MARK.pack(*mark) for mark in marks), db=db.meta)  # type: ignore[attr-defined]


def _counter(txn: object, db: IndexDb, name: bytes) -> int:
    value = txn.get(name, db=db.meta)  # type: ignore[attr-defined]
    return _SEQ.unpack(value)[0] if value is not None else 0


def _bump(txn: object, db: IndexDb, name: bytes, delta: int) -> None:
    txn.put(name, _SEQ.pack(max(0, _counter(txn, db, name) + delta)), db=db.meta)  # type: ignore[attr-defined]
