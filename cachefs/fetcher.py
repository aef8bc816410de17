"""Fetch blocks from the hub: single-flight, priorities, verified, bounded retries, group-committed caching.

Every block being fetched has a *flight*; concurrent readers of it wait on
the same flight, so a block is requested once. A run of contiguous blocks
(read-ahead) is fetched with one ranged request. Fetches retry connection
failures, timeouts, truncated bodies and 5xx answers with exponential
backoff and jitter until `fetch_timeout_s` has passed, then fail. Every
block is checked against the hub's checksum of it (checksums.py; for a
run of up to HEADER_SUMS_BLOCKS blocks, sent in the data answer's header);
a mismatch is retried like a broken connection.

Read-ahead uses at most `prefetch_connections` connections, so demand
misses always find one free. Small files prefetched together are asked for
in one batch request (hubserver/batch.py), each checked like a block and
handed to its readers as soon as it has arrived, before the rest of the batch.

Fetched blocks are handed to readers at once and written to the cache by a
single writer task that commits them in batches of up to 8 MiB (one fsync
per batch, not per block); a flight stays visible until its block is
committed, so no reader fetches a block that is on its way to disk.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import trio
import xxhash

from .cache import BlockCache, BlockData, BlockKey
from .checksums import BlockChecksums
from .errors import (
    BatchUnsupported,
    FetchAbandoned,
    HubError,
    HubProtocolError,
    HubStatusError,
    HubUnavailable,
    RemoteFileChanged,
)
from .hub_client import HubClient
from .metrics import FETCH_DURATION, Stats

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Bytes of fetched blocks waiting for the cache writer or being written: they
# bound the memory a slow disk can take; when they are all taken, fetchers
# wait (backpressure), never drop data. The writer commits up to half of them
# at once (8 blocks of 1 MiB, or ~80 small files: one fsync for all). Against
# 32 MiB, with blocks written with O_DIRECT: peak RSS of a cold read 162-171
# against 178-182 MB, the same speed (small files too).
WRITE_QUEUE_BYTES = 16 << 20
WRITE_BATCH_BYTES = WRITE_QUEUE_BYTES // 2
# Read-ahead's word that a block's first read is coming (admission counts
# that read; a read of it counts as read-ahead used) holds for this many
# blocks and this long after the block was asked for. A wrong guess of a
# reader's next file, or a stream given up, left its blocks counted as
# coming until 4,096 newer ones were read ahead (4 GiB of 1 MiB blocks):
# meanwhile the cached ones outweighed blocks a reader had used as eviction
# victims. 60 s: a window (at most 64 MiB) is read within it by any reader
# faster than ~1 MB/s; twice what read-ahead blocks are held in memory.
PREFETCHED_REMEMBERED = 4096
PREFETCHED_MAX_AGE_S = 60.0
# Runs of up to this many blocks (the hub's limit) ask for their checksums in
# the data answer's header: the hub hashes just those blocks (and so reads them
# into its page cache for the send) instead of a span of 64 before answering a
# checksums request the data waits for. One reader, cold, 60 ms uncapped: 512-521
# against 409-437 MB/s, hub CPU 0.27-0.29 against 0.36-0.51 s per 512 MiB.
HEADER_SUMS_BLOCKS = 64
# Bytes of small files fetched ahead kept in memory after their write until
# a reader takes them, so the first read of such a file does not read back
# and re-verify what was just written.
UNREAD_BYTES = 8 << 20
# Blocks of large files read ahead are kept after their write until their
# first read too, up to this many bytes and this long: written with O_DIRECT,
# they are not in the page cache, and a stream's reader read each back from
# disk in a worker thread and checked it again (4 readers of 256 MiB, cold,
# hub on loopback: 476-616 against 319-427 MB/s, daemon 1.3-1.9 against
# 2.2-3.4 CPU-s). Blocks the cache did not admit (full of blocks used more: a
# dataset larger than the cache) come first: their reader would fetch them
# again, where the others' can read them from disk. 16 MiB, not 32: the same
# speed (one reader at 60 ms uncapped 558-584 against 553-586 MB/s, four from
# a hub on loopback 553-614 against 558-581, with 8 memory blocks, not 16)
# and 10-15 MB less peak RSS (four cold readers from a hub on loopback, 32
# shards: 182-197 against 185-208 MB, the daemon's writer behind the link).
AHEAD_HELD_BYTES = 16 << 20
AHEAD_HELD_AGE_S = 30.0


class _ByteBudget:
    """Bytes taken and not yet given back, at most `limit` (one taker larger than the limit
    waits until nothing else is taken); `waiting` takers wait for room. For tasks of one
    trio run: no locking."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._taken = 0
        self.waiting = 0
        self._room = trio.Event()

    async def take(self, size: int) -> None:
        self.waiting += 1
        waited = False
        try:
            while self._taken and self._taken + size > self._limit:
                waited = True
                await self._room.wait()
        finally:
            self.waiting -= 1
            if waited:  # got room or was cancelled: one fewer waits (wait_for_fewer_waiting)
                self._wake()
        self._taken += size

    async def wait_for_fewer_waiting(self, count: int) -> None:
        """Until fewer than `count` takers wait for room."""
        while self.waiting >= count:
            await self._room.wait()

    def give_back(self, size: int) -> None:
        self._taken -= size
        self._wake()

    def _wake(self) -> None:
        """Have everyone waiting on the budget look again."""
        self._room.set()
        self._room = trio.Event()


