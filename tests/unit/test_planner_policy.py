"""Plan prefetch against a fake hub, in trio's mock clock: what a loader's plan has fetched, how
far ahead, and what happens to it when the plan ends."""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from spoke_parts import BLOCK, KiB, Spoke, budget_of, running_spoke

from cachefs.config import PREFETCH_INFLIGHT_BYTES, MountConfig, parse_hub_url, prefetch_connections
from cachefs.control.server import Lines
from cachefs.training.link import LinkEstimate

PATH = "data/a.bin"
PLAN_BLOCKS = 8  # the plan's share of the memory budget, in blocks


@contextlib.asynccontextmanager
async def following_plan(spoke: Spoke, order: list[int], result: dict[str, Any]) -> AsyncIterator[None]:
    """A loader's plan to read whole blocks of PATH in `order`, sent over a control connection
    that the block's end closes; the planner's answer lands in `result`."""
    send, receive = trio.testing.memory_stream_one_way_pair()
    text = "".join(json.dumps(line) + "\n" for line in (
        {"files": [PATH]}, {"reads": [[0, blockno * BLOCK, BLOCK] for blockno in order]}, {"end": True}))
    lines = Lines(receive, text.encode())  # type: ignore[arg-type]  # a stream like the socket's

    async def progress(message: dict[str, Any]) -> None:
        pass

    async def client() -> None:
        assert spoke.planner is not None
        result.update(await spoke.planner.handle_plan({"epoch": 0}, progress, lines))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        await trio.sleep(1)  # accepted and prefetching
        yield
        await send.aclose()


def shuffled_blocks(count: int) -> list[int]:
    order = list(range(count))
    random.Random(7).shuffle(order)
    return order


