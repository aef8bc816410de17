"""The fetcher's flights on unusual paths, against a real hub: a fetch cancelled while it waits
for the cache writer's room, an evict that meets a fetch which then fails, a read that joins
a fetch late, small files asked for one by one."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from cache_helpers import block_cache
from fault_proxy import running_fault_proxy
from hub_helpers import HubProcess, fetch_manifest, running_hub, scrape_metrics

from cachefs.cache import BlockCache, BlockKey
from cachefs.config import MemoryBudget, parse_hub_url
from cachefs.fetch.fetcher import Fetcher, Flight
from cachefs.fetch.hub_client import HubClient
from cachefs.metrics import Stats
from cachefs.read.blocks import BlockSource
from cachefs.read.claims import CLAIM_MAX_AGE_S, ReadAheadClaims
from cachefs.read.held import HeldBlocks, Owner

BLOCK = 1 << 20


def budget_of(read_ahead_held_bytes: int = 16 * BLOCK, stale_s: float = 5.0) -> MemoryBudget:
    """The memory budget of a mount of 1 MiB blocks, with read-ahead's held share as given."""
    return MemoryBudget(
        block_size_bytes=BLOCK, demand_blocks=8, demand_bytes=8 * BLOCK, demand_fetch_bytes=32 * BLOCK,
        write_queue_bytes=16 * BLOCK, read_ahead_runs_bytes=64 * BLOCK, read_ahead_held_bytes=read_ahead_held_bytes,
        read_ahead_max_age_s=30, read_ahead_stale_s=stale_s, plan_bytes=96 * BLOCK,
    )


BUDGET = budget_of()
WRITE_QUEUE_BYTES = BUDGET.write_queue_bytes
BLOCKS = WRITE_QUEUE_BYTES // BLOCK + 8  # more than the writer's room holds


@pytest.fixture(scope="module")
def big_file_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    root = tmp_path_factory.mktemp("hub-data")
    (root / "big.bin").write_bytes(os.urandom(BLOCKS * BLOCK))
    with running_hub(root) as hub:
        entry = fetch_manifest(hub).files()["big.bin"]
        yield hub.url, {**entry, "path": root / "big.bin", "hub": hub}


def fetcher_for(url: str, cache: BlockCache, fetch_timeout_s: float = 10, stats: Stats | None = None,
                max_connections: int = 8, prefetch_connections: int = 4) -> Fetcher:
    client = HubClient(parse_hub_url(url), max_connections=max_connections, connect_timeout_s=5, read_timeout_s=5)
    return Fetcher(
        client, cache, HeldBlocks(BUDGET), ReadAheadClaims(), stats or Stats(), budget=BUDGET,
        fetch_timeout_s=fetch_timeout_s, prefetch_connections=prefetch_connections,
    )


def held_for_first_read(held: HeldBlocks, key: BlockKey, data: bytes, now: float, cached: bool) -> None:
    """A block read-ahead fetched, written (`cached`: and admitted) and not read yet, as the fetcher holds it."""
    held.arrived(key, data, Owner.READ_AHEAD, now)
    held.settled(key, now, cached=cached, claimed=True, discarded=False)


@contextlib.contextmanager
def hub_paused(hub: HubProcess) -> Iterator[None]:
    """The hub process stopped (SIGSTOP): the kernel still accepts connections and takes
    requests, but nothing is answered until the block ends (SIGCONT, also on failure)."""
    hub.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        hub.proc.send_signal(signal.SIGCONT)


async def handed_over(fetcher: Fetcher, keys: list[BlockKey], count: int) -> None:
    """Until at least `count` of the keys' blocks have reached their readers (bounded; the
    cache writer stopped, so every flight is still there)."""
    arrived = 0

    async def wait(flight: Flight | None, done: trio.CancelScope) -> None:
        nonlocal arrived
        assert flight is not None
        await flight.done.wait()
        arrived += 1
        if arrived >= count:
            done.cancel()

    await trio.testing.wait_all_tasks_blocked()  # the runs just started have their flights
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(wait, fetcher.flight(key), nursery.cancel_scope)


