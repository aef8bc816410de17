"""The block buffer pool: a slot is refilled only once nothing can read it, from any thread; past its slots
and for other lengths it hands out heap buffers; trimmed, its free slots' pages go back to the system."""

from __future__ import annotations

import threading

from cachefs.buffers import BlockBuffers

BLOCK = 64 * 1024


def filled(buffers: BlockBuffers, byte: bytes) -> memoryview | bytearray:
    buffer = buffers.take(BLOCK)
    buffer[:] = byte * BLOCK
    return buffer


def test_a_slot_is_refilled_only_once_its_last_view_is_gone() -> None:
    buffers = BlockBuffers(BLOCK, max_blocks=1)
    first = filled(buffers, b"a")
    piece = first[100:200]  # a reply or a held slice outlives the block it came from
    del first
    assert buffers.in_use_bytes == BLOCK
    second = filled(buffers, b"b")  # the only slot is still readable: a heap buffer
    assert isinstance(second, bytearray) and buffers.overflows == 1
    assert bytes(piece) == b"a" * 100
    del piece
    assert buffers.in_use_bytes == 0
    third = filled(buffers, b"c")
    assert isinstance(third, memoryview) and buffers.in_use_bytes == BLOCK
    assert bytes(second) == b"b" * BLOCK


def test_slots_are_reused_and_blocks_stay_apart() -> None:
    buffers = BlockBuffers(BLOCK, max_blocks=4)
    for round_ in range(20):
        held = [filled(buffers, bytes([round_ * 4 + i])) for i in range(4)]
        assert [bytes(block) for block in held] == [bytes([round_ * 4 + i]) * BLOCK for i in range(4)]
        assert buffers.in_use_bytes == 4 * BLOCK
        del held
    assert buffers.in_use_bytes == 0
    assert buffers.overflows == 0
    assert buffers.resident_bytes == 4 * BLOCK  # never more slots than were held at once


def test_other_lengths_are_heap_buffers() -> None:
    buffers = BlockBuffers(BLOCK, max_blocks=4)
    short = buffers.take(BLOCK - 1)  # a file's last block, a small file
    assert isinstance(short, bytearray) and len(short) == BLOCK - 1
    assert buffers.in_use_bytes == 0


def test_a_slot_dropped_on_another_thread_comes_back() -> None:
    buffers = BlockBuffers(BLOCK, max_blocks=2)
    blocks = [filled(buffers, b"x")]  # the cache writer's thread drops a batch once written
    worker = threading.Thread(target=blocks.clear)
    worker.start()
    worker.join()
    assert buffers.in_use_bytes == 0


def test_trim_gives_the_free_slots_pages_back() -> None:
    buffers = BlockBuffers(BLOCK, max_blocks=2)
    kept = filled(buffers, b"k")
    dropped = filled(buffers, b"d")
    del dropped
    assert buffers.resident_bytes == 2 * BLOCK
    buffers.trim()
    assert buffers.resident_bytes == BLOCK
    assert bytes(kept) == b"k" * BLOCK  # a slot in use keeps its bytes
    again = buffers.take(BLOCK)
    assert bytes(again) == bytes(BLOCK)  # its pages were dropped: the kernel hands zeroed ones
