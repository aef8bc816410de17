"""The choice between reading a small cached range on the event loop's thread or in a worker."""

from __future__ import annotations

import threading
import time

import pytest

from cachefs.read.blocks import INLINE_DISK_READ_S, SmallDiskReads


def test_small_disk_reads_stay_inline_only_while_the_disk_is_fast() -> None:
    reads = SmallDiskReads(INLINE_DISK_READ_S)
    assert reads.fast  # nothing measured yet
    assert reads.timed(lambda: b"data") == b"data"
    assert reads.fast

    def slow_read() -> bytes:
        time.sleep(5 * INLINE_DISK_READ_S)
        return b"slow"

    for _ in range(8):
        assert reads.timed(slow_read) == b"slow"
    assert not reads.fast  # a slow disk: reads go to worker threads

    worker = threading.Thread(target=lambda: [reads.timed(bytes) for _ in range(30)])
    worker.start()  # reads timed in a worker thread bring it back
    worker.join()
    assert reads.fast


def test_a_failing_read_is_timed_and_raises() -> None:
    reads = SmallDiskReads(INLINE_DISK_READ_S)

    def failing_read() -> bytes:
        time.sleep(5 * INLINE_DISK_READ_S)
        raise OSError("EIO")

    for _ in range(8):
        with pytest.raises(OSError, match="EIO"):
            reads.timed(failing_read)
    assert not reads.fast
