"""Byte buffers that a read fills whole: block bytes in slots of reused mappings, other pieces allocated without zeroing."""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import time
import weakref

log = logging.getLogger(__name__)

# What a fetch or a disk read fills: a slot of a BlockBuffers pool or a bytearray.
Buffer = bytearray | memoryview

# The C API's constructor with no source leaves the bytes as malloc gave them;
# `bytearray(n)` zeroes them first, a visible share of the daemon's CPU
# (docs/performance.md) spent on bytes the read then overwrites.
_from_string_and_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
_from_string_and_size.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_from_string_and_size.restype = ctypes.py_object


def unfilled_buffer(size: int) -> bytearray:
    """A bytearray of `size` bytes whose contents are undefined: hand it on only once a read has filled all of it."""
    buffer: bytearray = _from_string_and_size(None, size)
    return buffer


def page_aligned(buffer: bytes | Buffer, alignment: int) -> bool:
    """Whether a writable buffer starts at a multiple of `alignment` (a pool slot starts on a page)."""
    if isinstance(buffer, bytes) or (isinstance(buffer, memoryview) and buffer.readonly) or not len(buffer):
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % alignment == 0


# The smallest slot class; pieces shorter than half of it (a small file of a
# few KiB) come from the heap, where holes that small are soon reused.
SMALLEST_SLOT_BYTES = 64 * 1024
# Each class reserves address space for every bound: no commit charge for it (Linux's flag; not in Python 3.11's mmap).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class _Slots:
    """`count` slots of `size` bytes in one anonymous mapping, each back in the free list once nothing refers to it."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        try:
            # Address space only: a slot's pages become resident when it is first filled.
            self._mapping = mmap.mmap(-1, count * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as exc:  # strict overcommit (vm.overcommit_memory=2) counts what is only reserved
            log.warning("no pool of %d-byte buffers (%s): they come from the heap", size, exc)
            self._mapping = mmap.mmap(-1, mmap.PAGESIZE)  # unused: no slots
            count = 0
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: the slot freed last, resident
        self._watchers: list[weakref.ref[ctypes.Array[ctypes.c_char]] | None] = [None] * count
        self._resident: set[int] = set()  # slots filled since their last trim
        self._freed_at = [0.0] * count  # time.monotonic() of each slot's last return
        self._lock = threading.Lock()

    def take(self, length: int) -> memoryview | None:
        """The first `length` bytes of a free slot, or None if every slot is in use."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._resident.add(slot)
        array = (ctypes.c_char * self.size).from_buffer(self._mapping, slot * self.size)
        self._watchers[slot] = weakref.ref(array, functools.partial(self._give_back, slot))
        view = memoryview(array).cast("B")
        return view if length == self.size else view[:length]

    def _give_back(self, slot: int, _watcher: object) -> None:
        with self._lock:
            self._watchers[slot] = None
            self._freed_at[slot] = time.monotonic()
            self._free.append(slot)

    def in_use_bytes(self) -> int:
        with self._lock:
            return (self.count - len(self._free)) * self.size

    def resident_bytes(self) -> int:
        with self._lock:
            return len(self._resident) * self.size

    def trim(self, free_for_s: float) -> None:
        with self._lock:
            free = set(self._free)
            before = time.monotonic() - free_for_s
            idle = [slot for slot in self._resident if slot in free and self._freed_at[slot] <= before]
            for slot in idle:
                self._mapping.madvise(mmap.MADV_DONTNEED, slot * self.size, self.size)
            self._resident.difference_update(idle)


class BlockBuffers:
    """Buffers for block bytes (whole blocks, a file's last block, small files): slots of anonymous
    mappings, one per size class, each slot back in its pool once nothing refers to it.

    Block buffers taken from the heap shared it with everything else the
    daemon allocates (libfuse's request buffers, LMDB's pages), and the holes
    their frees left kept the heap well above the bytes in use; a fresh mmap
    per block costs 256 page faults per MiB (docs/performance.md has both).
    A slot is reused, so its pages stay resident: a class's resident size is
    the most of its slots in use at once, until `trim` gives the pages of
    slots free for a while back (the heap cannot use them).

    The classes are the block size and its halves down to
    SMALLEST_SLOT_BYTES; a piece takes a slot of the smallest class that
    holds it. `take` returns a memoryview of a ctypes array over the slot;
    every view sliced from it keeps the array alive, and a weakref callback
    on the array puts the slot back once the last view is gone, so a slot is
    never refilled while anything can still read it. The callback runs on
    whichever thread drops that last view (the cache writer's, a disk
    read's): each free list has a lock. A piece shorter than the smallest
    class or longer than a block, and one whose class has every slot in use
    (`max_bytes` of them), is a heap bytearray.
    """

    def __init__(self, block_size: int, max_bytes: int) -> None:
        self.block_size = block_size
        sizes = [block_size]
        while sizes[-1] // 2 >= SMALLEST_SLOT_BYTES and (sizes[-1] // 2) % mmap.PAGESIZE == 0:
            sizes.append(sizes[-1] // 2)
        self._classes = [_Slots(size, max(1, max_bytes // size)) for size in reversed(sizes)]  # smallest first
        self.overflows = 0  # takes that found every slot of their class in use (they got heap buffers)

    def take(self, length: int) -> Buffer:
        """A writable buffer of `length` bytes with undefined contents: fill it whole before handing it on."""
        slots = self._class_of(length)
        if slots is not None:
            buffer = slots.take(length)
            if buffer is not None:
                return buffer
            self.overflows += 1
        return unfilled_buffer(length)

    def _class_of(self, length: int) -> _Slots | None:
        """The smallest class whose slots hold `length` bytes; None for a heap buffer."""
        if length * 2 < self._classes[0].size:
            return None
        return next((slots for slots in self._classes if length <= slots.size), None)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the slots in use (a piece in a larger slot counts its whole slot)."""
        return sum(slots.in_use_bytes() for slots in self._classes)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the slots filled since their last trim: at most what the pools add to the daemon's RSS."""
        return sum(slots.resident_bytes() for slots in self._classes)

    def trim(self, free_for_s: float = 0.0) -> None:
        """Give back to the system the pages of the slots free for `free_for_s` or longer: the
        memory the heap may need next (small files after shards) is not the pools'. A slot
        refilled after its trim costs its page faults again."""
        for slots in self._classes:
            slots.trim(free_for_s)
