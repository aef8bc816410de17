"""The block buffer pools: a slot is refilled only once nothing can read it, from any thread; a piece takes
the smallest class that holds it, and past its class's slots, or below the smallest, a heap buffer;
trimmed, the pages of slots free long enough go back to the system; slots start on a page (O_DIRECT
writes them as they are)."""

from __future__ import annotations

import threading
import time

from cachefs.buffers import BlockBuffers, page_aligned

BLOCK = 256 * 1024  # classes of 64, 128 and 256 KiB


def filled(buffers: BlockBuffers, byte: bytes, length: int = BLOCK) -> memoryview | bytearray:
    buffer = buffers.take(length)
    buffer[:] = byte * length
    return buffer


def test_a_slot_is_refilled_only_once_its_last_view_is_gone() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=BLOCK)
    first = filled(buffers, b"a")
    piece = first[100:200]  # a reply or a held slice outlives the block it came from
    del first
    assert buffers.in_use_bytes == BLOCK
    second = filled(buffers, b"b")  # the only block slot is still readable: a heap buffer
    assert isinstance(second, bytearray) and buffers.overflows == 1
    assert bytes(piece) == b"a" * 100
    del piece
    assert buffers.in_use_bytes == 0
    third = filled(buffers, b"c")
    assert isinstance(third, memoryview) and buffers.in_use_bytes == BLOCK
    assert bytes(second) == b"b" * BLOCK


def test_slots_are_reused_and_blocks_stay_apart() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=4 * BLOCK)
    for round_ in range(20):
        held = [filled(buffers, bytes([round_ * 4 + i])) for i in range(4)]
        assert [bytes(block) for block in held] == [bytes([round_ * 4 + i]) * BLOCK for i in range(4)]
        assert buffers.in_use_bytes == 4 * BLOCK
        del held
    assert buffers.in_use_bytes == 0
    assert buffers.overflows == 0
    assert buffers.resident_bytes == 4 * BLOCK  # never more slots than were held at once


def test_a_piece_takes_the_smallest_class_that_holds_it() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=4 * BLOCK)
    last_block = filled(buffers, b"l", BLOCK - 1)  # a file's last block
    small_file = filled(buffers, b"s", 100 * 1024)
    smaller = filled(buffers, b"t", 40 * 1024)
    assert [len(piece) for piece in (last_block, small_file, smaller)] == [BLOCK - 1, 100 * 1024, 40 * 1024]
    assert all(isinstance(piece, memoryview) for piece in (last_block, small_file, smaller))
    assert buffers.in_use_bytes == BLOCK + 128 * 1024 + 64 * 1024
    assert bytes(small_file) == b"s" * 100 * 1024 and bytes(smaller) == b"t" * 40 * 1024
    tiny = buffers.take(31 * 1024)  # below half the smallest class: the heap's
    larger = buffers.take(BLOCK + 1)
    assert isinstance(tiny, bytearray) and isinstance(larger, bytearray)
    assert buffers.in_use_bytes == BLOCK + 128 * 1024 + 64 * 1024


def test_a_slot_dropped_on_another_thread_comes_back() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=2 * BLOCK)
    blocks = [filled(buffers, b"x")]  # the cache writer's thread drops a batch once written
    worker = threading.Thread(target=blocks.clear)
    worker.start()
    worker.join()
    assert buffers.in_use_bytes == 0


def test_trim_gives_the_free_slots_pages_back() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=2 * BLOCK)
    kept = filled(buffers, b"k")
    dropped = filled(buffers, b"d")
    del dropped
    assert buffers.resident_bytes == 2 * BLOCK
    buffers.trim()
    assert buffers.resident_bytes == BLOCK
    assert bytes(kept) == b"k" * BLOCK  # a slot in use keeps its bytes
    again = buffers.take(BLOCK)
    assert bytes(again) == bytes(BLOCK)  # its pages were dropped: the kernel hands zeroed ones


def test_only_slots_free_long_enough_are_trimmed() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=2 * BLOCK)
    kept = filled(buffers, b"k")
    dropped = filled(buffers, b"d")
    del dropped  # free from now on
    buffers.trim(free_for_s=0.04)
    assert buffers.resident_bytes == 2 * BLOCK  # not free for 0.04 s yet
    time.sleep(0.05)
    buffers.trim(free_for_s=0.04)
    assert buffers.resident_bytes == BLOCK
    assert bytes(kept) == b"k" * BLOCK


def test_slots_start_on_a_page() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=3 * BLOCK)
    blocks = [buffers.take(BLOCK) for _ in range(3)] + [buffers.take(100 * 1024)]
    assert all(page_aligned(block, 4096) for block in blocks)
    assert not page_aligned(blocks[0][512:], 4096)
    assert not page_aligned(bytes(BLOCK), 4096)  # read-only: never handed to O_DIRECT as is


def test_without_address_space_for_the_pools_buffers_come_from_the_heap() -> None:
    buffers = BlockBuffers(BLOCK, max_bytes=1 << 48)  # more than a process can map
    block = filled(buffers, b"h")
    assert isinstance(block, bytearray) and bytes(block) == b"h" * BLOCK
    assert buffers.in_use_bytes == buffers.resident_bytes == 0
