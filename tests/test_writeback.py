"""The cache's data files of large files start their writeback as they are written,
instead of holding dirty pages until the kernel's 30 s expiry."""

from __future__ import annotations

import ctypes
import os
import random
import time
from pathlib import Path

from cachefs.cache.keys import BlockKey
from cachefs.cache.store import WRITEBACK_EVERY_BYTES, BlockStore

BLOCK = 1024 * 1024
_SYS_CACHESTAT = 451  # x86_64, Linux >= 6.5
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def unwritten_pages(path: str) -> int:
    """Pages of a file that are dirty or being written back (cachestat(2), whole file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        whole, stat = _Range(0, 0), _CacheStat()
        if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
            raise OSError(ctypes.get_errno(), f"cachestat of {path} failed")
        return stat.dirty + stat.writeback
    finally:
        os.close(fd)


def test_a_large_data_file_is_written_back_as_it_is_written(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK)
    rng = random.Random(5)
    file_id, version = b"large-01", b"versn-01"
    for blockno in range(WRITEBACK_EVERY_BYTES // BLOCK):
        store.write(BlockKey(file_id, version, blockno), rng.randbytes(BLOCK))
    path = store.path(file_id, version)
    deadline = time.monotonic() + 10.0
    while unwritten_pages(path):
        assert time.monotonic() < deadline, f"{unwritten_pages(path)} pages still not written back after 10 s"
        time.sleep(0.05)
