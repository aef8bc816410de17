"""Admission into a full cache without a plan (TinyLFU), on a real BlockCache: LMDB index and data files in a temp dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_helpers import block_cache

from cachefs.cache import BlockCache, BlockKey

BLOCK = 4096
FILE_ID, VERSION = b"\x01" * 8, b"\x02" * 8


def key(blockno: int) -> BlockKey:
    return BlockKey(FILE_ID, VERSION, blockno)


def data(blockno: int) -> bytes:
    return bytes([blockno % 256]) * BLOCK


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    with block_cache(tmp_path, 4 * BLOCK, BLOCK) as opened:
        yield opened


def fill(cache: BlockCache, blocknos: list[int]) -> None:
    """Insert blocks one at a time, so their age follows the list."""
    for blockno in blocknos:
        assert cache.insert_many([(key(blockno), data(blockno), False)]) == 1


def cached(cache: BlockCache) -> set[int]:
    return {blockno for blockno in range(32) if cache.contains(key(blockno))}


def test_a_block_used_more_often_than_the_oldest_takes_its_place(cache: BlockCache) -> None:
    fill(cache, [0, 1, 2, 3])
    cache.sketch.record(key(0))
    for _ in range(3):  # two uses before the one that fetched it
        cache.sketch.record(key(9))
    assert cache.insert_many([(key(9), data(9), False)]) == 1
    assert cached(cache) == {1, 2, 3, 9}  # the oldest went
    entry = cache.entry(key(9))
    assert entry is not None and cache.read(key(9), entry) == data(9)


def test_a_block_used_no_more_often_than_the_oldest_is_not_admitted(cache: BlockCache) -> None:
    fill(cache, [0, 1, 2, 3])
    cache.sketch.record(key(0))
    cache.sketch.record(key(9))
    cache.sketch.record(key(9))  # the use that fetched it, and one before: no more than block 0's
    assert cache.insert_many([(key(9), data(9), False)]) == 0
    assert cached(cache) == {0, 1, 2, 3}


def loop_hits(cache: BlockCache, blocknos: range, epochs: int) -> list[int]:
    """Reads of `blocknos` in turn, `epochs` times; the misses are fetched and offered in
    batches of four, as the cache writer offers them. The hits of each epoch."""
    hits = []
    for _epoch in range(epochs):
        hits.append(0)
        missed: list[int] = []
        for blockno in blocknos:
            cache.sketch.record(key(blockno))
            if cache.contains(key(blockno)):
                hits[-1] += 1
            else:
                missed.append(blockno)
            if len(missed) == 4 or blockno == blocknos[-1]:
                cache.insert_many([(key(missed_no), data(missed_no), False) for missed_no in missed])
                missed = []
    return hits


@pytest.mark.parametrize("first", [[0, 1, 2, 3], [0, 5, 6, 7], [7, 6, 5, 4]])
def test_a_loop_over_twice_the_cache_keeps_its_hits_whatever_blocks_it_holds(cache: BlockCache, first: list[int]) -> None:
    """Epochs over 8 blocks through a cache of 4, after a first epoch that cached `first`
    (read-ahead's writes land out of order, so not always the loop's first blocks): every
    epoch hits on half its reads. Before, a block fetched displaced a cached one whose use
    in the same pass was still to come, so that epoch lost the cached blocks' hits."""
    fill(cache, first)
    for blockno in range(8):
        cache.sketch.record(key(blockno))  # the first epoch read them all
    assert loop_hits(cache, range(8), 3) == [4, 4, 4]
    assert cached(cache) == set(first)


def test_a_block_read_ahead_counts_the_read_on_its_way(cache: BlockCache) -> None:
    """A block fetched ahead of its first read (read-ahead) is weighed as its reader's fetch
    would be: the sketch only counts that read once it happens. Against a victim nobody read
    lately it gets in as its reader's fetch would; without that, the reader would fetch it
    a second time to get it in."""
    fill(cache, [0, 1, 2, 3])  # never read: estimate 0, like blocks whose counts aged away
    for blockno in (8, 9):
        cache.sketch.record(key(blockno))  # used once before
    cache.sketch.record(key(8))  # fetched by its reader: that use counted now
    assert cache.insert_many([(key(8), data(8), False)]) == 1
    assert cache.insert_many([(key(9), data(9), False)], ahead={key(9)}) == 1  # its read is on its way
    assert cached(cache) == {2, 3, 8, 9}
    cache.sketch.record(key(10))
    assert cache.insert_many([(key(10), data(10), False)]) == 0  # its first use: 0 > 0, no
    assert cache.insert_many([(key(11), data(11), False)], ahead={key(11)}) == 0  # no, like its reader's
    assert cached(cache) == {2, 3, 8, 9}


def test_a_cached_block_waiting_for_its_reader_keeps_its_place(cache: BlockCache) -> None:
    """A stream's read-ahead runs past a full cache: the blocks it cached and its reader has
    not reached yet are worth as much as those it offers now, so they are not evicted for
    them (before, once the older blocks had each refused one, the unread ones were next and
    went: their reader fetched them a second time)."""
    fill(cache, [0, 1, 2, 3])
    for blockno in (0, 1):
        cache.sketch.record(key(blockno))  # read; 2 and 3 were read ahead and wait for their reader
    offered = [8, 9, 10, 11]  # one batch: each is weighed against the next oldest
    ahead = {key(blockno) for blockno in (2, 3, *offered)}
    assert cache.insert_many([(key(blockno), data(blockno), False) for blockno in offered], ahead=ahead) == 0
    assert cached(cache) == {0, 1, 2, 3}


def test_a_popular_old_block_does_not_freeze_the_cache(cache: BlockCache) -> None:
    """A block refused by the oldest one is not offered the same victim again: the next
    block is weighed against the next oldest, so new blocks still get in."""
    fill(cache, [0, 1, 2, 3])
    for _ in range(5):
        cache.sketch.record(key(0))  # the oldest is the most used
    for blockno in (8, 9):
        for _ in range(2):  # one use before the one that fetched it
            cache.sketch.record(key(blockno))
    assert cache.insert_many([(key(8), data(8), False), (key(9), data(9), False)]) == 1
    assert cached(cache) == {0, 2, 3, 9}  # 8 lost to block 0; 9 displaced block 1


def test_forced_and_pinned_blocks_always_get_a_place(cache: BlockCache) -> None:
    fill(cache, [0, 1, 2, 3])
    assert cache.insert_many([(key(9), data(9), True)]) == 1  # an operator's warm-up
    assert cached(cache) == {1, 2, 3, 9}