@pytest.mark.trio
async def test_a_plan_prefetches_its_next_blocks_no_further_than_its_budget(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    order = shuffled_blocks(100)
    budget = budget_of(plan_bytes=PLAN_BLOCKS * BLOCK)
    async with running_spoke(tmp_path, {PATH: os.urandom(100 * BLOCK)}, planner=True, budget=budget,
                             readahead_blocks=0) as spoke:
        spoke.hub.delay_s = 0.01
        async with following_plan(spoke, order, {}):
            await trio.sleep(10)  # nobody reads: the prefetch stops at the budget
            assert sorted(spoke.blocks_asked(PATH)) == sorted(order[:PLAN_BLOCKS])
            handle = spoke.open(PATH)
            for blockno in order[:4]:
                assert await spoke.read(handle, blockno * BLOCK, BLOCK) == spoke.block(PATH, blockno)
            await trio.sleep(10)
            # The reads found their blocks held, and as many blocks further were fetched in their place.
            assert sorted(spoke.blocks_asked(PATH)) == sorted(order[: PLAN_BLOCKS + 4])
            assert spoke.stats.plan_prefetch_used_blocks == 4 and spoke.stats.block_misses == 0


@pytest.mark.trio
async def test_a_plan_that_ends_stops_its_prefetch_and_counts_what_it_held_wasted(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    order = shuffled_blocks(100)
    budget = budget_of(plan_bytes=PLAN_BLOCKS * BLOCK)
    result: dict[str, Any] = {}
    async with running_spoke(tmp_path, {PATH: os.urandom(100 * BLOCK)}, planner=True, budget=budget,
                             readahead_blocks=0) as spoke:
        async with following_plan(spoke, order, result):
            handle = spoke.open(PATH)
            for blockno in order[:2]:
                await spoke.read(handle, blockno * BLOCK, BLOCK)
            await trio.sleep(10)
            await spoke.written()  # held for the plan now, no longer on their way to the cache
        asked = len(spoke.blocks_asked(PATH))
        assert result["state"] == "cancelled" and result["prefetched_blocks"] == asked == PLAN_BLOCKS + 2
        assert result["prefetch_used_blocks"] == 2 and spoke.stats.plan_prefetch_wasted_blocks == PLAN_BLOCKS
        for blockno in order[20:24]:  # what the plan would have read next: fetched on demand, nothing more
            await spoke.read(handle, blockno * BLOCK, BLOCK)
        await trio.sleep(10)
        assert spoke.blocks_asked(PATH)[asked:] == order[20:24]


@pytest.mark.trio
async def test_a_plan_read_to_its_end_finishes_by_itself(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    order = shuffled_blocks(30)
    result: dict[str, Any] = {}
    async with running_spoke(tmp_path, {PATH: os.urandom(30 * BLOCK)}, planner=True, readahead_blocks=0) as spoke:
        async with following_plan(spoke, order, result):
            handle = spoke.open(PATH)
            for blockno in order:
                assert await spoke.read(handle, blockno * BLOCK, BLOCK) == spoke.block(PATH, blockno)
            await trio.sleep(1)
            assert result["state"] == "finished"
        assert sorted(spoke.blocks_asked(PATH)) == list(range(30))  # each block asked once
        assert result["prefetch_used_blocks"] == 30 - spoke.stats.block_misses


@pytest.mark.trio
async def test_blocks_written_after_their_plan_ended_are_counted_wasted(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    order = shuffled_blocks(100)
    budget = budget_of(plan_bytes=PLAN_BLOCKS * BLOCK)
    async with running_spoke(tmp_path, {PATH: os.urandom(100 * BLOCK)}, planner=True, budget=budget,
                             readahead_blocks=0, writer=False) as spoke:
        async with following_plan(spoke, order, {}):
            await trio.sleep(10)  # prefetched, on their way to the cache
        await spoke.nursery.start(spoke.fetcher.run_writer)
        await spoke.written()
        await trio.sleep(1)
        assert spoke.stats.plan_prefetch_wasted_blocks == PLAN_BLOCKS


@pytest.mark.parametrize("block_size", [256 * KiB, 1024 * KiB])
def test_plan_prefetch_keeps_the_same_bytes_in_flight_whatever_the_block_size(block_size: int) -> None:
    """Random samples are rarely adjacent (a request per block): a mount with blocks 4x smaller
    has 4x the prefetch slots, so the link carries as many bytes for the plan, before and after
    it is measured (1 Gbit/s at 60 ms)."""
    config = MountConfig(hub_url=parse_hub_url("http://127.0.0.1:8470"), mountpoint=Path("/mnt/c"),
                         cache_dir=Path("/var/cache/c"), block_size_bytes=block_size)
    link = LinkEstimate(block_size, prefetch_connections(config))
    assert link.concurrency_blocks * block_size == PREFETCH_INFLIGHT_BYTES
    link.fetched(1.0, 0.06, 1)
    link.delivered(1.0, 125e6)
    assert link.concurrency_blocks * block_size >= PREFETCH_INFLIGHT_BYTES


@pytest.mark.trio
async def test_a_plan_s_first_window_fills_the_link_at_once(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """The blocks in flight the link estimate asks for are asked for as soon as the plan
    arrives, not over the next ticks: runs already started are counted once."""
    order = shuffled_blocks(100)  # a request per block: no two adjacent
    async with running_spoke(tmp_path, {PATH: os.urandom(100 * BLOCK)}, planner=True,
                             budget=budget_of(plan_bytes=100 * BLOCK), readahead_blocks=0,
                             prefetch_connections=8) as spoke:
        assert spoke.planner is not None
        spoke.hub.silent = True  # nothing in flight ever ends
        send, receive = trio.testing.memory_stream_one_way_pair()
        text = "".join(json.dumps(line) + "\n" for line in (
            {"files": [PATH]}, {"reads": [[0, blockno * BLOCK, BLOCK] for blockno in order]}, {"end": True}))

        async def progress(message: dict[str, Any]) -> None:
            pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spoke.planner.handle_plan, {"epoch": 0}, progress, Lines(receive, text.encode()))  # type: ignore[arg-type]
            # Polled: the plan is stored by worker threads, which wait_all_tasks_blocked takes for blocked.
            while not spoke.hub.requests:  # noqa: ASYNC110 (until the planner's first requests)
                await trio.sleep(0.01)
            await trio.sleep(0.01)  # far less than a tick: the same _issue
            assert sorted(spoke.blocks_asked(PATH)) == sorted(order[: spoke.planner.link.concurrency_blocks])
            await send.aclose()
