"""Read-ahead's policies against a fake hub, in trio's mock clock: the window, the next file,
small files after an opened one, and staying off files a plan covers."""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import trio
from fakes import FakeHub
from spoke_parts import BLOCK, KiB, NoPlans, Spoke, running_spoke

from cachefs import config
from cachefs.config import COALESCE_BLOCKS
from cachefs.namespace.tree import Inode
from cachefs.prefetch import siblings
from cachefs.read import blocks
from cachefs.read.handles import OpenFile

ANSWER_S = 0.01  # the fake hub's delay: every request takes a little time, as on a link


async def read_blocks(spoke: Spoke, handle: OpenFile, blocks: list[int]) -> list[int]:
    """Read whole blocks through `handle` one after the other; after each, how far beyond it the hub was asked."""
    path = next(name for name in spoke.files if spoke.inode(name) == handle.inode)
    reach = []
    for blockno in blocks:
        assert await spoke.read(handle, blockno * BLOCK, BLOCK) == spoke.block(path, blockno)
        await trio.sleep(1)  # read-ahead's runs go out
        reach.append(max(spoke.blocks_asked(path)) - blockno)
    return reach


@pytest.mark.trio
async def test_read_ahead_window_doubles_while_reads_are_sequential_and_resets_on_a_seek(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_spoke(tmp_path, {"a.bin": os.urandom(300 * BLOCK)}, readahead_blocks=32) as spoke:
        spoke.hub.delay_s = ANSWER_S
        # Three reads in a row make a stream (from mid-file); then the window doubles to its limit
        # (and stays there: asked in whole runs, it reaches up to a run short of it between asks).
        handle = spoke.open("a.bin")
        reach = await read_blocks(spoke, handle, list(range(10, 24)))
        assert reach[:6] == [0, 0, 4, 8, 16, 32]
        assert max(reach[6:]) == 32 and min(reach[6:]) > 32 - COALESCE_BLOCKS
        # A seek starts over: no read-ahead until it is a stream again, then the smallest window.
        assert await read_blocks(spoke, handle, list(range(200, 205))) == [0, 0, 4, 8, 16]


@pytest.mark.trio
async def test_a_stream_from_the_first_byte_starts_sooner_with_a_larger_window(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_spoke(tmp_path, {"a.bin": os.urandom(100 * BLOCK)}, readahead_blocks=64) as spoke:
        assert await read_blocks(spoke, spoke.open("a.bin"), [0, 1, 2]) == [0, 16, 32]


@pytest.mark.trio
async def test_a_sequential_reader_gets_every_block_from_read_ahead_asked_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(50 * BLOCK + 5 * KiB)
    async with running_spoke(tmp_path, {"a.bin": data}, readahead_blocks=16) as spoke:
        spoke.hub.delay_s = ANSWER_S
        handle = spoke.open("a.bin")
        got = b"".join([await spoke.read(handle, offset, 128 * KiB) for offset in range(0, len(data), 128 * KiB)])
        assert got == data
        asked = spoke.blocks_asked("a.bin")
        assert sorted(asked) == list(range(51))  # each block once: no reader fetched one read ahead
        assert spoke.hub.bytes_sent == len(data)
        # Only the stream's first two reads (before it was one) missed; read-ahead served the rest.
        assert spoke.stats.block_misses == 4 and spoke.stats.readahead_used == len(asked) - 4


@pytest.mark.trio
async def test_random_reads_of_a_file_larger_than_the_free_cache_start_no_read_ahead(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_spoke(tmp_path, {"a.bin": os.urandom(100 * BLOCK)}, cache_bytes=8 * BLOCK) as spoke:
        blocks = [37, 5, 80, 81, 12, 60, 61, 62, 3, 90]  # some adjacent pairs and a triple among them
        handle = spoke.open("a.bin")
        for blockno in blocks:
            await spoke.read(handle, blockno * BLOCK + 100, 4 * KiB)
        await trio.sleep(5)
        assert spoke.blocks_asked("a.bin") == blocks


@pytest.mark.trio
async def test_read_ahead_runs_on_into_the_head_of_the_next_large_file(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    files = {"shards/0.bin": os.urandom(20 * BLOCK), "shards/1.bin": os.urandom(20 * BLOCK)}
    async with running_spoke(tmp_path, files, readahead_blocks=8) as spoke:
        await read_blocks(spoke, spoke.open("shards/0.bin"), list(range(20)))
        assert spoke.blocks_asked("shards/1.bin")[:4] == [0, 1, 2, 3]  # before anyone opened it
        head = await spoke.read(spoke.open("shards/1.bin"), 0, BLOCK)
        assert head == spoke.block("shards/1.bin", 0) and spoke.blocks_asked("shards/1.bin").count(0) == 1


@pytest.mark.trio
async def test_opening_a_small_file_prefetches_the_files_after_it_in_one_batch(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    files = {f"images/{index:03d}.jpg": os.urandom(3 * KiB + index) for index in range(20)}
    async with running_spoke(tmp_path, files, sibling_prefetch_files=8) as spoke:
        first = spoke.open("images/000.jpg")
        assert await spoke.read(first, 0, 64 * KiB) == files["images/000.jpg"]
        await trio.sleep(1)
        batches = [request for request in spoke.hub.requests if request.kind == "batch"]
        assert len(batches) == 1 and batches[0].file_ids == tuple(
            spoke.key(f"images/{index:03d}.jpg", 0).file_id.hex() for index in range(1, 9))
        before = len(spoke.hub.requests)
        for index in range(1, 9):
            path = f"images/{index:03d}.jpg"
            assert await spoke.read(spoke.open(path), 0, 64 * KiB) == files[path]
        assert not [request for request in spoke.hub.requests[before:]
                    if set(request.file_ids) & {spoke.key(f"images/{i:03d}.jpg", 0).file_id.hex() for i in range(1, 9)}]


@pytest.mark.trio
async def test_cached_small_files_are_paged_in_on_the_trio_thread_while_that_is_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open pages in the cached files after it on the trio thread; once page-ins take
    1 ms a file (a slow disk) they go to a worker thread, and back when they are fast.
    Page-ins are timed on a clock of the test's own, which only they advance: on a busy
    machine a preempted thread would make a fast page-in look slow."""
    monkeypatch.setattr(siblings, "PAGE_IN_INTERVAL_S", 0.0)  # every open pages its followers in again
    elapsed = [0.0]
    monkeypatch.setattr(blocks, "time", types.SimpleNamespace(perf_counter=lambda: elapsed[0]))
    files = {f"images/{index:03d}.jpg": os.urandom(3 * KiB + index) for index in range(20)}
    async with running_spoke(tmp_path, files, sibling_prefetch_files=8) as spoke:
        assert await spoke.read(spoke.open("images/000.jpg"), 0, 64 * KiB) == files["images/000.jpg"]
        with trio.fail_after(10):
            while not all(spoke.cache.contains(spoke.key(f"images/{index:03d}.jpg", 0)) for index in range(1, 9)):
                await spoke.written()
        on_trio_thread: list[bool] = []
        per_file_s = 0.001
        paged_in = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def page_in_files(paged: list[tuple[bytes, bytes, int]]) -> None:
            assert len(paged) == 8
            elapsed[0] += per_file_s * len(paged)
            on_trio_thread.append(threading.current_thread() is threading.main_thread())

        timed = blocks.SmallDiskReads.timed

        def timed_then_signal(reads: blocks.SmallDiskReads, read: Any, items: int = 1) -> Any:
            """The next open waits until this page-in's time is counted (a worker thread's may come late)."""
            paged = len(on_trio_thread)
            try:
                return timed(reads, read, items)
            finally:
                if len(on_trio_thread) > paged:
                    token.run_sync_soon(paged_in.set)

        spoke.cache.page_in_files = page_in_files  # type: ignore[method-assign]
        monkeypatch.setattr(blocks.SmallDiskReads, "timed", timed_then_signal)
        for opens in range(1, 17):
            if opens == 4:
                per_file_s = 0.0
            paged_in = trio.Event()
            spoke.open("images/000.jpg")
            with trio.fail_after(10):
                await paged_in.wait()
            assert len(on_trio_thread) == opens
        # Two slow page-ins (1 ms a file) make the recent time too long; fast ones in a
        # worker thread bring it back under the limit (an average over about 8 page-ins).
        assert on_trio_thread == [True, True, False, False, False, False, False] + [True] * 9


@pytest.mark.trio
async def test_a_walk_asks_the_index_only_about_files_not_paged_in_lately(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files a walk paged in within PAGE_IN_INTERVAL_S were cached then: the next walks
    over them (a reader's walks overlap by half) neither look them up nor page them in."""
    files = {f"images/{index:03d}.jpg": os.urandom(3 * KiB + index) for index in range(20)}
    async with running_spoke(tmp_path, files, sibling_prefetch_files=8) as spoke:
        assert await spoke.read(spoke.open("images/000.jpg"), 0, 64 * KiB) == files["images/000.jpg"]
        followers = [spoke.key(f"images/{index:03d}.jpg", 0) for index in range(1, 9)]
        with trio.fail_after(10):
            while not all(spoke.cache.contains(key) for key in followers):
                await spoke.written()
        asked: list[list[Any]] = []
        paged: list[list[Any]] = []
        contains_each = spoke.cache.contains_each
        spoke.cache.contains_each = lambda keys: asked.append(list(keys)) or contains_each(keys)  # type: ignore[method-assign]
        spoke.cache.page_in_files = lambda batch: paged.append(batch)  # type: ignore[method-assign]
        walks_before = len(asked)
        spoke.open("images/000.jpg")  # the opener itself is never a walk's follower: each open walks
        assert asked[walks_before:] == [followers] and len(paged) == 1 and len(paged[0]) == 8
        spoke.open("images/000.jpg")
        assert asked[-1] == [] and len(paged) == 1
        monkeypatch.setattr(siblings, "PAGE_IN_INTERVAL_S", 0.0)  # the interval is over
        spoke.open("images/000.jpg")
        assert asked[-1] == followers and len(paged) == 2


@pytest.mark.trio
async def test_a_walk_inside_the_last_one_reads_only_the_files_after_it_from_the_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's walks overlap by half: the next one goes on from the last one's
    followers, unless that walk is older than WALK_REUSE_S."""
    files = {f"images/{index:03d}.jpg": os.urandom(3 * KiB + index) for index in range(30)}
    async with running_spoke(tmp_path, files, sibling_prefetch_files=8) as spoke:
        read: list[tuple[str, int, list[str]]] = []
        files_after = spoke.namespace.files_after
        names = {spoke.inode(path).ino: path for path in files}

        def spied(inode: Inode, count: int) -> list[Inode]:
            found = files_after(inode, count)
            read.append((names[inode.ino], count, [names[follower.ino] for follower in found]))
            return found

        monkeypatch.setattr(spoke.namespace, "files_after", spied)
        spoke.open("images/000.jpg")  # walks 001-008
        spoke.open("images/005.jpg")  # past the middle of that walk: walks 006-013
        assert read == [("images/000.jpg", 8, [f"images/{index:03d}.jpg" for index in range(1, 9)]),
                        ("images/008.jpg", 5, [f"images/{index:03d}.jpg" for index in range(9, 14)])]
        await trio.sleep(1)
        batches = [request.file_ids for request in spoke.hub.requests if request.kind == "batch"]
        assert sorted(len(batch) for batch in batches) == [5, 8]  # 006-008 were asked for already
        monkeypatch.setattr(siblings, "WALK_REUSE_S", 0.0)  # the last walk is too old now
        spoke.open("images/010.jpg")
        assert read[-1] == ("images/010.jpg", 8, [f"images/{index:03d}.jpg" for index in range(11, 19)])


class CoversEverything(NoPlans):
    def covers(self, inode: Inode) -> bool:
        return True


@pytest.mark.trio
async def test_read_ahead_stays_off_a_file_a_plan_covers(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    async with running_spoke(tmp_path, {"a.bin": os.urandom(40 * BLOCK)}, coverage=CoversEverything()) as spoke:
        assert await read_blocks(spoke, spoke.open("a.bin"), list(range(10))) == [0] * 10


@pytest.mark.trio
async def test_a_hub_without_batches_gets_the_small_files_one_by_one_within_the_prefetch_slots(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    files = {f"images/{index:03d}.jpg": os.urandom(3 * KiB + index) for index in range(20)}
    hub = FakeHub()
    hub.batches = False
    hub.delay_s = 1.0
    async with running_spoke(tmp_path, files, hub=hub, sibling_prefetch_files=8, prefetch_connections=2) as spoke:
        started = trio.current_time()
        assert await spoke.read(spoke.open("images/000.jpg"), 0, 64 * KiB) == files["images/000.jpg"]
        await trio.sleep(10)
        siblings = [request for request in hub.ranges() if request.file_ids[0] != spoke.key("images/000.jpg", 0).file_id.hex()]
        assert sorted(request.file_ids[0] for request in siblings) == sorted(
            spoke.key(f"images/{index:03d}.jpg", 0).file_id.hex() for index in range(1, 9))
        # Two at a time (the prefetch slots), one answer's delay apart, after the batch was refused.
        waves = sorted({request.at_s - started for request in siblings})
        assert waves == [0.0, 1.0, 2.0, 3.0] and all(
            sum(request.at_s - started == wave for request in siblings) == 2 for wave in waves)


@pytest.mark.trio
async def test_a_file_read_at_random_is_filled_whole_when_it_fits_the_free_cache(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_spoke(tmp_path, {"a.bin": os.urandom(40 * BLOCK)}) as spoke:
        handle = spoke.open("a.bin")
        for blockno in (31, 7, 22, 15, 3):
            await spoke.read(handle, blockno * BLOCK + 100, 4 * KiB)
        await trio.sleep(10)
        await spoke.written()
        assert sorted(set(spoke.blocks_asked("a.bin"))) == list(range(40))
        assert spoke.filled == [spoke.inode("a.bin")]  # told once, for passthrough to verify it
        before = len(spoke.hub.requests)
        for blockno in (9, 38, 0, 27):
            assert await spoke.read(handle, blockno * BLOCK + 100, 4 * KiB) == spoke.files["a.bin"][
                blockno * BLOCK + 100 : blockno * BLOCK + 100 + 4 * KiB]
        assert len(spoke.hub.requests) == before


@pytest.mark.trio
@pytest.mark.parametrize("block_size", [16 * KiB, 64 * KiB])
async def test_a_fill_keeps_the_same_bytes_in_flight_whatever_the_block_size(
    block_size: int, tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of RUN_BYTES (here 256 KiB), FILL_RUNS_IN_FLIGHT of them at once: blocks sized to small
    samples fetch as many bytes per round trip as large ones."""
    monkeypatch.setattr(config, "RUN_BYTES", 256 * KiB)
    hub = FakeHub()
    hub.delay_s = 1.0
    data = os.urandom(40 * BLOCK)
    async with running_spoke(tmp_path, {"a.bin": data}, hub=hub, block_size=block_size,
                             prefetch_connections=24) as spoke:
        handle = spoke.open("a.bin")
        started = trio.current_time()
        for offset in (31 * BLOCK, 7 * BLOCK, 22 * BLOCK, 15 * BLOCK):
            assert await spoke.read(handle, offset + 100, 4 * KiB) == data[offset + 100:offset + 100 + 4 * KiB]
        await trio.sleep(20)
        fills = [request for request in hub.ranges() if len(request.lengths) > 1]
        waves = sorted({request.at_s - started for request in fills})
        assert max(sum(request.lengths) for request in fills) == 256 * KiB
        assert sum(request.at_s - started == waves[0] for request in fills) == 8


@pytest.mark.trio
async def test_read_ahead_a_closed_handle_queued_is_asked_for_again_by_the_next_handle(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """A loader opens a file, reads its head, closes it and opens it again while read-ahead's
    slots are busy: the run queued for the first handle fetches nothing once it is closed,
    so the second handle's read-ahead asks for those blocks itself."""
    async with running_spoke(tmp_path, {"a.bin": os.urandom(64 * BLOCK)}, prefetch_connections=1) as spoke:
        slot_busy, free_slot = trio.Event(), trio.Event()

        async def hold_the_prefetch_slot() -> None:
            async with spoke.fetcher.prefetch_slot(writer_backlog_below=1 << 20):
                slot_busy.set()
                await free_slot.wait()

        spoke.nursery.start_soon(hold_the_prefetch_slot)
        await slot_busy.wait()
        first = spoke.open("a.bin")
        for blockno in (0, 1):  # a stream from the first byte: read-ahead queues a run
            assert await spoke.read(first, blockno * BLOCK, BLOCK) == spoke.block("a.bin", blockno)
        first.closed = True  # as the FUSE release does
        second = spoke.open("a.bin")
        for blockno in (0, 1):
            assert await spoke.read(second, blockno * BLOCK, BLOCK) == spoke.block("a.bin", blockno)
        free_slot.set()
        await trio.sleep(5)
        assert max(spoke.blocks_asked("a.bin")) > 8, spoke.blocks_asked("a.bin")