class FetchedAhead:
    """Blocks fetched ahead of their reader, kept in memory until their first read.

    Bounded: a stream reads them oldest first, so when the bytes are used up
    the newest are not kept, except that a block the cache did not admit
    takes the place of the newest cached ones (those can be read from disk),
    and that blocks held `stale_s` or longer make room for new ones (a wrong
    guess of a reader's next file, a stream given up: nobody is coming for
    them); blocks left unread expire after `max_age_s`."""

    def __init__(self, limit_bytes: int, max_age_s: float, stale_s: float = 5.0) -> None:
        self._limit_bytes = limit_bytes
        self._max_age_s = max_age_s
        self._stale_s = stale_s
        # key -> (bytes, when held, whether the cache has them too)
        self._blocks: collections.OrderedDict[BlockKey, tuple[BlockData, float, bool]] = collections.OrderedDict()
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def hold(self, key: BlockKey, data: BlockData, now: float, cached: bool) -> None:
        self._expire(now, self._max_age_s)
        if key in self._blocks:
            return
        if self._bytes + len(data) > self._limit_bytes:
            self._expire(now, self._stale_s, room_for=len(data))
        if not cached and self._bytes + len(data) > self._limit_bytes:
            self._displace_cached(len(data))
        if self._bytes + len(data) <= self._limit_bytes:
            self._blocks[key] = (data, now, cached)
            self._bytes += len(data)

    def _expire(self, now: float, age_s: float, room_for: int | None = None) -> None:
        """Drop the oldest blocks held `age_s` or longer (only until `room_for` more bytes fit, if given)."""
        while self._blocks and now - next(iter(self._blocks.values()))[1] >= age_s:
            if room_for is not None and self._bytes + room_for <= self._limit_bytes:
                return
            self.take(next(iter(self._blocks)))

    def _displace_cached(self, size: int) -> None:
        """Make room for `size` bytes of a block the cache refused by dropping the newest held
        blocks the cache has (readable from disk); none if that cannot make enough room."""
        cached = [key for key in reversed(self._blocks) if self._blocks[key][2]]
        if self._bytes - sum(len(self._blocks[key][0]) for key in cached) + size > self._limit_bytes:
            return
        for key in cached:
            if self._bytes + size <= self._limit_bytes:
                return
            self.take(key)

    def take(self, key: BlockKey) -> BlockData | None:
        held = self._blocks.pop(key, None)
        if held is None:
            return None
        self._bytes -= len(held[0])
        return held[0]

    def discard(self, predicate: Callable[[BlockKey], bool]) -> None:
        for key in [key for key in self._blocks if predicate(key)]:
            self.take(key)


