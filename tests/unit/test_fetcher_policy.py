"""The fetcher's policy against a fake hub, in trio's mock clock: single flights, retries until
the fetch timeout, checksums, and demand misses ahead of read-ahead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from fakes import FakeHub
from spoke_parts import BLOCK, budget_of, running_spoke

from cachefs.errors import HubUnavailable, RemoteFileChanged
from cachefs.fetch.fetcher import WRITE_GATHER_S
from cachefs.fetch.verified import MAX_BACKOFF_S

FETCH_TIMEOUT_S = 10.0
FILES = {"a.bin": os.urandom(40 * BLOCK + 123), "b.bin": os.urandom(3 * BLOCK)}


@pytest.mark.trio
async def test_two_readers_of_one_block_share_one_flight(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    hub = FakeHub()
    hub.delay_s = 0.5
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        got: list[bytes] = []

        async def reader() -> None:
            got.append(await spoke.read(spoke.open("b.bin"), BLOCK, BLOCK))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(reader)
        assert got == [spoke.block("b.bin", 1)] * 2
        assert spoke.blocks_asked("b.bin") == [1]


@pytest.mark.trio
async def test_a_block_read_again_asks_the_hub_nothing(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_spoke(tmp_path, FILES, readahead_blocks=0) as spoke:
        first = await spoke.read(spoke.open("b.bin"), 0, BLOCK)
        again = await spoke.read(spoke.open("b.bin"), 0, BLOCK)  # on its way to the cache
        await spoke.written()
        from_cache = await spoke.read(spoke.open("b.bin"), 0, BLOCK)
        assert first == again == from_cache == spoke.block("b.bin", 0)
        assert spoke.blocks_asked("b.bin") == [0]


@pytest.mark.trio
async def test_a_passing_failure_is_retried_and_the_read_gets_the_hubs_bytes(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.fail_next(2)
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        assert await spoke.read(spoke.open("a.bin"), 5 * BLOCK, BLOCK) == spoke.block("a.bin", 5)
        assert spoke.blocks_asked("a.bin") == [5, 5, 5]
        assert spoke.stats.fetch_retries == 2 and spoke.stats.fetch_failures == 0


@pytest.mark.trio
async def test_a_failed_fetch_retries_until_the_fetch_timeout_then_fails(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.fail_always()
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0, fetch_timeout_s=FETCH_TIMEOUT_S) as spoke:
        started = trio.current_time()
        with pytest.raises(HubUnavailable):
            await spoke.read(spoke.open("a.bin"), 0, BLOCK)
        failed_after_s = trio.current_time() - started
        attempts = [request.at_s - started for request in hub.ranges()]
        # Backoff doubles from 0.1 s up to MAX_BACKOFF_S: many attempts, all within the timeout,
        # and it gives up no later than the timeout nor sooner than a last backoff before it.
        assert len(attempts) >= 5 and attempts == sorted(attempts)
        assert attempts[-1] < FETCH_TIMEOUT_S
        assert FETCH_TIMEOUT_S - MAX_BACKOFF_S <= failed_after_s <= FETCH_TIMEOUT_S
        assert spoke.stats.fetch_retries == len(attempts) - 1 and spoke.stats.fetch_failures == 1


@pytest.mark.trio
async def test_a_silent_hub_fails_a_read_at_its_fetch_timeout(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    hub = FakeHub()
    hub.silent = True
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0, fetch_timeout_s=FETCH_TIMEOUT_S) as spoke:
        started = trio.current_time()
        with pytest.raises(HubUnavailable, match="did not deliver"):
            await spoke.read(spoke.open("a.bin"), 0, BLOCK)
        assert trio.current_time() - started == pytest.approx(FETCH_TIMEOUT_S)
        assert len(hub.ranges()) == 1
        assert spoke.stats.hub_errors["timeout"] == 1


@pytest.mark.trio
async def test_a_changed_file_fails_its_read_at_once(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    hub = FakeHub()
    hub.fail_next(1, lambda: RemoteFileChanged("fake hub: a.bin changed (412)"))
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        started = trio.current_time()
        with pytest.raises(RemoteFileChanged):
            await spoke.read(spoke.open("a.bin"), 0, BLOCK)
        assert trio.current_time() == started
        assert len(hub.ranges()) == 1


@pytest.mark.trio
async def test_a_block_that_fails_its_checksum_is_fetched_again_and_never_served(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.corrupt_next(1)
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        assert await spoke.read(spoke.open("a.bin"), 7 * BLOCK, BLOCK) == spoke.block("a.bin", 7)
        assert spoke.blocks_asked("a.bin") == [7, 7]
        assert spoke.stats.integrity_failures == 1


@pytest.mark.trio
async def test_a_demand_miss_is_fetched_before_queued_read_ahead(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """One prefetch connection, busy with read-ahead runs: a demand miss of another file
    still goes out at once and waits one answer, not the queue."""
    hub = FakeHub()
    hub.delay_s = 1.0
    async with running_spoke(tmp_path, FILES, hub=hub, prefetch_connections=1) as spoke:
        stream = spoke.open("a.bin")
        await spoke.read(stream, 0, BLOCK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spoke.read, stream, BLOCK, BLOCK)  # a stream from the start: read-ahead starts
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
            assert await spoke.read(spoke.open("b.bin"), 0, BLOCK) == spoke.block("b.bin", 0)
            assert trio.current_time() - started == pytest.approx(hub.delay_s)
        await trio.sleep(10 * hub.delay_s)  # the read-ahead queued goes out, one run at a time
        read_ahead = [request.at_s for request in hub.ranges() if request.start >= 2 * BLOCK]
        demand = [request.at_s for request in hub.ranges() if request.file_ids != hub.ranges()[0].file_ids]
        assert demand == [started]
        assert len(read_ahead) >= 3 and sum(at_s >= started + hub.delay_s for at_s in read_ahead) >= 2


@pytest.mark.trio
async def test_a_read_ahead_run_hands_each_block_over_as_it_arrives(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.piece_delay_s = 1.0
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        keys = [spoke.key("a.bin", blockno) for blockno in range(4)]
        started = trio.current_time()
        spoke.nursery.start_soon(spoke.fetcher.read_ahead, keys, 0, [BLOCK] * 4)
        await trio.testing.wait_all_tasks_blocked()
        assert await spoke.read(spoke.open("a.bin"), 0, BLOCK) == spoke.block("a.bin", 0)
        assert trio.current_time() - started == pytest.approx(1.0)  # not after the run's fourth block
        await spoke.written()
        assert spoke.blocks_asked("a.bin") == [0, 1, 2, 3]


@pytest.mark.trio
async def test_a_run_receives_no_further_than_the_cache_writer_has_room(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    budget = budget_of(BLOCK, write_queue_bytes=2 * BLOCK)
    async with running_spoke(tmp_path, FILES, hub=hub, budget=budget, readahead_blocks=0, writer=False) as spoke:
        keys = [spoke.key("a.bin", blockno) for blockno in range(8)]
        spoke.nursery.start_soon(spoke.fetcher.read_ahead, keys, 0, [BLOCK] * 8)
        await trio.testing.wait_all_tasks_blocked()
        # Two blocks wait for the writer and a third for its room: the rest stay with the hub.
        assert hub.pieces_sent == 3
        # The metrics' gauges (cachefs_write_queue_bytes, cachefs_write_waiting_fetches,
        # cachefs_held_block_bytes) say where those bytes are.
        assert spoke.fetcher.write_backlog() == (2 * BLOCK, 1)
        assert spoke.held.bytes_by_owner() == {"demand": 0, "read-ahead": 3 * BLOCK, "plan": 0, "warm": 0}
        await spoke.nursery.start(spoke.fetcher.run_writer)
        await spoke.written()
        assert hub.pieces_sent == 8
        assert spoke.fetcher.write_backlog() == (0, 0)
        for blockno in range(8):
            assert await spoke.read(spoke.open("a.bin"), blockno * BLOCK, BLOCK) == spoke.block("a.bin", blockno)
        assert spoke.blocks_asked("a.bin") == list(range(8))


@pytest.mark.trio
async def test_a_run_broken_part_way_asks_again_only_for_the_blocks_it_has_not_had(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.break_next_after(2)
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        keys = [spoke.key("a.bin", blockno) for blockno in range(4)]
        assert await spoke.fetcher.read_ahead(keys, 0, [BLOCK] * 4)
        await spoke.written()
        assert spoke.blocks_asked("a.bin") == [0, 1, 2, 3, 2, 3]
        for blockno in range(4):
            assert await spoke.read(spoke.open("a.bin"), blockno * BLOCK, BLOCK) == spoke.block("a.bin", blockno)
        assert spoke.blocks_asked("a.bin") == [0, 1, 2, 3, 2, 3]
        assert spoke.stats.fetch_retries == 1 and spoke.stats.fetched_bytes == 4 * BLOCK


@pytest.mark.trio
async def test_blocks_arriving_one_at_a_time_are_committed_together(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    hub = FakeHub()
    hub.piece_delay_s = WRITE_GATHER_S / 3  # a link slower than the disk: the writer's queue is empty between blocks
    async with running_spoke(tmp_path, FILES, hub=hub, readahead_blocks=0) as spoke:
        commits: list[int] = []
        insert_many = spoke.cache.insert_many
        spoke.cache.insert_many = lambda blocks, ahead=(): (commits.append(len(blocks)), insert_many(blocks, ahead))[1]
        keys = [spoke.key("a.bin", blockno) for blockno in range(12)]
        assert await spoke.fetcher.read_ahead(keys, 0, [BLOCK] * 12)
        await spoke.written()
        assert sum(commits) == 12 and max(commits) >= 3 and len(commits) <= 4
        for blockno in range(12):
            assert spoke.cache.contains(keys[blockno])
