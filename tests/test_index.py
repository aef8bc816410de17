"""The block index on a real LMDB in a temp dir: paging in one file version's entries, entries that change under a read,
a batch whose victim it caches again."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_helpers import block_cache

from cachefs.cache import BlockCache, BlockKey
from cachefs.cache import index as index_module

BLOCK = 4096
FILE_ID, NEXT_FILE_ID = b"\x01" * 8, b"\x01" * 7 + b"\x02"
VERSION, OTHER_VERSION = b"\x02" * 8, b"\x03" * 8


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as opened:
        yield opened


def test_page_in_reads_exactly_the_entries_of_one_file_version(cache: BlockCache) -> None:
    blocks = [(FILE_ID, VERSION, 10), (FILE_ID, OTHER_VERSION, 5), (NEXT_FILE_ID, VERSION, 3)]
    for file_id, version, count in blocks:
        inserted = cache.insert_many([(BlockKey(file_id, version, n), bytes([n]) * BLOCK, True) for n in range(count)])
        assert inserted == count
    assert cache.index.page_in(FILE_ID, VERSION) == 10
    assert cache.index.page_in(FILE_ID, OTHER_VERSION) == 5
    assert cache.index.page_in(NEXT_FILE_ID, VERSION) == 3
    assert cache.index.page_in(b"\x09" * 8, VERSION) == 0
    cache.page_in_index(FILE_ID, VERSION)  # the best-effort form the read-ahead calls: no error


def test_a_block_evicted_while_it_is_read_is_a_miss_not_corruption(cache: BlockCache) -> None:
    """A reader looks up a block's entry, then reads its bytes (in a worker thread, perhaps after
    waiting for one); the cache writer may evict the block in between. That read finds a hole:
    a plain miss, not a corrupt block (no warning, no count; a real corruption still is one)."""
    key = BlockKey(FILE_ID, VERSION, 0)
    assert cache.insert_many([(key, b"\x07" * BLOCK, True)]) == 1
    entry = cache.entry(key)
    assert entry is not None
    cache.remove(key)  # what an eviction does meanwhile
    assert cache.read(key, entry) is None
    assert cache._stats.corrupt_blocks == 0
    assert cache.insert_many([(key, b"\x07" * BLOCK, True)]) == 1
    entry = cache.entry(key)
    assert entry is not None
    with open(cache.store.path(FILE_ID, VERSION), "r+b") as data_file:
        data_file.write(b"\x08")  # a bit flipped on disk
    assert cache.read(key, entry) is None
    assert cache._stats.corrupt_blocks == 1 and not cache.contains(key)


def test_a_victim_cached_again_in_the_same_batch_keeps_its_bytes(cache: BlockCache) -> None:
    """A block chosen as a victim and also in the batch (fetched again) is written after its
    bytes were freed: it is cached whole, not left as a hole behind a new entry."""
    old = [BlockKey(FILE_ID, VERSION, n) for n in range(64)]
    assert cache.insert_many([(key, bytes([n + 1]) * BLOCK, True) for n, key in enumerate(old)]) == 64
    newcomer = BlockKey(NEXT_FILE_ID, VERSION, 0)
    # The newcomer displaces old[0], the oldest; old[0], fetched again, then displaces old[1].
    assert cache.insert_many([(newcomer, b"\x99" * BLOCK, True), (old[0], b"\x01" * BLOCK, True)]) == 2
    entry = cache.entry(old[0])
    assert entry is not None and cache.read(old[0], entry) == b"\x01" * BLOCK  # not a hole
    assert not cache.contains(old[1]) and cache._stats.corrupt_blocks == 0



def _counting_walks(cache: BlockCache, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Keys the eviction walks read from the index, one count per `oldest` call."""
    read: list[int] = []
    oldest = cache.index.oldest

    def counted(*args: int) -> list[tuple[int, BlockKey]]:
        found = oldest(*args)
        read.append(len(found))
        return found

    monkeypatch.setattr(cache.index, "oldest", counted)
    return read


@pytest.mark.parametrize("kept", ["pinned", "held"])
def test_eviction_passes_a_pinned_or_held_head_once_and_evicts_it_once_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    """The oldest 2,000 blocks belong to a pinned file (or one the kernel reads directly):
    50 insert batches that each evict read them from the index about once in all, not
    once per batch (nor once per batch of victims: quadratically).
    Once unpinned or released, they are the first to go."""
    head = 2000
    with block_cache(tmp_path, (head + 4) * 512, BLOCK) as cache:
        pinned_file = b"\x09" * 8
        blocks = [(BlockKey(pinned_file, VERSION, blockno), b"p" * 512, False) for blockno in range(head)]
        for start in range(0, head, 500):
            assert cache.insert_many(blocks[start : start + 500]) == 500
        if kept == "pinned":
            cache.pin({pinned_file: head * 512})
        else:
            assert cache.hold(pinned_file, VERSION)
        read = _counting_walks(cache, monkeypatch)
        for batch in range(50):
            other = (batch + 1).to_bytes(8, "big")
            assert cache.insert_many([(BlockKey(other, VERSION, 0), b"o" * 512, True)]) == 1
        assert sum(read) < 2 * head, f"{sum(read)} keys read in {len(read)} walks"
        assert cache.contains(BlockKey(pinned_file, VERSION, 0))
        if kept == "pinned":
            cache.unpin([pinned_file])
        else:
            cache.unhold(pinned_file, VERSION)
        assert cache.insert_many([(BlockKey(b"\x0a" * 8, VERSION, 0), b"n" * 512, True)]) == 1
        assert not cache.contains(BlockKey(pinned_file, VERSION, 0))  # the oldest block went first


