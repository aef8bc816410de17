"""The one store of block bytes in memory (read/held.py), the memory budget it answers to (config.py),
and missing_runs (fetch/runs.py): policy tests without a hub or a mount."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trio
import trio.testing

from cachefs.cache import BlockKey
from cachefs.config import MountConfig, memory_budget, parse_hub_url
from cachefs.daemon import expire_unread_read_ahead
from cachefs.fetch.runs import missing_runs
from cachefs.read.held import HeldBlocks, Owner

BLOCK = 1 << 20


def default_config(**options: object) -> MountConfig:
    return MountConfig(hub_url=parse_hub_url("http://127.0.0.1:8470"), mountpoint=Path("/mnt/c"),
                       cache_dir=Path("/var/cache/c"), **options)  # type: ignore[arg-type]


def key(blockno: int) -> BlockKey:
    return BlockKey(b"f" * 8, b"v" * 8, blockno)


@dataclasses.dataclass
class Note:
    """What a plan learns of a block held for it."""

    still_wanted: bool = True
    used_count: int = 0
    wasted_count: int = 0

    def wanted(self) -> bool:
        return self.still_wanted

    def used(self) -> None:
        self.used_count += 1

    def wasted(self) -> None:
        self.wasted_count += 1


def test_the_default_memory_budget_adds_up_under_the_daemons_target() -> None:
    budget = memory_budget(default_config())
    assert budget.over_target() is None
    assert budget.total_bytes() <= budget.target_bytes
    # Plan prefetch covers read-ahead's share (the planner counts it), so the larger of the two counts.
    assert budget.total_bytes() == (budget.baseline_bytes + budget.demand_bytes + budget.demand_fetch_bytes
                                    + budget.write_queue_bytes + max(budget.plan_bytes, budget.read_ahead_bytes))


def test_a_block_size_that_breaks_the_memory_target_is_named_in_one_line() -> None:
    warning = memory_budget(default_config(block_size_bytes=16 * BLOCK)).over_target()
    assert warning is not None and "16.0 MiB" in warning and "\n" not in warning


def test_a_block_on_its_way_to_the_cache_is_held_whatever_its_owners_share() -> None:
    """A warm-up holds nothing once written, but its readers find the bytes until then."""
    held = HeldBlocks(memory_budget(default_config()))
    held.arrived(key(0), b"x" * BLOCK, Owner.WARM, now=0)
    assert held.get(key(0)) is not None and held.bytes_of(Owner.WARM) == BLOCK
    held.settled(key(0), now=1, cached=True, claimed=False, discarded=False)
    assert held.get(key(0)) is None and held.bytes_of(Owner.WARM) == 0


def test_blocks_readers_used_are_bounded_in_count_and_in_bytes() -> None:
    budget = dataclasses.replace(memory_budget(default_config()), demand_blocks=3, demand_bytes=2 * BLOCK)
    held = HeldBlocks(budget)
    for blockno in range(4):  # small files: the count bounds them
        held.remember(key(blockno), b"s" * 1000, now=blockno)
    assert [held.get(key(blockno)) is not None for blockno in range(4)] == [False, True, True, True]
    held.use(key(1), now=5)  # most recently used now
    for blockno in (10, 11):  # whole blocks: the bytes bound them
        held.remember(key(blockno), b"b" * BLOCK, now=blockno)
    assert [held.get(key(blockno)) is not None for blockno in (1, 2, 3, 10, 11)] == [False, False, False, True, True]


def test_a_reader_taking_a_plans_block_counts_it_used_and_a_passed_one_wasted() -> None:
    held = HeldBlocks(memory_budget(default_config()))
    taken, passed = Note(), Note()
    held.arrived(key(0), b"a" * BLOCK, Owner.PLAN, now=0, note=taken)
    held.arrived(key(1), b"b" * BLOCK, Owner.PLAN, now=0, note=passed)
    assert held.use(key(0), now=1) is not None  # a reader joined its flight
    passed.still_wanted = False  # the plan moved past its use while it was written
    for blockno in (0, 1):
        held.settled(key(blockno), now=2, cached=True, claimed=False, discarded=False)
    assert (taken.used_count, taken.wasted_count, passed.used_count, passed.wasted_count) == (1, 0, 0, 1)
    assert held.bytes_of(Owner.PLAN) == 0 and held.bytes_of(Owner.DEMAND) == BLOCK


def test_an_evict_drops_held_blocks_but_not_those_on_their_way_to_the_cache() -> None:
    held = HeldBlocks(memory_budget(default_config()))
    held.remember(key(0), b"a" * BLOCK, now=0)
    held.arrived(key(1), b"b" * BLOCK, Owner.READ_AHEAD, now=0)
    held.discard(lambda _key: True)
    assert held.get(key(0)) is None and held.get(key(1)) is not None  # its flight's readers still need it
    held.settled(key(1), now=1, cached=True, claimed=True, discarded=True)  # the fetcher marked it
    assert held.get(key(1)) is None


def test_a_file_the_kernel_reads_directly_drops_its_read_ahead_blocks_but_not_others() -> None:
    held = HeldBlocks(memory_budget(default_config()))
    other_file = BlockKey(b"g" * 8, b"v" * 8, 0)
    other_version = BlockKey(b"f" * 8, b"w" * 8, 0)
    for ahead in (key(0), key(1), key(2), other_file, other_version):
        held.arrived(ahead, b"r" * BLOCK, Owner.READ_AHEAD, now=0)
    for written in (key(0), key(1), other_file, other_version):
        held.settled(written, now=1, cached=True, claimed=True, discarded=False)
    held.remember(key(3), b"d" * BLOCK, now=1)
    assert held.drop_read_ahead(b"f" * 8, b"v" * 8) == [key(0), key(1)]
    assert held.get(key(0)) is None and held.get(key(1)) is None
    # One still on its way to the cache, another file's or version's, and a reader's stay.
    assert all(held.get(kept) is not None for kept in (key(2), other_file, other_version, key(3)))
    assert held.bytes_of(Owner.READ_AHEAD) == 3 * BLOCK


def test_missing_runs_checks_each_block_only_when_its_stretch_comes() -> None:
    present = {2, 5}
    checked: list[int] = []

    def missing(blockno: int) -> bool:
        checked.append(blockno)
        return blockno not in present

    runs = missing_runs(range(8), missing, max_blocks=2)
    assert next(runs) == [0, 1] and checked == [0, 1]
    present.add(3)  # fetched meanwhile
    assert list(runs) == [[4], [6, 7]]
    assert checked == list(range(8))


def test_missing_runs_without_a_bound_is_one_stretch_per_gap() -> None:
    assert list(missing_runs(range(5), lambda _blockno: True)) == [[0, 1, 2, 3, 4]]
    assert list(missing_runs(range(5), lambda blockno: blockno % 2 == 0)) == [[0], [2], [4]]
    assert list(missing_runs([], lambda _blockno: True)) == []


def test_read_ahead_blocks_left_unread_leave_memory_at_their_age_limit_with_no_read_ahead_after_them() -> None:
    """New read-ahead blocks push out old ones; with read-ahead gone quiet (a loader's plan
    covers its files), the daemon's periodic look drops them at their age limit all the same."""
    held = HeldBlocks(budget := memory_budget(default_config()))
    for blockno in range(3):
        held.arrived(key(blockno), b"r" * BLOCK, Owner.READ_AHEAD, now=0)
    for blockno in range(2):
        held.settled(key(blockno), now=1, cached=True, claimed=True, discarded=False)
    held.remember(key(9), b"d" * BLOCK, now=1)

    async def daemon_for(seconds: float) -> None:
        with trio.move_on_after(seconds):
            await expire_unread_read_ahead(held)

    trio.run(daemon_for, budget.read_ahead_max_age_s - 5, clock=trio.testing.MockClock(autojump_threshold=0))
    assert held.bytes_of(Owner.READ_AHEAD) == 3 * BLOCK  # young yet
    trio.run(daemon_for, budget.read_ahead_max_age_s + 10, clock=trio.testing.MockClock(autojump_threshold=0))
    assert held.get(key(0)) is None and held.get(key(1)) is None
    assert held.get(key(2)) is not None and held.get(key(9)) is not None  # on its way to the cache; a reader's
