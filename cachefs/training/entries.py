"""A plan's entries (block uses, 8 bytes each, spilled to disk beyond a few chunks) and its compact file table."""

from __future__ import annotations

import array
import bisect
import collections
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ..cache.store import punch_hole
from ..errors import CachefsError
from ..namespace.tree import Inode

log = logging.getLogger(__name__)

CHUNK_ENTRIES = 1 << 16  # 512 KiB of entries
MEMORY_CHUNKS = 8  # 512 K entries (4 MiB) per plan in memory; the rest waits on disk


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
