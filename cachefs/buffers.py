"""Byte buffers that a read fills whole: block-sized ones from a pool of reused slots, others allocated without zeroing."""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref

# What a fetch or a disk read fills: a pool slot (block-sized) or a bytearray.
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


class BlockBuffers:
    """Block-sized buffers, each a slot of one anonymous mapping, back in the pool once nothing refers to it.

    Block buffers taken from the heap shared it with everything else the
    daemon allocates (libfuse's request buffers, LMDB's pages, shorter
    pieces), and the holes their frees left kept the heap well above the
    bytes in use; a fresh mmap per block costs 256 page faults per MiB
    (docs/performance.md has both). A slot is reused, so its pages stay
    resident and the pool's resident size is the most blocks held at once.

    `take` returns a memoryview of a ctypes array over the slot; every view
    sliced from it keeps the array alive, and a weakref callback on the
    array puts the slot back once the last view is gone, so a slot is never
    refilled while anything can still read it. The callback runs on
    whichever thread drops that last view (the cache writer's, a disk
    read's): the free list has a lock. Past `max_blocks` at once, and for
    any other length, `take` falls back to a heap bytearray.
    """

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        # Address space only: a slot's pages become resident when it is first filled.
        self._mapping = mmap.mmap(-1, max_blocks * block_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._free = list(range(max_blocks - 1, -1, -1))  # popped from the end: the slot freed last, resident
        self._watchers: list[weakref.ref[ctypes.Array[ctypes.c_char]] | None] = [None] * max_blocks
        self._resident: set[int] = set()  # slots filled since the last trim
        self._lock = threading.Lock()
        self.overflows = 0  # takes that found every slot in use (they got heap buffers)

    def take(self, length: int) -> Buffer:
        """A writable buffer of `length` bytes with undefined contents: fill it whole before handing it on."""
        if length != self.block_size:
            return unfilled_buffer(length)
        with self._lock:
            if not self._free:
                self.overflows += 1
                return unfilled_buffer(length)
            slot = self._free.pop()
            self._resident.add(slot)
        array = (ctypes.c_char * length).from_buffer(self._mapping, slot * length)
        self._watchers[slot] = weakref.ref(array, functools.partial(self._give_back, slot))
        return memoryview(array).cast("B")

    def _give_back(self, slot: int, _watcher: object) -> None:
        with self._lock:
            self._watchers[slot] = None
            self._free.append(slot)

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return (self.max_blocks - len(self._free)) * self.block_size

    @property
    def resident_bytes(self) -> int:
        """Bytes of the slots filled since the last trim: what the pool adds to the daemon's RSS."""
        with self._lock:
            return len(self._resident) * self.block_size

    def trim(self) -> None:
        """Give the pages of free slots back to the system (an idle daemon: a slot refilled then costs its page faults again)."""
        with self._lock:
            free = set(self._free)
            idle = [slot for slot in self._resident if slot in free]
            for slot in idle:
                self._mapping.madvise(mmap.MADV_DONTNEED, slot * self.block_size, self.block_size)
            self._resident.difference_update(idle)