def test_after_a_crash_what_the_index_does_not_name_is_freed(tmp_path: Path) -> None:
    """A mount that ended without closing the cache (SIGKILL) may have left a block written
    whose entry was never committed, and a data file whose entries were dropped but which
    was not removed yet: the next mount's sweep frees both and keeps every indexed block.
    A sweep cut short (an unmount) is due again at the next mount."""
    keys = [BlockKey(FILE_ID, VERSION, blockno) for blockno in range(2)]
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
        assert not cache.sweep_due  # a new cache dir
        assert cache.insert_many([(key, bytes([key.blockno + 1]) * BLOCK, False) for key in keys]) == 2
        cache.store.write(BlockKey(FILE_ID, VERSION, 5), b"\x07" * BLOCK)  # written, never indexed
        cache.store.write(BlockKey(NEXT_FILE_ID, VERSION, 0), b"\x08" * BLOCK)  # a file no entry names
        cache.close()
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
        assert not cache.sweep_due  # closed: nothing to sweep
    for _mount in ("crashed before", "closed, but its sweep was cut short"):
        with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
            assert cache.sweep_due
            cache.close()
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
        assert cache.sweep_due
        files = [file for directory in cache.store.data_dirs() for file in cache.store.data_files(directory)]
        assert sorted(files) == sorted([(FILE_ID, VERSION), (NEXT_FILE_ID, VERSION)])
        assert cache.sweep_files(files) == (1, 1)
        cache.swept()
        assert cache.store.allocated_blocks(FILE_ID, VERSION) == {0, 1}
        assert not os.path.exists(cache.store.path(NEXT_FILE_ID, VERSION))
        for key in keys:
            entry = cache.entry(key)
            assert entry is not None and bytes(cache.read(key, entry) or b"") == bytes([key.blockno + 1]) * BLOCK
        cache.close()
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
        assert not cache.sweep_due


def test_a_block_evicted_while_it_is_read_is_a_miss_found_without_the_cache_lock(cache: BlockCache) -> None:
    """The trio thread reads blocks; a miss because the block was evicted meanwhile must not
    wait for the cache lock, which the cache writer holds through a whole batch."""
    key = BlockKey(FILE_ID, VERSION, 0)
    assert cache.insert_many([(key, b"\x01" * BLOCK, False)]) == 1
    entry = cache.entry(key)
    assert entry is not None
    cache.remove(key)  # what an eviction does after the entry was looked up
    results: list[object] = []
    with cache._lock:  # a batch being written
        reader = threading.Thread(target=lambda: results.append(cache.read(key, entry)))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the read waited for the cache lock"
    assert results == [None]


def test_the_index_knows_when_its_oldest_block_was_cached(cache: BlockCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cachefs stats` says how long dataset bytes have been on this node: the oldest block's
    time, a lower bound within index.CLOCK_STEP_S, kept as eviction moves the oldest on."""
    index = cache.index
    keys = [BlockKey(FILE_ID, VERSION, blockno) for blockno in range(6)]
    assert index.cached_since() is None  # nothing cached
    index.add([(keys[0], BLOCK, b"")])  # a caller that gives no time (an older cachefs): unknown
    assert index.cached_since() is None
    start = 1_800_000_000
    for position, at_s in ((1, start), (2, start + 100), (3, start + index_module.CLOCK_STEP_S + 1)):
        index.add([(keys[position], BLOCK, b"")], at_s=at_s)
    assert index.cached_since() is None  # keys[0] has no time
    index.remove(keys[0])
    assert index.cached_since() == start  # keys[1] and keys[2]: one mark of the first batch's time
    index.remove_many(keys[1:3])
    assert index.cached_since() == start + index_module.CLOCK_STEP_S + 1
    monkeypatch.setattr(index_module, "CLOCK_MAX_MARKS", 4)  # a long life: old marks thinned, never too late
    for step in range(2, 8):
        index.add([(keys[4 + step % 2], BLOCK, b"")], at_s=start + step * index_module.CLOCK_STEP_S + 1)
    assert index.cached_since() == start + index_module.CLOCK_STEP_S + 1  # keys[3]'s mark is kept
    index.remove(keys[3])
    assert start + 2 * index_module.CLOCK_STEP_S < index.cached_since() <= start + 7 * index_module.CLOCK_STEP_S + 1