def block_keys(entry: dict, count: int) -> list[BlockKey]:
    return [BlockKey(bytes.fromhex(entry["i"]), bytes.fromhex(entry["v"]), blockno) for blockno in range(count)]


@pytest.mark.trio
async def test_a_prefetch_cancelled_waiting_for_the_writer_leaves_no_flight(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """Its blocks beyond the writer's room are neither cached nor left "in flight" forever
    (read-ahead would skip them and a warm-up would count them cached)."""
    url, entry = big_file_hub
    keys = block_keys(entry, BLOCKS)
    with block_cache(tmp_path, 4 * BLOCKS * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)  # no writer runs: its room fills and stays full
        with trio.move_on_after(5) as scope:
            await fetcher.read_ahead(keys, 0, [BLOCK] * BLOCKS)
        assert scope.cancelled_caught  # it waited for room
        queued = WRITE_QUEUE_BYTES // BLOCK
        assert all(fetcher.flight(key) is not None for key in keys[:queued])  # on their way to the writer
        assert [key.blockno for key in keys[queued:] if fetcher.flight(key) is not None] == []


@pytest.mark.trio
async def test_the_writer_backlog_counts_the_fetches_waiting_for_its_room(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """Read-ahead waits to start runs while the cache writer is behind (`writer_backlog_below`):
    with the writer stopped, 4 runs of 4 blocks fill its room and 2 more wait, each with the
    one block it received (no run receives further than the writer's room); once it runs,
    none does."""
    url, entry = big_file_hub
    keys = block_keys(entry, 24)
    with block_cache(tmp_path, 4 * BLOCKS * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)
        async with trio.open_nursery() as nursery:
            for first in range(0, 16, 4):
                nursery.start_soon(fetcher.read_ahead, keys[first : first + 4], first * BLOCK, [BLOCK] * 4)
            await handed_over(fetcher, keys[:16], 16)  # the writer's room, exactly
            for first in (16, 20):
                nursery.start_soon(fetcher.read_ahead, keys[first : first + 4], first * BLOCK, [BLOCK] * 4)
            await handed_over(fetcher, keys[16:], 2)  # one block of each waiting run
            with trio.fail_after(10):
                await fetcher.writer_backlog_below(3)
            with trio.move_on_after(0.3) as waited:
                await fetcher.writer_backlog_below(2)
            assert waited.cancelled_caught
            assert sum(1 for key in keys[16:] if fetcher.flight(key).done.is_set()) == 2  # type: ignore[union-attr]
            await nursery.start(fetcher.run_writer)
            with trio.fail_after(10):
                await fetcher.writer_backlog_below(1)
                await fetcher.written(set(keys))
            nursery.cancel_scope.cancel()
        assert all(cache.contains(key) for key in keys)


@pytest.mark.trio
async def test_read_ahead_memory_counts_its_requests_until_queued_and_what_it_holds(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """`readahead_memory_bytes` (which plan prefetch leaves out of its own budget): read-ahead's
    runs from asking until their blocks are queued for the writer, then the blocks held for
    their first read; plan prefetch's own runs are not in it."""
    url, entry = big_file_hub
    keys = block_keys(entry, 24)
    with block_cache(tmp_path, 4 * BLOCKS * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)
        assert fetcher.readahead_memory_bytes() == 0
        assert WRITE_QUEUE_BYTES == 16 * BLOCK
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                async with trio.open_nursery() as runs:  # ends when each run has its last block queued
                    with hub_paused(entry["hub"]):  # no answer can come before the check (a fast one did, under load)
                        for first in range(0, 16, 4):  # the writer stopped: these fill its room (16 blocks) exactly
                            runs.start_soon(fetcher.read_ahead, keys[first : first + 4], first * BLOCK, [BLOCK] * 4)
                        await trio.testing.wait_all_tasks_blocked()
                        assert fetcher.readahead_memory_bytes() == 16 * BLOCK  # asked for
            assert fetcher.readahead_memory_bytes() == 0  # queued for the writer, none written yet
            nursery.start_soon(fetcher.read_ahead, keys[16:20], 16 * BLOCK, [BLOCK] * 4)
            await handed_over(fetcher, keys[16:20], 1)  # its first block waits for the writer's room
            assert fetcher.readahead_memory_bytes() == 4 * BLOCK  # the run that waits
            nursery.start_soon(  # a warm-up's run: not read-ahead's memory
                fetcher.warm, keys[20:24], 20 * BLOCK, [BLOCK] * 4)
            await handed_over(fetcher, keys[20:24], 1)
            assert fetcher.readahead_memory_bytes() == 4 * BLOCK
            await nursery.start(fetcher.run_writer)
            with trio.fail_after(10):
                await fetcher.written(set(keys))
            nursery.cancel_scope.cancel()
        # Written, none read: what read-ahead holds for first reads (its share at most).
        assert fetcher.readahead_memory_bytes() == BUDGET.read_ahead_held_bytes
        for key in keys[:20]:
            fetcher._held.use(key, trio.current_time())  # read: the reader's now
        assert fetcher.readahead_memory_bytes() == 0


@pytest.mark.trio
async def test_read_ahead_waiting_for_the_writer_holds_no_prefetch_slot(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """While the cache writer is behind, read-ahead's next run waits without one of the
    fetcher's prefetch connections (the plan's prefetch and sibling batches keep them all),
    and gets one once the writer catches up."""
    url, entry = big_file_hub
    keys = block_keys(entry, 24)
    with block_cache(tmp_path, 4 * BLOCKS * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)
        slots = fetcher.prefetch_slots
        got_slot = trio.Event()

        async def read_ahead_run() -> None:
            async with fetcher.prefetch_slot(writer_backlog_below=2):
                assert slots.borrowed_tokens == 1
                got_slot.set()

        async with trio.open_nursery() as nursery:
            for first in range(0, 24, 4):  # the writer stopped: its room full, 2 runs waiting
                nursery.start_soon(fetcher.read_ahead, keys[first : first + 4], first * BLOCK, [BLOCK] * 4)
            await handed_over(fetcher, keys, 16 + 2)  # the writer's room, and one block of each waiting run
            nursery.start_soon(read_ahead_run)
            await trio.testing.wait_all_tasks_blocked()
            assert not got_slot.is_set() and slots.borrowed_tokens == 0
            await nursery.start(fetcher.run_writer)
            with trio.fail_after(10):
                await got_slot.wait()
            nursery.cancel_scope.cancel()
        assert slots.borrowed_tokens == 0


@pytest.mark.trio
async def test_an_evict_during_a_fetch_that_fails_spares_the_next_fetch(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """`cachefs evict` drops the bytes of fetches under way; when such a fetch fails instead,
    the next fetch of the block is cached as usual."""
    url, entry = big_file_hub
    key = block_keys(entry, 1)[0]
    with block_cache(tmp_path, 4 * BLOCK, BLOCK) as cache, running_fault_proxy(url, 0.0, delay_s=1.0) as slow:
        fetcher = fetcher_for(slow.url, cache)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher.fetch, key, 0, BLOCK)
            await trio.testing.wait_all_tasks_blocked()  # its request is out, its answer held a second
            flight = fetcher.flight(key)
            assert flight is not None and not flight.done.is_set()
            fetcher.discard_pending(lambda k: k == key)  # what evict does
            nursery.cancel_scope.cancel()  # the fetch fails
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run_writer)
            await fetcher.fetch(key, 0, BLOCK)
            await fetcher.written({key}, timeout_s=10)
            nursery.cancel_scope.cancel()
        assert cache.contains(key)


@pytest.mark.trio
async def test_a_read_that_joins_a_fetch_late_gets_its_own_fetch_timeout(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """A reader joining a read-ahead fetch 1.5 s into that fetch's 2 s is not failed when the
    fetch gives up half a second later: the hub answers again, and the reader has 1.5 s left."""
    url, entry = big_file_hub
    key = block_keys(entry, 1)[0]
    with block_cache(tmp_path, 4 * BLOCK, BLOCK) as cache, running_fault_proxy(url, 0.0, delay_s=30.0) as slow:
        stats = Stats()
        fetcher = fetcher_for(slow.url, cache, fetch_timeout_s=2, stats=stats)
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run_writer)
            nursery.start_soon(fetcher.read_ahead, [key], 0, [BLOCK])  # its request held past its timeout
            await trio.sleep(1.5)
            slow.delay_s = 0.0  # the hub answers again
            joined = trio.current_time()
            data = await BlockSource(fetcher._held, cache, fetcher, stats).get(key, 0, BLOCK)  # joins the read-ahead's fetch
            waited_s = trio.current_time() - joined
            nursery.cancel_scope.cancel()
    assert bytes(data) == entry["path"].read_bytes()[:BLOCK]
    assert waited_s > 0.3  # it waited for the read-ahead's fetch, which gave up
    assert stats.fetch_failures == 1  # the read-ahead's


def files_and_checksums_requests(hub: HubProcess) -> tuple[float, float]:
    samples = scrape_metrics(hub)
    return tuple(  # type: ignore[return-value]
        sum(value for (name, labels), value in samples.items()
            if name == "cachefs_hub_requests_total" and dict(labels)["endpoint"] == endpoint)
        for endpoint in ("files", "checksums")
    )


@pytest.mark.trio
async def test_a_run_of_blocks_comes_with_its_checksums_in_one_request(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """Read-ahead's run of 4 blocks is checked against the checksums the hub sends in the data
    answer's header: one request, no checksums request beside it (whose answer the hub would
    only send once it had hashed a span of 64 blocks)."""
    url, entry = big_file_hub
    keys = block_keys(entry, 4)
    files_before, checksums_before = files_and_checksums_requests(entry["hub"])
    fetched: dict[BlockKey, bytes] = {}
    with block_cache(tmp_path, 8 * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)
        assert await fetcher.read_ahead(keys, 0, [BLOCK] * 4)
        fetched.update({key: bytes(fetcher._held.get(key) or b"") for key in keys})
    source = entry["path"].read_bytes()
    assert [fetched[key] for key in keys] == [source[index * BLOCK : (index + 1) * BLOCK] for index in range(4)]
    deadline = time.monotonic() + 5
    while (counts := files_and_checksums_requests(entry["hub"]))[0] < files_before + 1:  # logged once sent
        assert time.monotonic() < deadline, counts
        await trio.sleep(0.05)
    assert counts == (files_before + 1, checksums_before)


SMALL_FILES = 48
SLOTS = 4


@pytest.fixture(scope="module")
def small_files_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[dict]]]:
    root = tmp_path_factory.mktemp("hub-small")
    for number in range(SMALL_FILES):
        (root / f"f{number:02}").write_bytes(os.urandom(20_000 + number))
    with running_hub(root) as hub:
        entries = fetch_manifest(hub).files()
        yield hub.url, [{**entries[f"f{number:02}"], "path": root / f"f{number:02}"} for number in range(SMALL_FILES)]


@pytest.mark.trio
async def test_small_files_asked_one_by_one_stay_within_the_prefetch_slots(
    small_files_hub: tuple[str, list[dict]], tmp_path: Path
) -> None:
    """A hub without batches gets a request per file: at most `prefetch_slots` at once (not
    the whole walk at once, queueing demand misses behind them), and a reader of a file
    whose turn has not come fetches it at once instead of waiting behind the others."""
    url, entries = small_files_hub
    keys = [block_keys(entry, 1)[0] for entry in entries]
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache, running_fault_proxy(url, 0.0, delay_s=0.25) as slow:
        fetcher = fetcher_for(slow.url, cache, max_connections=64, prefetch_connections=SLOTS)
        fetcher.batches = False  # as after a hub answered a batch with 404
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run_writer)

            async def walk() -> None:
                async with fetcher.prefetch_slots:  # as read-ahead calls it
                    assert await fetcher.read_ahead_files(keys, [entry["s"] for entry in entries])

            nursery.start_soon(walk)
            await trio.sleep(0.1)
            asked = trio.current_time()
            last = await fetcher.fetch(keys[-1], 0, entries[-1]["s"])  # not its turn for seconds
            demand_s = trio.current_time() - asked
            await fetcher.written(set(keys), timeout_s=20)
            nursery.cancel_scope.cancel()
        assert bytes(last) == entries[-1]["path"].read_bytes()
        assert demand_s < 1.0  # one held request (0.25 s), not the walk's 48 / 4 x 0.25 s
        assert slow.most_data_in_flight <= SLOTS + 1  # the slots and the reader's request
        for key, entry in zip(keys, entries, strict=True):
            cached = cache.entry(key)
            assert cached is not None and bytes(cache.read(key, cached)) == entry["path"].read_bytes()


def test_blocks_kept_for_their_reader_are_bounded_in_bytes_and_time() -> None:
    """A stream reads them oldest first: when full, the newest are not kept; unread ones expire."""
    held = HeldBlocks(budget_of(read_ahead_held_bytes=2 * BLOCK))
    first, second, third = (BlockKey(b"f" * 8, b"v" * 8, blockno) for blockno in range(3))
    for key in (first, second, third):
        held_for_first_read(held, key, bytes(BLOCK), now=0, cached=False)
    assert held.drop(third) is None  # no room when it came
    assert held.drop(first) is not None and held.drop(first) is None  # once
    held_for_first_read(held, third, bytes(BLOCK), now=31, cached=False)  # `second` has waited too long
    assert held.drop(second) is None and held.drop(third) is not None


def test_read_ahead_claims_are_bounded_in_count_and_age() -> None:
    """A block read ahead and never read (a wrong guess of the next file, a stream given up) stops
    counting as coming after max_age_s, not only once `limit` newer blocks were read ahead."""
    claims = ReadAheadClaims(limit=3, max_age_s=60)
    keys = [BlockKey(b"f" * 8, b"v" * 8, blockno) for blockno in range(5)]
    claims.add(keys[0], now=0)
    claims.add(keys[1], now=10)
    assert claims.current(59.9) == {keys[0], keys[1]}
    assert claims.current(60) == {keys[1]} and keys[0] not in claims
    for key in keys[2:]:
        claims.add(key, now=61)
    assert claims.current(61) == set(keys[2:])  # at most 3: the oldest is forgotten
    claims.add(keys[2], now=62)  # asked for again: the newest now
    claims.add(keys[1], now=62)
    assert claims.current(62) == {keys[1], keys[2], keys[4]}
    assert claims.pop(keys[4]) and not claims.pop(keys[4]) and keys[4] not in claims
    assert claims.current(121.9) == {keys[1], keys[2]} and claims.current(122) == set()


@pytest.mark.trio
async def test_the_fetcher_forgets_read_ahead_nobody_read(
    big_file_hub: tuple[str, dict], tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """What read-ahead fetched is counted as coming (admission's `ahead`) until its age runs out."""
    url, entry = big_file_hub
    keys = block_keys(entry, 2)
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as cache:
        fetcher = fetcher_for(url, cache)
        assert await fetcher.read_ahead(keys[:1], 0, [BLOCK])
        mock_clock.jump(CLAIM_MAX_AGE_S / 2)
        assert await fetcher.read_ahead(keys[1:], BLOCK, [BLOCK])
        assert fetcher._claims.current(trio.current_time()) == set(keys)
        mock_clock.jump(CLAIM_MAX_AGE_S / 2)
        assert fetcher._claims.current(trio.current_time()) == {keys[1]}


def test_blocks_held_long_make_room_for_new_ones() -> None:
    """A block nobody came for in `stale_s` (a wrong guess of the next file, a stream given up)
    does not keep the stream's new blocks out: the oldest such make room, only as much as needed."""
    held = HeldBlocks(budget_of(read_ahead_held_bytes=2 * BLOCK, stale_s=5))
    first, second, third, fourth = (BlockKey(b"f" * 8, b"v" * 8, blockno) for blockno in range(4))
    held_for_first_read(held, first, bytes(BLOCK), now=0, cached=True)
    held_for_first_read(held, second, bytes(BLOCK), now=1, cached=True)
    held_for_first_read(held, third, bytes(BLOCK), now=4, cached=True)  # full, and nothing stale: not kept
    assert held.drop(third) is None
    held_for_first_read(held, fourth, bytes(BLOCK), now=5.5, cached=True)  # `first` waited 5 s: it makes room
    assert [held.drop(key) is not None for key in (first, second, fourth)] == [False, True, True]


def test_cached_blocks_are_not_dropped_for_a_refused_one_that_would_not_fit_anyway() -> None:
    held = HeldBlocks(budget_of(read_ahead_held_bytes=4 * BLOCK))
    refused = [BlockKey(b"f" * 8, b"v" * 8, n) for n in range(3)]
    cached, too_large = BlockKey(b"f" * 8, b"v" * 8, 3), BlockKey(b"f" * 8, b"v" * 8, 4)
    for key in refused:
        held_for_first_read(held, key, bytes(BLOCK), now=0, cached=False)
    held_for_first_read(held, cached, bytes(BLOCK // 2), now=0, cached=True)
    held_for_first_read(held, too_large, bytes(2 * BLOCK), now=0, cached=False)  # 0.5 free, 1 even without `cached`
    assert held.drop(too_large) is None and held.drop(cached) is not None


@pytest.mark.trio
async def test_blocks_evicted_while_the_writer_commits_them_are_not_held_for_their_reader(
    big_file_hub: tuple[str, dict], tmp_path: Path
) -> None:
    """`cachefs evict` (or purge) while the cache writer is writing a stream's read-ahead
    blocks: they are not kept in memory for their reader, whose next read fetches them again."""
    url, entry = big_file_hub
    keys = block_keys(entry, 4)
    with block_cache(tmp_path, 16 * BLOCK, BLOCK) as cache:
        in_write, go_on = threading.Event(), threading.Event()
        write = cache.store.write

        def held_up_write(key: BlockKey, data: bytes) -> None:
            in_write.set()
            go_on.wait(10)
            write(key, data)

        cache.store.write = held_up_write  # type: ignore[method-assign]
        fetcher = fetcher_for(url, cache)
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run_writer)
            assert await fetcher.read_ahead(keys, 0, [BLOCK] * len(keys))
            assert await trio.to_thread.run_sync(in_write.wait, 10)  # the writer is writing them
            fetcher.discard_pending(lambda key: key.file_id == keys[0].file_id)  # what evict does first
            go_on.set()
            await fetcher.written(set(keys), timeout_s=10)
            nursery.cancel_scope.cancel()
        assert [fetcher._held.get(key) for key in keys] == [None] * len(keys)


def test_blocks_the_cache_did_not_admit_take_the_place_of_cached_ones() -> None:
    """Their reader would fetch them again; a cached block can be read from disk."""
    held = HeldBlocks(budget_of(read_ahead_held_bytes=2 * BLOCK))
    cached_first, cached_second, rejected, cached_third = (BlockKey(b"f" * 8, b"v" * 8, n) for n in range(4))
    held_for_first_read(held, cached_first, bytes(BLOCK), now=0, cached=True)
    held_for_first_read(held, cached_second, bytes(BLOCK), now=0, cached=True)
    held_for_first_read(held, rejected, bytes(BLOCK), now=0, cached=False)  # the newest cached one makes room
    held_for_first_read(held, cached_third, bytes(BLOCK), now=0, cached=True)  # no room
    assert [held.drop(key) is not None for key in (cached_first, cached_second, rejected, cached_third)] == [
        True, False, True, False
    ]
