"""Eviction and admission of a full BlockCache (real LMDB and data files in a temp dir): Belady's
rule along a loader's plan, and TinyLFU without one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from spoke_parts import BLOCK, VERSION, budget_of

from cachefs.cache import BlockCache, BlockKey
from cachefs.db import open_index_db
from cachefs.metrics import Stats
from cachefs.namespace.tree import KIND_FILE, Inode
from cachefs.read.held import HeldBlocks
from cachefs.training.advice import ActivePlans
from cachefs.training.entries import EntryStore
from cachefs.training.plans import Plan

FILE_ID = (42).to_bytes(8, "big")
FILE = Inode(ino=42, kind=KIND_FILE, mode=0o644, mtime_ns=0, size=16 * BLOCK, parent=1, file_id=FILE_ID, version=VERSION)
CAPACITY_BLOCKS = 4


def key(blockno: int) -> BlockKey:
    return BlockKey(FILE_ID, VERSION, blockno)


@contextlib.contextmanager
def full_cache(directory: Path, advisor: ActivePlans) -> Iterator[tuple[BlockCache, Stats]]:
    """A cache of CAPACITY_BLOCKS blocks holding blocks 0, 1, 2, 3 (0 the oldest)."""
    db = open_index_db(directory / "index.lmdb")
    stats = Stats()
    try:
        cache = BlockCache(db, directory, CAPACITY_BLOCKS * BLOCK, BLOCK, stats, advisor=advisor)
        for blockno in range(CAPACITY_BLOCKS):
            assert cache.insert_many([(key(blockno), os.urandom(BLOCK), False)]) == 1
        yield cache, stats
    finally:
        db.close()


def following(directory: Path, blocks: list[int]) -> ActivePlans:
    """The active plans: one, reading whole blocks of FILE in this order, none read yet."""
    plans = ActivePlans(HeldBlocks(budget_of()))
    plan = Plan(1, EntryStore(directory / "plan.entries"), BLOCK)
    plan.add_file(FILE)
    for blockno in blocks:
        plan.add_read(0, blockno * BLOCK, BLOCK)
    plan.mark_complete()
    plan.extend_horizon(len(blocks))
    plans.plans[plan.id] = plan
    return plans


def cached(cache: BlockCache) -> list[int]:
    return [blockno for blockno in range(16) if cache.contains(key(blockno))]


def test_eviction_keeps_the_block_a_plan_needs_soonest(tmp_path: Path) -> None:
    """The victim is the block used furthest ahead, though it is neither the oldest nor the least popular."""
    plans = following(tmp_path, [5, 0, 1, 3, 2])
    with full_cache(tmp_path, plans) as (cache, stats):
        for _ in range(10):
            cache.sketch.record(key(2))
        assert cache.insert_many([(key(5), os.urandom(BLOCK), False)]) == 1
        assert cached(cache) == [0, 1, 3, 5] and stats.evicted_blocks == 1


def test_a_block_no_plan_needs_never_displaces_one_a_plan_needs(tmp_path: Path) -> None:
    plans = following(tmp_path, [0, 1, 2, 3])
    with full_cache(tmp_path, plans) as (cache, stats):
        for _ in range(10):
            cache.sketch.record(key(9))  # popular, but not in the plan
        assert cache.insert_many([(key(9), os.urandom(BLOCK), False)]) == 0
        assert cached(cache) == [0, 1, 2, 3] and stats.rejected_blocks == 1


def test_a_block_the_plan_is_done_with_goes_first(tmp_path: Path) -> None:
    plans = following(tmp_path, [0, 1, 2, 3, 5, 0, 2, 3])
    plan = plans.plans[1]
    for blockno in (0, 1):  # readers used the first two: block 1 is not needed again
        entry = plan.key_of(key(blockno))
        assert entry is not None and plan.observe(entry, reach=100)
    with full_cache(tmp_path, plans) as (cache, _stats):
        assert cache.insert_many([(key(5), os.urandom(BLOCK), False)]) == 1
        assert cached(cache) == [0, 2, 3, 5]


def test_without_a_plan_a_block_seen_once_does_not_displace_more_popular_ones(tmp_path: Path) -> None:
    """TinyLFU: a newcomer takes the oldest block's place only if it was asked for more often
    before the request that fetched it."""
    with full_cache(tmp_path, ActivePlans(HeldBlocks(budget_of()))) as (cache, stats):
        for blockno in range(CAPACITY_BLOCKS):
            cache.sketch.record(key(blockno))
            cache.sketch.record(key(blockno))
        cache.sketch.record(key(8))
        assert cache.insert_many([(key(8), os.urandom(BLOCK), False)]) == 0
        for _ in range(4):
            cache.sketch.record(key(9))
        assert cache.insert_many([(key(9), os.urandom(BLOCK), False)]) == 1
        assert cached(cache) == [1, 2, 3, 9] and stats.rejected_blocks == 1


def test_a_warm_up_is_cached_whatever_the_admission_policy_prefers(tmp_path: Path) -> None:
    plans = following(tmp_path, [0, 1, 2, 3])
    with full_cache(tmp_path, plans) as (cache, _stats):
        assert cache.insert_many([(key(9), os.urandom(BLOCK), True)]) == 1
        assert cache.contains(key(9)) and len(cached(cache)) == CAPACITY_BLOCKS


def test_under_a_plan_blocks_it_does_not_need_compete_by_popularity(tmp_path: Path) -> None:
    plans = following(tmp_path, [0, 1])  # blocks 2 and 3 are cached, but not planned
    with full_cache(tmp_path, plans) as (cache, stats):
        for blockno in (2, 3):
            cache.sketch.record(key(blockno))
            cache.sketch.record(key(blockno))
        cache.sketch.record(key(8))
        assert cache.insert_many([(key(8), os.urandom(BLOCK), False)]) == 0
        assert cached(cache) == [0, 1, 2, 3] and stats.rejected_blocks == 1


def test_the_admission_sketch_of_a_huge_cache_is_bounded() -> None:
    """2 bytes per block x 4 rows, unbounded, would be 1 GB for 100 TiB of 64 KiB blocks."""
    from cachefs.cache.policy import MAX_WIDTH, ROWS, FrequencySketch

    assert len(FrequencySketch(1000).counters) == ROWS * 2048  # two counters per block, as before
    assert len(FrequencySketch((100 << 40) // (64 << 10)).counters) == ROWS * MAX_WIDTH == 64 << 20
