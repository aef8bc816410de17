"""Whole blocks reach the cache's data files with O_DIRECT: no second copy in the
page cache and no dirty pages left; short last blocks and file systems that
refuse O_DIRECT go through the page cache. Bytes read back are always the same."""

from __future__ import annotations

import ctypes
import logging
import os
import random
from pathlib import Path

import pytest

from cachefs.buffers import BlockBuffers
from cachefs.cache.keys import BlockKey
from cachefs.cache.store import DIRECT_CHUNK_BYTES, BlockStore

BLOCK = 1024 * 1024
_SYS_CACHESTAT = 451  # x86_64, Linux >= 6.5
_libc = ctypes.CDLL(None, use_errno=True)


class _Range(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def page_cache_pages(path: str) -> tuple[int, int]:
    """(pages of the file in the page cache, of them dirty or under writeback), by cachestat(2)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        whole, stat = _Range(0, 0), _CacheStat()
        if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
            raise OSError(ctypes.get_errno(), f"cachestat of {path} failed")
        return stat.cache, stat.dirty + stat.writeback
    finally:
        os.close(fd)


def write_file(store: BlockStore, file_id: bytes, lengths: list[int]) -> list[bytes]:
    rng = random.Random(len(lengths))
    blocks = [rng.randbytes(length) for length in lengths]
    for blockno, data in enumerate(blocks):
        store.write(BlockKey(file_id, b"versn-01", blockno), data)
    return blocks


def read_back(store: BlockStore, file_id: bytes, blocks: list[bytes]) -> list[bytes | None]:
    return [store.read(BlockKey(file_id, b"versn-01", n), 0, len(data)) for n, data in enumerate(blocks)]


def test_whole_blocks_bypass_the_page_cache_and_read_back_the_same(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, 4 * BLOCK)  # blocks larger than the aligned buffer go through it in pieces
    blocks = write_file(store, b"large-01", [4 * BLOCK, 4 * BLOCK, 4 * BLOCK])
    path = store.path(b"large-01", b"versn-01")
    assert page_cache_pages(path) == (0, 0)
    assert os.path.getsize(path) == 12 * BLOCK
    assert read_back(store, b"large-01", blocks) == blocks
    assert 4 * BLOCK > DIRECT_CHUNK_BYTES


def test_a_short_last_block_keeps_the_file_size_exact(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK)
    blocks = write_file(store, b"tail-001", [BLOCK, BLOCK, 12345])
    path = store.path(b"tail-001", b"versn-01")
    assert os.path.getsize(path) == 2 * BLOCK + 12345  # passthrough hands this size to the kernel
    cached, _dirty = page_cache_pages(path)
    assert cached == -(-12345 // 4096)  # only the tail went through the page cache
    assert read_back(store, b"tail-001", blocks) == blocks


def test_a_read_from_disk_leaves_the_page_cache_as_it_was(tmp_path: Path) -> None:
    """What verification reads: whole blocks with O_DIRECT, the short last block through the page cache."""
    store = BlockStore(tmp_path, BLOCK, BlockBuffers(BLOCK, 4 * BLOCK))  # pool slots: page-aligned buffers
    blocks = write_file(store, b"check-01", [BLOCK, BLOCK, 12345])
    path = store.path(b"check-01", b"versn-01")
    tail_pages = -(-12345 // 4096)
    read = [store.read(BlockKey(b"check-01", b"versn-01", n), 0, len(data), from_disk=True) for n, data in enumerate(blocks)]
    assert read == blocks
    assert page_cache_pages(path)[0] == tail_pages  # the tail's pages, from its write
    assert read_back(store, b"check-01", blocks) == blocks  # a plain read fills it
    assert page_cache_pages(path)[0] == 2 * BLOCK // 4096 + tail_pages


def test_a_rewritten_block_replaces_cached_pages(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, BLOCK)
    key = BlockKey(b"again-01", b"versn-01", 0)
    store.write(key, b"\x01" * BLOCK)
    store.delete(key)
    assert store.read(key, 0, BLOCK) == bytes(BLOCK)  # the hole reads as zeros (now in the page cache)
    store.write(key, b"\x02" * BLOCK)
    assert store.read(key, 0, BLOCK) == b"\x02" * BLOCK


def test_a_file_system_without_o_direct_gets_page_cache_writes(ramfs_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = BlockStore(ramfs_dir, BLOCK)
    with caplog.at_level(logging.INFO, logger="cachefs.cache.store"):
        blocks = write_file(store, b"ramfs-01", [BLOCK, BLOCK, 777])
        more = write_file(store, b"ramfs-02", [BLOCK])
    assert read_back(store, b"ramfs-01", blocks) == blocks
    assert read_back(store, b"ramfs-02", more) == more
    assert [store.read(BlockKey(b"ramfs-01", b"versn-01", n), 0, len(data), from_disk=True)
            for n, data in enumerate(blocks)] == blocks
    refusals = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(refusals) == 1