class ReadAheadClaims:
    """Blocks read ahead and not read yet, each with when it was asked for: at most
    `limit` of them (the oldest are forgotten), none asked for `max_age_s` ago or earlier."""

    def __init__(self, limit: int, max_age_s: float) -> None:
        self._limit = limit
        self._max_age_s = max_age_s
        self._asked: collections.OrderedDict[BlockKey, float] = collections.OrderedDict()

    def add(self, key: BlockKey, now: float) -> None:
        self._asked[key] = now
        self._asked.move_to_end(key)
        while len(self._asked) > self._limit:
            self._asked.popitem(last=False)
        self._expire(now)

    def pop(self, key: BlockKey) -> bool:
        """Whether the block was read ahead (and not read since); it is not any more."""
        return self._asked.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        return key in self._asked

    def current(self, now: float) -> frozenset[BlockKey]:
        """The blocks whose read is still counted as coming."""
        self._expire(now)
        return frozenset(self._asked)

    def _expire(self, now: float) -> None:
        while self._asked and now - next(iter(self._asked.values())) >= self._max_age_s:
            self._asked.popitem(last=False)


class Flight:
    """One block being fetched (and then written); waiters use `done`."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: BlockData | None = None
        self.error: HubError | None = None

    async def result(self) -> BlockData:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data


class Fetcher:
    """Gets blocks from the hub and hands them to the cache writer."""

    def __init__(
        self,
        client: HubClient,
        cache: BlockCache,
        stats: Stats,
        *,
        fetch_timeout_s: float,
        prefetch_connections: int,
        block_size: int,
    ) -> None:
        self._client = client
        self._checksums = BlockChecksums(client, block_size)
        self._block_size = block_size
        self._sums_in_header = True  # until the hub refuses it (400): then checksum requests
        self.batches = True  # small files in batches, until the hub refuses one: then one by one
        self._cache = cache
        self._stats = stats
        self._fetch_timeout_s = fetch_timeout_s
        self._flights: dict[BlockKey, Flight] = {}
        self._discarded: set[BlockKey] = set()
        self._batch_written = trio.Event()  # set (and replaced) after each committed batch
        self.requests_in_flight = 0
        # Blocks fetched by read-ahead and not read yet, to count how many are
        # used and for admission, which counts their reads as coming (bounded
        # in count and age: PREFETCHED_REMEMBERED, PREFETCHED_MAX_AGE_S).
        self.prefetched = ReadAheadClaims(PREFETCHED_REMEMBERED, PREFETCHED_MAX_AGE_S)
        self._unread: collections.OrderedDict[BlockKey, BlockData] = collections.OrderedDict()
        self._unread_bytes = 0
        self._fetched_ahead = FetchedAhead(AHEAD_HELD_BYTES, AHEAD_HELD_AGE_S)
        self._readahead_fetching_bytes = 0  # of read-ahead's requests, from asking until all of a run is queued to write
        self.prefetch_slots = trio.CapacityLimiter(max(1, prefetch_connections))
        self._write_room = _ByteBudget(WRITE_QUEUE_BYTES)
        self._write_send, self._write_receive = trio.open_memory_channel[tuple[BlockKey, BlockData, bool]](math.inf)

    async def writer_backlog_below(self, fetches: int) -> None:
        """Wait until fewer than `fetches` fetches hold fetched blocks that wait for the cache
        writer's room (each holds its bytes meanwhile)."""
        await self._write_room.wait_for_fewer_waiting(fetches)

    @contextlib.asynccontextmanager
    async def prefetch_slot(self, writer_backlog_below: int) -> AsyncIterator[None]:
        """One of `prefetch_slots`, held only while fewer than `writer_backlog_below` fetches
        wait for the cache writer's room (read-ahead: more runs would only wait in memory).
        It waits for the writer without a slot: the plan's prefetch and sibling batches
        keep the connections meanwhile."""
        while True:
            await self.writer_backlog_below(writer_backlog_below)
            await self.prefetch_slots.acquire()
            if self._write_room.waiting < writer_backlog_below:
                break
            self.prefetch_slots.release()  # the backlog grew while this waited for the slot
        try:
            yield
        finally:
            self.prefetch_slots.release()

    def readahead_memory_bytes(self) -> int:
        """Bytes read-ahead holds: its runs from asking until their last block is queued for the
        cache writer, and blocks fetched ahead and held for their first read (plan prefetch,
        which counts its own, and warm-ups are not in it)."""
        return self._readahead_fetching_bytes + self._unread_bytes + self._fetched_ahead.held_bytes

    @contextlib.contextmanager
    def _readahead_fetching(self, lengths: Sequence[int]) -> Iterator[None]:
        size = sum(lengths)
        self._readahead_fetching_bytes += size
        try:
            yield
        finally:
            self._readahead_fetching_bytes -= size

    def flight(self, key: BlockKey) -> Flight | None:
        """The block's flight if it is being fetched or written."""
        return self._flights.get(key)

    def in_flight_or_cached(self, key: BlockKey) -> bool:
        return key in self._flights or self._cache.contains(key)

    def deadline(self) -> float:
        """When a read that starts waiting now gives up (`fetch_timeout_s` from now, trio's clock)."""
        return trio.current_time() + self._fetch_timeout_s

    async def fetch(self, key: BlockKey, start: int, length: int, deadline: float | None = None) -> BlockData:
        """A demand miss: the block's bytes (raises HubError when they cannot be had by
        `deadline`, by default `fetch_timeout_s` from now). A fetch of it under way is
        joined (see `join`); when that ends without the bytes, it is fetched again."""
        if deadline is None:
            deadline = self.deadline()
        flight = self._flights.get(key)
        while flight is not None:
            data = await self.join(flight, deadline)
            if data is not None:
                return data
            flight = self._flights.get(key)  # another reader may have started it again
        flight = self._flights[key] = Flight()
        attempt = functools.partial(self._verified_range, key, start, [length])
        await self._run([key], [flight], attempt, deadline=deadline)
        return await flight.result()

    @staticmethod
    async def join(flight: Flight, deadline: float) -> BlockData | None:
        """The bytes of a fetch under way, for a reader that must have them by `deadline`.

        None when the reader should fetch the block itself: the fetch's task
        went away (a cancelled warm-up or prefetch never fails its readers), or
        the fetch gave up on a passing failure (hub down, timeouts, 5xx) while
        the reader's own time is not over: a read that joins a fetch late gets
        its whole fetch timeout, not what was left of that fetch's. A changed
        file or a refused request fails the reader at once.
        """
        try:
            return await flight.result()
        except FetchAbandoned:
            return None
        except HubError as exc:
            if _passing(exc) and deadline - trio.current_time() >= FIRST_BACKOFF_S:
                return None
            raise

    async def prefetch(
        self,
        keys: Sequence[BlockKey],
        start: int,
        lengths: Sequence[int],
        *,
        force_admission: bool = False,
        count_readahead: bool = True,
        on_fetched: Callable[[BlockKey, BlockData], None] | None = None,
    ) -> bool:
        """Fetch contiguous blocks with one request, at read-ahead priority; False if it failed.

        Read-ahead holds one of `prefetch_slots` while calling this (warm-ups
        have their own limit); the caller has filtered out blocks that are
        cached or in flight. Failures settle the flights (a reader
        then retries on demand) and are not raised. `force_admission` (for
        operator warm-ups) caches the blocks even where the admission policy
        would prefer what the cache holds. Without `count_readahead` (plan
        prefetch, which counts its own; warm-ups), readers' use is not counted
        as read-ahead used, nor is the block admitted as one read ahead
        (BlockCache.insert_many). `on_fetched` gets each block's bytes as they
        arrive, before the cache writer sees them (the planner holds them for
        readers).
        """
        flights = self._prefetch_flights(keys, count_readahead)
        attempt = functools.partial(self._verified_range, keys[0], start, list(lengths))
        with self._readahead_fetching(lengths if count_readahead else ()):
            return await self._run(list(keys), flights, attempt, force_admission, on_fetched)

    async def prefetch_files(self, keys: Sequence[BlockKey], lengths: Sequence[int]) -> bool:
        """Fetch small files whole (block 0 of each, the whole file) at read-ahead
        priority, with one batch request while the hub takes them; False if it failed.
        The caller holds one of `prefetch_slots`.

        If one of them changed on the hub (412), they are asked for one by
        one, so that only the changed one fails. A hub that does not know
        batches (an older one) is asked one by one from then on.
        """
        with self._readahead_fetching(lengths):
            return await self._prefetch_files(keys, lengths)

    async def _prefetch_files(self, keys: Sequence[BlockKey], lengths: Sequence[int]) -> bool:
        """`prefetch_files`, its bytes counted as read-ahead's memory by the caller."""
        flights = self._prefetch_flights(keys, count_readahead=True)
        if self.batches:
            attempt = functools.partial(self._verified_batch, keys, lengths, flights)
            try:
                return await self._run(
                    list(keys), flights, attempt, on_fetched=self._hold_unread, unsettled_on=(RemoteFileChanged, BatchUnsupported)
                )
            except RemoteFileChanged:
                pass  # one of them changed: asking one by one tells which
            except BatchUnsupported as exc:
                log.warning("no batches of small files from this hub (%s): asking for them one by one", exc)
                self.batches = False
        return await self._prefetch_one_by_one(keys, flights, lengths)

    async def _prefetch_one_by_one(self, keys: Sequence[BlockKey], flights: list[Flight], lengths: Sequence[int]) -> bool:
        """Small files with one request each, side by side (one round trip, not one per file)
        within `prefetch_slots`: one request at a time on the caller's slot, and one on each
        slot free. False if any failed.

        The batch's flights end first (FetchAbandoned): a file gets a flight again only
        when its request starts, so a reader never waits for a request queued behind
        read-ahead; it fetches the file itself (and the requests here skip it).
        """
        self._fail(list(keys), flights, FetchAbandoned(f"batch of {keys[0]} and others asked for one by one"))
        files = iter(zip(keys, lengths, strict=True))
        failed: list[BlockKey] = []

        async def requester(slot: contextlib.AbstractAsyncContextManager[object]) -> None:
            while True:
                async with slot:
                    key, length = next(((k, n) for k, n in files if not self.in_flight_or_cached(k)), (None, 0))
                    if key is None:
                        return
                    flight = self._flights[key] = Flight()
                    attempt = functools.partial(self._verified_range, key, 0, [length])
                    if not await self._run([key], [flight], attempt, on_fetched=self._hold_unread):
                        failed.append(key)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(requester, contextlib.nullcontext())  # the caller's slot
            for _ in range(min(len(keys), int(self.prefetch_slots.total_tokens)) - 1):
                nursery.start_soon(requester, self.prefetch_slots)
        return not failed

    def _prefetch_flights(self, keys: Sequence[BlockKey], count_readahead: bool) -> list[Flight]:
        """New flights for blocks read-ahead is about to fetch."""
        flights = []
        now = trio.current_time()
        for key in keys:
            if key in self._flights:
                raise ValueError(f"{key} is already in flight")
            flights.append(self._flights.setdefault(key, Flight()))
            if count_readahead:
                self.prefetched.add(key, now)
        return flights

    def take_unread(self, key: BlockKey) -> BlockData | None:
        """The bytes of a block read-ahead fetched and no reader has read yet, if still held
        (a small file fetched ahead, or a block of a stream's read-ahead: see FetchedAhead)."""
        data = self._unread.pop(key, None)
        if data is not None:
            self._unread_bytes -= len(data)
            return data
        return self._fetched_ahead.take(key)

    def _hold_unread(self, key: BlockKey, data: BlockData) -> None:
        """Keep a small file fetched ahead until its first read (unless a reader has it
        already, or an evict or purge dropped it while it was being fetched)."""
        if key not in self.prefetched or key in self._discarded:
            return
        self.take_unread(key)  # a block fetched again replaces its bytes
        self._unread[key] = data
        self._unread_bytes += len(data)
        while self._unread_bytes > UNREAD_BYTES:
            self._unread_bytes -= len(self._unread.popitem(last=False)[1])

    async def written(self, keys: set[BlockKey], timeout_s: float = 60.0) -> None:
        """Wait (bounded) until none of these blocks is still on its way to the cache."""
        with trio.move_on_after(timeout_s):
            while any(key in self._flights for key in keys):
                await self._batch_written.wait()

    def discard_pending(self, predicate: Callable[[BlockKey], bool]) -> None:
        """Blocks in flight that match are not written to the cache, nor held unread (evict, purge)."""
        self._discarded.update(key for key in self._flights if predicate(key))
        for key in [key for key in self._unread if predicate(key)]:
            self.take_unread(key)
        self._fetched_ahead.discard(predicate)

    async def _run(
        self,
        keys: list[BlockKey],
        flights: list[Flight],
        attempt: Callable[[], Awaitable[list[bytearray]]],
        force_admission: bool = False,
        on_fetched: Callable[[BlockKey, BlockData], None] | None = None,
        unsettled_on: tuple[type[HubError], ...] = (),
        deadline: float | None = None,
    ) -> bool:
        """Fetch `keys` with `attempt` (retried until `deadline`, by default `fetch_timeout_s`
        from now) and settle their flights; False on failure.

        The errors of `unsettled_on` are raised with the flights left open, for
        a caller that fetches the blocks another way.
        """
        try:
            pieces = await self._fetch_with_retries(keys[0], attempt, deadline)
        except unsettled_on:
            raise
        except HubError as exc:
            self._fail(keys, flights, exc)
            return False
        except BaseException:
            self._fail(keys, flights, FetchAbandoned(f"fetch of {keys[0]} was cancelled"))
            raise
        await self._settle(keys, flights, pieces, force_admission, on_fetched)
        return True

    async def _settle(
        self,
        keys: list[BlockKey],
        flights: list[Flight],
        pieces: list[bytearray],
        force_admission: bool = False,
        on_fetched: Callable[[BlockKey, BlockData], None] | None = None,
    ) -> None:
        """Hand fetched blocks to their waiters (those not handed over already), then to the
        cache writer, as its room allows: readers waiting for a flight never wait for the disk;
        the task that fetched it does (back-pressure: fetching never runs more than
        WRITE_QUEUE_BYTES ahead of the cache's disk, which bounds the memory they hold)."""
        for key, flight, data in zip(keys, flights, pieces, strict=True):
            self._hand_over(key, flight, data, on_fetched)
        queued = 0
        try:
            for key, data in zip(keys, pieces, strict=True):
                await self._write_room.take(len(data))
                self._write_send.send_nowait((key, data, force_admission))
                queued += 1
        except BaseException:  # cancelled while waiting for room: the rest are not cached, nor in flight
            for key, flight in zip(keys[queued:], flights[queued:], strict=True):
                self._forget(key, flight)
            raise

    @staticmethod
    def _hand_over(
        key: BlockKey, flight: Flight, data: BlockData, on_fetched: Callable[[BlockKey, BlockData], None] | None
    ) -> None:
        """A block's verified bytes to whoever waits for it, once."""
        if flight.done.is_set():
            return
        flight.data = data
        flight.done.set()
        if on_fetched is not None:
            on_fetched(key, data)

    def _fail(self, keys: list[BlockKey], flights: list[Flight], error: HubError) -> None:
        """End flights without a result (a flight handed its bytes over already keeps them, uncached)."""
        for key, flight in zip(keys, flights, strict=True):
            if not flight.done.is_set():
                flight.error = error
                flight.done.set()
            self._forget(key, flight)

    def _forget(self, key: BlockKey, flight: Flight) -> None:
        """A flight that will not reach the cache writer (failed, or cancelled before its turn):
        the next fetch of its block starts afresh, and an evict's mark meant this one's bytes."""
        if self._flights.get(key) is flight:
            del self._flights[key]
            self._discarded.discard(key)

    async def run_writer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background task: commit fetched blocks to the cache in batches."""
        task_status.started()
        async with self._write_receive:
            async for first in self._write_receive:
                batch = [first]
                batch_bytes = len(first[1])
                while batch_bytes < WRITE_BATCH_BYTES:
                    try:
                        batch.append(self._write_receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                    batch_bytes += len(batch[-1][1])
                kept = [item for item in batch if item[0] not in self._discarded]
                ahead = self.prefetched.current(trio.current_time())  # read ahead, not read yet: offered or cached
                try:
                    if kept:
                        await trio.to_thread.run_sync(self._cache.insert_many, kept, ahead)
                        self._hold_fetched_ahead([(key, data) for key, data, _force in kept if key in ahead])
                finally:
                    for key, _data, _force in batch:
                        self._flights.pop(key, None)
                        self._discarded.discard(key)
                    self._write_room.give_back(batch_bytes)
                    self._batch_written.set()
                    self._batch_written = trio.Event()

    def _hold_fetched_ahead(self, blocks: list[tuple[BlockKey, BlockData]]) -> None:
        """Keep the blocks read ahead that were not read meanwhile, not held already (small
        files) and not dropped by an evict or purge while they were written, until their
        first read."""
        now = trio.current_time()
        for key, data in blocks:
            if key in self.prefetched and key not in self._unread and key not in self._discarded:
                self._fetched_ahead.hold(key, data, now, cached=self._cache.contains(key))

    async def _verified_range(self, key: BlockKey, start: int, lengths: list[int]) -> list[bytearray]:
        """One attempt: the data, checked against the hub's checksums of it.

        The checksums come from memory, or in the data answer's header (a
        hub that sent them only for some of the blocks, as a cache answering
        from slices may, is asked for the rest), or from a checksum request
        side by side with the data (a hub that refuses them in the header).
        """
        count = len(lengths)
        expected = self._checksums.known(key, count)
        if expected is not None:
            pieces, _ = await self._client.get_range(key.file_id.hex(), key.version.hex(), start, lengths)
        elif count <= HEADER_SUMS_BLOCKS and self._sums_in_header:
            try:
                pieces, sums = await self._client.get_range(
                    key.file_id.hex(), key.version.hex(), start, lengths, sums_block_size=self._block_size
                )
            except HubStatusError as exc:
                if exc.status != 400:
                    raise
                log.warning("the hub does not send checksums with data (an older hub?): asking for them apart")
                self._sums_in_header = False
                pieces, expected = await self._data_and_sums(key, start, lengths)
            else:
                self._checksums.remember(key, sums)
                expected = self._checksums.known(key, count) or await self._checksums.expected(key, count)
        else:
            pieces, expected = await self._data_and_sums(key, start, lengths)
        offset = self._first_mismatch(pieces, expected)
        if offset is not None:
            self._checksums.forget(key, count)
            raise HubProtocolError(f"block {key.blockno + offset} of file {key.file_id.hex()} failed its checksum")
        return pieces

    async def _verified_batch(
        self, keys: Sequence[BlockKey], lengths: Sequence[int], flights: Sequence[Flight]
    ) -> list[bytearray]:
        """One attempt at a batch of whole small files, each checked against the hub's checksum
        and handed to its waiters as soon as it has arrived (not after the whole batch)."""

        def arrived(index: int, piece: bytearray, checksum: int) -> None:
            if self._first_mismatch([piece], [checksum]) is not None:
                raise HubProtocolError(f"file {keys[index].file_id.hex()} of a batch failed its checksum")
            self._hand_over(keys[index], flights[index], piece, self._hold_unread)

        files = [(key.file_id.hex(), key.version.hex()) for key in keys]
        return await self._client.get_batch(files, lengths, self._block_size, arrived)

    def _first_mismatch(self, pieces: list[bytearray], expected: Sequence[int]) -> int | None:
        """The index of the first piece whose xxh3 is not the hub's (counted as an integrity failure), or None."""
        for index, (piece, checksum) in enumerate(zip(pieces, expected, strict=True)):
            if xxhash.xxh3_64_intdigest(piece) != checksum:
                self._stats.integrity_failures += 1
                return index
        return None

    async def _data_and_sums(self, key: BlockKey, start: int, lengths: list[int]) -> tuple[list[bytearray], list[int]]:
        """The data request and the checksum request, side by side (no extra round trip)."""
        results: dict[str, Any] = {}

        async def get(name: str, request: Callable[[], Awaitable[Any]]) -> None:
            try:
                results[name] = await request()
            except HubError as exc:
                results.setdefault("error", exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, "sums", lambda: self._checksums.expected(key, len(lengths)))
            nursery.start_soon(
                get, "pieces", lambda: self._client.get_range(key.file_id.hex(), key.version.hex(), start, lengths)
            )
        if "error" in results:
            raise results["error"]
        return results["pieces"][0], results["sums"]

    async def _fetch_with_retries(
        self, key: BlockKey, attempt_once: Callable[[], Awaitable[list[bytearray]]], deadline: float | None = None
    ) -> list[bytearray]:
        """`attempt_once()` until it succeeds or `deadline` (by default `fetch_timeout_s` from
        now) has passed (`key` names it in logs)."""
        if deadline is None:
            deadline = self.deadline()
        backoff_s = FIRST_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            started = trio.current_time()
            self.requests_in_flight += 1
            try:
                with trio.fail_after(max(0.0, deadline - trio.current_time())):
                    pieces = await attempt_once()
                self._stats.fetches += 1
                self._stats.fetched_bytes += sum(len(piece) for piece in pieces)
                FETCH_DURATION.observe(trio.current_time() - started)
                return pieces
            except trio.TooSlowError:
                self._stats.hub_errors["timeout"] += 1
                error: HubError = HubUnavailable(f"hub did not deliver {key} within {self._fetch_timeout_s:g} s")
            except HubUnavailable as exc:
                self._stats.hub_errors["connection"] += 1
                error = exc
            except HubProtocolError as exc:
                self._stats.hub_errors["protocol"] += 1
                error = exc
            except RemoteFileChanged:
                self._stats.hub_errors["changed"] += 1
                self._stats.fetch_failures += 1
                raise
            except HubStatusError as exc:
                self._stats.hub_errors[f"http_{exc.status // 100}xx"] += 1
                if not exc.retryable:
                    self._stats.fetch_failures += 1
                    raise
                error = exc
            finally:
                self.requests_in_flight -= 1
            pause_s = random.uniform(0, backoff_s)  # full jitter
            if trio.current_time() + pause_s >= deadline:
                log.warning("giving up on %s after %d attempts: %s", key, attempt, error)
                self._stats.fetch_failures += 1
                raise error
            log.info("fetching %s failed (%s); retry %d in %.2f s", key, error, attempt, pause_s)
            self._stats.fetch_retries += 1
            await trio.sleep(pause_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)


def _passing(error: HubError) -> bool:
    """Whether a failure may be gone on a later try (the ones fetches retry)."""
    if isinstance(error, HubStatusError):
        return error.retryable
    return isinstance(error, (HubUnavailable, HubProtocolError))
